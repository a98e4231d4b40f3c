# C declarations of shm.h: atomics, clocks, the segment and peer liveness.

from libc.stdint cimport uint32_t, uint64_t

cdef extern from "shm.h" nogil:
    uint64_t eng_load_acquire(const uint64_t *p)
    uint64_t eng_load_relaxed(const uint64_t *p)
    void eng_store_release(uint64_t *p, uint64_t v)
    uint32_t eng_load32(const uint32_t *p)
    void eng_store32(uint32_t *p, uint32_t v)
    void eng_add32(uint32_t *p)
    void eng_sub32(uint32_t *p)
    bint eng_cas64(uint64_t *p, uint64_t expected, uint64_t desired)
    void eng_fence()
    void eng_futex_wait(uint32_t *addr, uint32_t val, double seconds)
    void eng_futex_wake(uint32_t *addr)
    void eng_cpu_relax()
    double eng_now()
    void eng_sleep(double seconds)
    void eng_yield()
    enum:
        ENG_ATTACH_OWNER, ENG_ATTACH_MODE, ENG_ATTACH_SIZE, ENG_ATTACH_KIND
    int eng_seg_create(size_t size, int *fd_out, void **base_out)
    int eng_seg_attach(int pid, int fd, size_t size, void **base_out)
    void eng_seg_unmap(void *base, size_t size)
    void eng_seg_populate(void *addr, size_t size)
    void eng_close(int fd)
    int eng_random(void *buf, size_t n)
    size_t eng_cma_probe_addr()
    uint64_t eng_cma_probe_value()
    int eng_cma_copy(int pid, void *local, size_t remote, size_t n, int write)
    int eng_pidfd_open(int pid)
    int eng_pid_alive(int pidfd, int pid)
