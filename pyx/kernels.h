/* Element-wise kernels of the engine: reductions, scaling, pack/unpack.
 *
 * The kernels themselves are plain C in kernels_body.h, compiled here once per instruction set
 * (baseline; on x86-64 also AVX2 and AVX-512) so the compiler vectorises each copy for its target;
 * a table per ISA holds them, and the calls below go through the active table (engine._core chooses
 * it at import from ENGINE_ISA or the CPU). Every function is GIL-free by construction. dtype and op
 * codes are defined here once and read by Cython through kernels.pxd.
 */
#ifndef ENGINE_KERNELS_H
#define ENGINE_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum eng_dtype {
  ENG_BOOL, ENG_INT8, ENG_UINT8, ENG_INT16, ENG_UINT16, ENG_INT32, ENG_UINT32,
  ENG_INT64, ENG_UINT64, ENG_FLOAT16, ENG_BFLOAT16, ENG_FLOAT32, ENG_FLOAT64,
  ENG_COMPLEX64, ENG_COMPLEX128,
  /* Formats that move but are never reduced (as Gloo and NCCL before 2.24 treat them): no kernel
   * row, so every reduce op on them is refused by name (engine._core's resolve_op). */
  ENG_FLOAT8_E4M3FN, ENG_FLOAT8_E5M2, ENG_FLOAT8_E4M3FNUZ, ENG_FLOAT8_E5M2FNUZ, ENG_FLOAT8_E8M0FNU,
  ENG_FLOAT4_E2M1FN_X2, ENG_NDTYPES
};

enum eng_op {
  ENG_SUM, ENG_PRODUCT, ENG_MIN, ENG_MAX, ENG_BAND, ENG_BOR, ENG_BXOR, ENG_NOPS
};

/* Bytes per element of each dtype. */
static const size_t eng_itemsize[ENG_NDTYPES] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8, 8, 16, 1, 1, 1, 1, 1, 1};

/* dst[i] = a[i] (op) b[i]; dst may alias a or b. */
typedef void (*eng_reduce_fn)(void *dst, const void *a, const void *b, size_t n);

static inline float eng_f32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t eng_f32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* Two 16-bit elements in one 32-bit word (the 16-bit float loops of kernels_body.h): each element
 * moved into the word's high half, and two results (each in the low 16 bits) merged back. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define ENG_FIRST_HI(w) ((w) & 0xFFFF0000u)
#define ENG_SECOND_HI(w) ((w) << 16)
#define ENG_PAIR(first, second) (((first) << 16) | (second))
#else
#define ENG_FIRST_HI(w) ((w) << 16)
#define ENG_SECOND_HI(w) ((w) & 0xFFFF0000u)
#define ENG_PAIR(first, second) (((second) << 16) | (first))
#endif

/* ---- the kernels, once per instruction set ---- */

/* What one ISA's copy of kernels_body.h provides. */
struct eng_kernel_table {
  eng_reduce_fn reduce[ENG_NDTYPES][ENG_NOPS];
  int (*scale)(void *data, size_t n, int dtype, double factor, int divide);
  int (*cast)(void *dst, int d, const void *src, int s, size_t n, double scale);
};

/* The ISAs, lowest first. baseline: what the compiler targets by default (x86-64: SSE2; aarch64:
 * NEON). The others exist on x86-64 built by GCC or Clang; a CPU runs one when it has every feature
 * its target names (and the OS saves those registers, which __builtin_cpu_supports checks). */
enum eng_isa { ENG_ISA_BASELINE, ENG_ISA_AVX2, ENG_ISA_AVX512, ENG_NISAS };
static const char *const eng_isa_names[ENG_NISAS] = {"baseline", "avx2", "avx512"};

/* Around the bfloat16 reductions, whose widening and rounding make them compute-bound: the vector
 * width that suits them where it differs from the table's (the avx512 table below), else nothing. */
#define ENG_WIDE_BEGIN
#define ENG_WIDE_END

