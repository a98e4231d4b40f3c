# C declarations of team.h: a rank's helper threads for the kernels of a blocking collective.

from libc.stdint cimport uint64_t
from kernels cimport eng_reduce_fn

cdef extern from "team.h" nogil:
    enum: ENG_TEAM_MAX_THREADS
    ctypedef struct eng_team:
        int n
        size_t slice_min
        double spin
        uint64_t shared
    uint64_t *eng_raise_counter_swap(uint64_t *c)
    int eng_team_start(eng_team *t, int n, int maxsrc, double spin)
    void eng_team_stop(eng_team *t)
    void eng_team_reduce(eng_team *t, eng_reduce_fn fn, void *dst1, void *dst2, const void *const *srcs,
                         int nsrc, size_t n, size_t itemsize, int dtype, double divisor)
    void eng_team_copy(eng_team *t, void *dst, const void *src, size_t nbytes)
