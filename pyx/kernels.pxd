# distutils: depends = kernels_body.h
# (kernels.h includes kernels_body.h, an #include cythonize doesn't follow: every module that cimports
# this file is rebuilt when it changes.)
# C declarations of kernels.h (the kernels themselves are plain C, in kernels_body.h, compiled once per ISA).

cdef extern from "kernels.h" nogil:
    enum:
        ENG_BOOL, ENG_INT8, ENG_UINT8, ENG_INT16, ENG_UINT16, ENG_INT32, ENG_UINT32,
        ENG_INT64, ENG_UINT64, ENG_FLOAT16, ENG_BFLOAT16, ENG_FLOAT32, ENG_FLOAT64,
        ENG_COMPLEX64, ENG_COMPLEX128, ENG_FLOAT8_E4M3FN, ENG_FLOAT8_E5M2, ENG_FLOAT8_E4M3FNUZ,
        ENG_FLOAT8_E5M2FNUZ, ENG_FLOAT8_E8M0FNU, ENG_FLOAT4_E2M1FN_X2, ENG_NDTYPES
    enum:
        ENG_SUM, ENG_PRODUCT, ENG_MIN, ENG_MAX, ENG_BAND, ENG_BOR, ENG_BXOR, ENG_NOPS

    const size_t eng_itemsize[]

    ctypedef void (*eng_reduce_fn)(void *dst, const void *a, const void *b, size_t n) noexcept nogil

    enum:
        ENG_ISA_BASELINE, ENG_NISAS
    const char *const eng_isa_names[]
    int eng_isa_use(int isa)
    int eng_isa_built(int isa)
    int eng_isa_supported(int isa)
    size_t eng_isa_slot()
    void eng_isa_bind(size_t slot)
    size_t eng_isa_table()

    eng_reduce_fn eng_reduce_lookup(int dtype, int op)
    int eng_scale(void *data, size_t n, int dtype, double factor, int divide)
    double eng_avg_spread(double size)
    int eng_convertible(int d, int s, double scale)
    int eng_move_range(int to_flat, void *flat, int flat_dtype, size_t flat_itemsize, void *const *parts,
                       const size_t *counts, size_t nparts, int part_dtype, size_t part_itemsize, double scale,
                       size_t off, size_t n)
    void eng_reduce_many(eng_reduce_fn fn, void *dst1, void *dst2, const void *const *srcs, int nsrc,
                         size_t n, size_t itemsize, int dtype, double divisor)