#define ENG_ISA baseline
#define ENG_F16C 0
#include "kernels_body.h"
#undef ENG_F16C
#undef ENG_ISA

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>   /* F16C's conversions (kernels_body.h's float16 loops); both x86 ISAs have them */
#define ENG_F16C 1
#define ENG_STR(...) #__VA_ARGS__
#if defined(__clang__)
#define ENG_TARGET_BEGIN(T) _Pragma(ENG_STR(clang attribute push (__attribute__((target(T))), apply_to = function)))
#define ENG_TARGET_END _Pragma("clang attribute pop")
#else
#define ENG_TARGET_BEGIN(T) _Pragma("GCC push_options") _Pragma(ENG_STR(GCC target(T)))
#define ENG_TARGET_END _Pragma("GCC pop_options")
#endif

ENG_TARGET_BEGIN("avx2,bmi,bmi2,popcnt,lzcnt,f16c")
#define ENG_ISA avx2
#include "kernels_body.h"
#undef ENG_ISA
ENG_TARGET_END

ENG_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,bmi,bmi2,popcnt,lzcnt,f16c")
#if !defined(__clang__)
/* GCC: 256-bit vectors with AVX-512's instructions (masks, wider shuffles), as GCC's own tunings for
 * Intel's AVX-512 CPUs choose. On an AMD EPYC that runs AVX-512 as two 256-bit halves, 512-bit loops
 * ran the float and integer sums below the AVX2 table's; at 256 bits they match it. The bfloat16
 * reductions, bound by their arithmetic rather than by memory, ran faster at 512 bits on both CPUs
 * seen (EPYC: about 9%; Intel Xeon: 30-55% at 1 MB), so they keep the full width (docs/tuning.md,
 * "The kernels against memcpy"). */
#pragma GCC target("prefer-vector-width=256")
#undef ENG_WIDE_BEGIN
#undef ENG_WIDE_END
#define ENG_WIDE_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"prefer-vector-width=512\")")
#define ENG_WIDE_END _Pragma("GCC pop_options")
#endif
#define ENG_ISA avx512
#include "kernels_body.h"
#undef ENG_ISA
ENG_TARGET_END

#undef ENG_F16C

static const struct eng_kernel_table *const eng_isa_tables[ENG_NISAS] = {
  &eng_kernels_baseline, &eng_kernels_avx2, &eng_kernels_avx512};

/* 1 when this CPU runs the ISA's code. */
static inline int eng_isa_supported(int isa) {
  __builtin_cpu_init();
  switch (isa) {
  case ENG_ISA_BASELINE: return 1;
  case ENG_ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2")
                            && __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("f16c");
  case ENG_ISA_AVX512: return eng_isa_supported(ENG_ISA_AVX2) && __builtin_cpu_supports("avx512f")
                              && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
                              && __builtin_cpu_supports("avx512dq");
  default: return 0;
  }
}
#else
static const struct eng_kernel_table *const eng_isa_tables[ENG_NISAS] = {&eng_kernels_baseline, NULL, NULL};
static inline int eng_isa_supported(int isa) { return isa == ENG_ISA_BASELINE; }
#endif

/* The table every dispatching call below reads. engine._core chooses it at import (ENGINE_ISA, else
 * the highest ISA the CPU runs); engine._mpi, which compiles this header too, points its
 * eng_kernels_active at _core's (eng_isa_bind), so one choice holds for the whole process. */
static const struct eng_kernel_table *eng_kernels_chosen = &eng_kernels_baseline;
static const struct eng_kernel_table *const *eng_kernels_active = &eng_kernels_chosen;

/* Makes isa the active one; -1 when this build lacks it or this CPU can't run it. */
static inline int eng_isa_use(int isa) {
  if (isa < 0 || isa >= ENG_NISAS || eng_isa_tables[isa] == NULL || !eng_isa_supported(isa)) return -1;
  eng_kernels_chosen = eng_isa_tables[isa];
  return 0;
}

static inline int eng_isa_built(int isa) { return isa >= 0 && isa < ENG_NISAS && eng_isa_tables[isa] != NULL; }

/* The address to give eng_isa_bind in another module. */
static inline size_t eng_isa_slot(void) { return (size_t)&eng_kernels_chosen; }
static inline void eng_isa_bind(size_t slot) {
  eng_kernels_active = (const struct eng_kernel_table *const *)slot;
}
/* The address of the table this module's calls read now (tests compare engine._mpi's with engine._core's). */
static inline size_t eng_isa_table(void) { return (size_t)*eng_kernels_active; }

static inline eng_reduce_fn eng_reduce_lookup(int dtype, int op) {
  if (dtype < 0 || dtype >= ENG_NDTYPES || op < 0 || op >= ENG_NOPS) return NULL;
  return (*eng_kernels_active)->reduce[dtype][op];
}

/* x = x * factor, or x / factor (divide); floating dtypes. Returns 0, or -1 for another dtype. */
static inline int eng_scale(void *data, size_t n, int dtype, double factor, int divide) {
  return (*eng_kernels_active)->scale(data, n, dtype, factor, divide);
}

/* ---- pack / unpack with fused scale and cast ---- */

/* Copies n elements from src (dtype s) to dst (dtype d), multiplying by scale when scale != 1.
 * Supported: s == d (any dtype when scale == 1, floating types otherwise), and
 * float32 <-> float16 / bfloat16. Returns 0, -2 when the caller should copy bytes (same dtype, no
 * scale), or -1 for an unsupported pair. */
static int eng_convert(void *dst, int d, const void *src, int s, size_t n, double scale) {
  if (s == d && scale == 1.0) return -2;
  if (s == d) {
    if (dst != src) memmove(dst, src, n * eng_itemsize[d]);
    return eng_scale(dst, n, d, scale, 0);
  }
  return (*eng_kernels_active)->cast(dst, d, src, s, n, scale);
}

static inline int eng_convertible(int d, int s, double scale) {
  if (s == d) return scale == 1.0 || d == ENG_FLOAT32 || d == ENG_FLOAT64 || d == ENG_FLOAT16 || d == ENG_BFLOAT16;
  if (s == ENG_FLOAT32) return d == ENG_FLOAT16 || d == ENG_BFLOAT16;
  if (d == ENG_FLOAT32) return s == ENG_FLOAT16 || s == ENG_BFLOAT16;
  return 0;
}

/* Moves elements [off, off + n) of concat(parts) to flat (to_flat: pack) or back out of it (unpack),
 * converting between the parts' dtype and the flat buffer's (scale applied on the way). flat holds just
 * those elements: the fused shared-memory path packs and unpacks a bucket chunk by chunk, straight into
 * and out of the segment; off 0 and n SIZE_MAX is the whole bucket. */
static int eng_move_range(int to_flat, void *flat, int flat_dtype, size_t flat_itemsize, void *const *parts,
                          const size_t *counts, size_t nparts, int part_dtype, size_t part_itemsize, double scale,
                          size_t off, size_t n) {
  char *f = (char *)flat;
  size_t start = 0;
  for (size_t k = 0; k < nparts && n; k++) {
    const size_t end = start + counts[k];
    if (end > off) {
      const size_t skip = off > start ? off - start : 0;
      const size_t m = counts[k] - skip < n ? counts[k] - skip : n;
      char *p = (char *)parts[k] + skip * part_itemsize;
      int rc = to_flat ? eng_convert(f, flat_dtype, p, part_dtype, m, scale)
                       : eng_convert(p, part_dtype, f, flat_dtype, m, scale);
      if (rc == -2) memcpy(to_flat ? f : p, to_flat ? p : f, m * part_itemsize);  /* same dtype, no scale */
      else if (rc) return rc;
      f += m * flat_itemsize;
      off += m;
      n -= m;
    }
    start = end;
  }
  return 0;
}

/* ---- many-input reduction (the shared-memory collectives) ---- */

#define ENG_REDUCE_BLOCK 8192 /* bytes: an L1-resident staging block */

/* BODY(T, MASK) for a float dtype (16-, 32- or 64-bit): its bits' type and exponent mask, all ones in
 * an inf or a NaN; OTHER for any other dtype. */
#define ENG_BY_FLOAT_MASK(BODY, OTHER)                                                   \
  switch (dtype) {                                                                       \
  case ENG_FLOAT16: BODY(uint16_t, 0x7c00u)                                              \
  case ENG_BFLOAT16: BODY(uint16_t, 0x7f80u)                                             \
  case ENG_FLOAT32: BODY(uint32_t, 0x7f800000u)                                          \
  case ENG_FLOAT64: BODY(uint64_t, 0x7ff0000000000000ull)                                \
  default: OTHER;                                                                        \
  }

/* Whether any of n floats of dtype is inf or NaN. */
#define ENG_ANY_NONFINITE(T, MASK)                                                       \
  {                                                                                      \
    const T *x = (const T *)data; T hit = 0;                                             \
    for (size_t i = 0; i < n; i++) hit |= (T)((x[i] & (MASK)) == (MASK));                \
    return hit != 0;                                                                     \
  }
static int eng_any_nonfinite(const void *data, size_t n, int dtype) {
  ENG_BY_FLOAT_MASK(ENG_ANY_NONFINITE, return 0)
}

/* Each of n floats of dtype that is inf or NaN takes alt's element in its place. */
#define ENG_TAKE_NONFINITE(T, MASK)                                                      \
  {                                                                                      \
    T *x = (T *)data; const T *y = (const T *)alt;                                       \
    for (size_t i = 0; i < n; i++)                                                       \
      if ((x[i] & (MASK)) == (MASK)) x[i] = y[i];                                        \
    return;                                                                              \
  }
static void eng_take_nonfinite(void *data, const void *alt, size_t n, int dtype) {
  ENG_BY_FLOAT_MASK(ENG_TAKE_NONFINITE, return)
}

/* AVG's first divisor: the power of two at or over the group size (1 for a group of one), which divides
 * any float exactly (in its normal range), so a sum of inputs divided by it is the plain sum divided,
 * wherever that fits. */
static inline double eng_avg_spread(double size) {
  double spread = 1.0;
  while (spread < size) spread *= 2;
  return spread;
}

/* dst1 (and dst2 unless NULL) = srcs[0] op srcs[1] op ... op srcs[nsrc - 1], in that order (so every
 * rank that reduces the same inputs gets the same bits), divided by `divisor` when it is not 0 (AVG).
 * AVG's elements whose sum comes out inf or NaN are made again from the inputs divided first by the
 * power of two at or over the divisor, then divided by what is left, as CoreComm's avg_before does
 * for the other algorithms: a mean that fits the dtype never comes back as an overflowed sum. The
 * others keep the plain sum's bits, divided once (a whole block made again lost the bits of its tiny
 * elements, which the first division takes below the dtype's normal range); inputs already inf or
 * NaN give what they gave. Works through L1-resident blocks, so a destination may alias any source. */
static void eng_reduce_many(eng_reduce_fn fn, void *dst1, void *dst2, const void *const *srcs, int nsrc,
                            size_t n, size_t itemsize, int dtype, double divisor) {
  _Alignas(64) char tmp[ENG_REDUCE_BLOCK];
  _Alignas(64) char part[ENG_REDUCE_BLOCK];
  _Alignas(64) char alt[ENG_REDUCE_BLOCK];
  const size_t per = ENG_REDUCE_BLOCK / itemsize;
  const double spread = eng_avg_spread(divisor);
  if (nsrc == 2 && dst2 == NULL && divisor == 0.0) { /* one element-wise pass: dst may alias either source */
    fn(dst1, srcs[0], srcs[1], n);
    return;
  }
  for (size_t off = 0; off < n; off += per) {
    const size_t m = n - off < per ? n - off : per;
    const size_t b = off * itemsize;
    double left = divisor;
    if (nsrc == 1) {
      memcpy(tmp, (const char *)srcs[0] + b, m * itemsize);
    } else {
      fn(tmp, (const char *)srcs[0] + b, (const char *)srcs[1] + b, m);
      for (int k = 2; k < nsrc; k++) fn(tmp, tmp, (const char *)srcs[k] + b, m);
      if (divisor != 0.0 && eng_any_nonfinite(tmp, m, dtype)) {
        memcpy(alt, (const char *)srcs[0] + b, m * itemsize);
        eng_scale(alt, m, dtype, 1.0 / spread, 0);
        for (int k = 1; k < nsrc; k++) {
          memcpy(part, (const char *)srcs[k] + b, m * itemsize);
          eng_scale(part, m, dtype, 1.0 / spread, 0);
          fn(alt, alt, part, m);
        }
        if (divisor != spread) eng_scale(alt, m, dtype, divisor / spread, 1);
        eng_scale(tmp, m, dtype, divisor, 1);
        eng_take_nonfinite(tmp, alt, m, dtype);
        left = 0.0;
      }
    }
    if (left != 0.0 && left != 1.0) eng_scale(tmp, m, dtype, left, 1);
    memcpy((char *)dst1 + b, tmp, m * itemsize);
    if (dst2 != NULL) memcpy((char *)dst2 + b, tmp, m * itemsize);
  }
}

#endif
