/* Element-wise kernels of the engine: reductions, scaling, pack/unpack.
 *
 * Plain C so the compiler vectorises the loops (built with -O3); every function is
 * GIL-free by construction. dtype and op codes are defined here once and read by
 * Cython through kernels.pxd.
 */
#ifndef ENGINE_KERNELS_H
#define ENGINE_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum eng_dtype {
  ENG_BOOL, ENG_INT8, ENG_UINT8, ENG_INT16, ENG_UINT16, ENG_INT32, ENG_UINT32,
  ENG_INT64, ENG_UINT64, ENG_FLOAT16, ENG_BFLOAT16, ENG_FLOAT32, ENG_FLOAT64,
  ENG_COMPLEX64, ENG_COMPLEX128, ENG_NDTYPES
};

enum eng_op {
  ENG_SUM, ENG_PRODUCT, ENG_MIN, ENG_MAX, ENG_BAND, ENG_BOR, ENG_BXOR, ENG_NOPS
};

/* Bytes per element of each dtype. */
static const size_t eng_itemsize[ENG_NDTYPES] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8, 8, 16};

/* dst[i] = a[i] (op) b[i]; dst may alias a or b. */
typedef void (*eng_reduce_fn)(void *dst, const void *a, const void *b, size_t n);

/* ---- float16 / bfloat16 <-> float32, round to nearest even, branch-free ---- */

static inline float eng_f32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t eng_f32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* IEEE half -> float (after M. Dukhan's FP16 library, MIT). */
static inline float eng_half_to_float(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = eng_f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = eng_f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (1u << 27) ? eng_f32_to_bits(denormalized)
                                                     : eng_f32_to_bits(normalized));
  return eng_f32_from_bits(result);
}

/* float -> IEEE half with round to nearest even; NaN stays NaN, overflow gives inf. */
static inline uint16_t eng_float_to_half(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = eng_f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = eng_f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = eng_f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float eng_bf16_to_float(uint16_t h) { return eng_f32_from_bits((uint32_t)h << 16); }

/* Same rounding as torch's c10::BFloat16 (round_to_nearest_even, NaN -> 0x7FC0). */
static inline uint16_t eng_float_to_bf16(float f) {
  const uint32_t w = eng_f32_to_bits(f);
  const uint32_t rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

/* ---- reductions ---- */

#define ENG_LOOP(NAME, T, EXPR)                                                    \
  static void NAME(void *dst_, const void *a_, const void *b_, size_t n) {        \
    T *dst = (T *)dst_; const T *a = (const T *)a_; const T *b = (const T *)b_;   \
    for (size_t i = 0; i < n; i++) { const T x = a[i], y = b[i]; dst[i] = (T)(EXPR); } \
  }

/* Reduced in float32, rounded once: matches torch's half and bfloat16 arithmetic. */
#define ENG_LOOP16(NAME, TO_F, FROM_F, EXPR)                                       \
  static void NAME(void *dst_, const void *a_, const void *b_, size_t n) {        \
    uint16_t *dst = (uint16_t *)dst_;                                             \
    const uint16_t *a = (const uint16_t *)a_, *b = (const uint16_t *)b_;          \
    for (size_t i = 0; i < n; i++) {                                              \
      const float x = TO_F(a[i]), y = TO_F(b[i]); dst[i] = FROM_F((float)(EXPR)); \
    }                                                                             \
  }

/* MIN/MAX propagate NaN, as torch.minimum / torch.maximum do. */
#define ENG_MIN_EXPR ((x < y || x != x) ? x : y)
#define ENG_MAX_EXPR ((x > y || x != x) ? x : y)

/* Integers: the build passes -fwrapv, so signed overflow wraps like torch's. */
#define ENG_INT_KERNELS(SUFFIX, T)                 \
  ENG_LOOP(eng_sum_##SUFFIX, T, x + y)             \
  ENG_LOOP(eng_prod_##SUFFIX, T, x * y)            \
  ENG_LOOP(eng_min_##SUFFIX, T, x < y ? x : y)     \
  ENG_LOOP(eng_max_##SUFFIX, T, x > y ? x : y)     \
  ENG_LOOP(eng_band_##SUFFIX, T, x & y)            \
  ENG_LOOP(eng_bor_##SUFFIX, T, x | y)             \
  ENG_LOOP(eng_bxor_##SUFFIX, T, x ^ y)

ENG_INT_KERNELS(i8, int8_t)
ENG_INT_KERNELS(u8, uint8_t)
ENG_INT_KERNELS(i16, int16_t)
ENG_INT_KERNELS(u16, uint16_t)
ENG_INT_KERNELS(i32, int32_t)
ENG_INT_KERNELS(u32, uint32_t)
ENG_INT_KERNELS(i64, int64_t)
ENG_INT_KERNELS(u64, uint64_t)

/* bool as bytes holding 0/1: SUM and MAX are OR, PRODUCT and MIN are AND (torch's bool arithmetic). */
ENG_LOOP(eng_or_bool, uint8_t, x | y)
ENG_LOOP(eng_and_bool, uint8_t, x & y)
ENG_LOOP(eng_xor_bool, uint8_t, x ^ y)

#define ENG_FLOAT_KERNELS(SUFFIX, T)               \
  ENG_LOOP(eng_sum_##SUFFIX, T, x + y)             \
  ENG_LOOP(eng_prod_##SUFFIX, T, x * y)            \
  ENG_LOOP(eng_min_##SUFFIX, T, ENG_MIN_EXPR)      \
  ENG_LOOP(eng_max_##SUFFIX, T, ENG_MAX_EXPR)

ENG_FLOAT_KERNELS(f32, float)
ENG_FLOAT_KERNELS(f64, double)

#define ENG_HALF_KERNELS(SUFFIX, TO_F, FROM_F)                 \
  ENG_LOOP16(eng_sum_##SUFFIX, TO_F, FROM_F, x + y)            \
  ENG_LOOP16(eng_prod_##SUFFIX, TO_F, FROM_F, x * y)           \
  ENG_LOOP16(eng_min_##SUFFIX, TO_F, FROM_F, ENG_MIN_EXPR)     \
  ENG_LOOP16(eng_max_##SUFFIX, TO_F, FROM_F, ENG_MAX_EXPR)

ENG_HALF_KERNELS(f16, eng_half_to_float, eng_float_to_half)
ENG_HALF_KERNELS(bf16, eng_bf16_to_float, eng_float_to_bf16)

#define ENG_INT_ROW(S) {eng_sum_##S, eng_prod_##S, eng_min_##S, eng_max_##S, eng_band_##S, eng_bor_##S, eng_bxor_##S}
#define ENG_FLOAT_ROW(S) {eng_sum_##S, eng_prod_##S, eng_min_##S, eng_max_##S, NULL, NULL, NULL}

/* [dtype][op]; NULL where the pair is not defined (BAND on float32, anything on complex). */
static const eng_reduce_fn eng_reduce_table[ENG_NDTYPES][ENG_NOPS] = {
  [ENG_BOOL] = {eng_or_bool, eng_and_bool, eng_and_bool, eng_or_bool, eng_and_bool, eng_or_bool, eng_xor_bool},
  [ENG_INT8] = ENG_INT_ROW(i8),   [ENG_UINT8] = ENG_INT_ROW(u8),
  [ENG_INT16] = ENG_INT_ROW(i16), [ENG_UINT16] = ENG_INT_ROW(u16),
  [ENG_INT32] = ENG_INT_ROW(i32), [ENG_UINT32] = ENG_INT_ROW(u32),
  [ENG_INT64] = ENG_INT_ROW(i64), [ENG_UINT64] = ENG_INT_ROW(u64),
  [ENG_FLOAT16] = ENG_FLOAT_ROW(f16), [ENG_BFLOAT16] = ENG_FLOAT_ROW(bf16),
  [ENG_FLOAT32] = ENG_FLOAT_ROW(f32), [ENG_FLOAT64] = ENG_FLOAT_ROW(f64),
};

static inline eng_reduce_fn eng_reduce_lookup(int dtype, int op) {
  if (dtype < 0 || dtype >= ENG_NDTYPES || op < 0 || op >= ENG_NOPS) return NULL;
  return eng_reduce_table[dtype][op];
}

/* ---- scaling: x = x * factor, or x = x / factor (AVG divides, like torch's sum / world_size) ---- */

#define ENG_SCALE_LOOP(T, LOAD, STORE, FT)                                          \
  {                                                                                 \
    T *p = (T *)data; const FT f = (FT)factor;                                      \
    if (divide) { for (size_t i = 0; i < n; i++) p[i] = STORE((FT)LOAD(p[i]) / f); } \
    else        { for (size_t i = 0; i < n; i++) p[i] = STORE((FT)LOAD(p[i]) * f); } \
  }
#define ENG_ID(x) (x)

/* Returns 0, or -1 when dtype is not a floating type. */
static int eng_scale(void *data, size_t n, int dtype, double factor, int divide) {
  switch (dtype) {
  case ENG_FLOAT32: ENG_SCALE_LOOP(float, ENG_ID, ENG_ID, float) return 0;
  case ENG_FLOAT64: ENG_SCALE_LOOP(double, ENG_ID, ENG_ID, double) return 0;
  case ENG_FLOAT16: ENG_SCALE_LOOP(uint16_t, eng_half_to_float, eng_float_to_half, float) return 0;
  case ENG_BFLOAT16: ENG_SCALE_LOOP(uint16_t, eng_bf16_to_float, eng_float_to_bf16, float) return 0;
  default: return -1;
  }
}

/* ---- pack / unpack with fused scale and cast ---- */

/* Copies n elements from src (dtype s) to dst (dtype d), multiplying by scale when scale != 1.
 * Supported: s == d (any dtype when scale == 1, floating types otherwise), and
 * float32 <-> float16 / bfloat16. Returns 0, or -1 for an unsupported pair. */
static int eng_convert(void *dst, int d, const void *src, int s, size_t n, double scale) {
  const int scaled = scale != 1.0;
  const float fs = (float)scale;
  if (s == d && !scaled) return -2; /* caller copies bytes */
  if (s == d) {
    if (dst != src) memmove(dst, src, n * (d == ENG_FLOAT64 ? 8 : d == ENG_FLOAT32 ? 4 : 2));
    return eng_scale(dst, n, d, scale, 0);
  }
  if (s == ENG_FLOAT32 && (d == ENG_FLOAT16 || d == ENG_BFLOAT16)) {
    const float *in = (const float *)src; uint16_t *out = (uint16_t *)dst;
    if (d == ENG_FLOAT16) {
      if (scaled) for (size_t i = 0; i < n; i++) out[i] = eng_float_to_half(in[i] * fs);
      else        for (size_t i = 0; i < n; i++) out[i] = eng_float_to_half(in[i]);
    } else {
      if (scaled) for (size_t i = 0; i < n; i++) out[i] = eng_float_to_bf16(in[i] * fs);
      else        for (size_t i = 0; i < n; i++) out[i] = eng_float_to_bf16(in[i]);
    }
    return 0;
  }
  if (d == ENG_FLOAT32 && (s == ENG_FLOAT16 || s == ENG_BFLOAT16)) {
    const uint16_t *in = (const uint16_t *)src; float *out = (float *)dst;
    if (s == ENG_FLOAT16) {
      if (scaled) for (size_t i = 0; i < n; i++) out[i] = eng_half_to_float(in[i]) * fs;
      else        for (size_t i = 0; i < n; i++) out[i] = eng_half_to_float(in[i]);
    } else {
      if (scaled) for (size_t i = 0; i < n; i++) out[i] = eng_bf16_to_float(in[i]) * fs;
      else        for (size_t i = 0; i < n; i++) out[i] = eng_bf16_to_float(in[i]);
    }
    return 0;
  }
  return -1;
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

/* flat <- concat(parts), each part converted from dtype s to the flat buffer's dtype d. */
static inline int eng_pack(void *flat, int d, size_t d_itemsize, void *const *parts, const size_t *counts,
                           size_t nparts, int s, size_t s_itemsize, double scale) {
  return eng_move_range(1, flat, d, d_itemsize, parts, counts, nparts, s, s_itemsize, scale, 0, SIZE_MAX);
}

/* parts <- split(flat), each converted from the flat dtype s back to the parts' dtype d. */
static inline int eng_unpack(const void *flat, int s, size_t s_itemsize, void *const *parts, const size_t *counts,
                             size_t nparts, int d, size_t d_itemsize, double scale) {
  return eng_move_range(0, (void *)flat, s, s_itemsize, parts, counts, nparts, d, d_itemsize, scale, 0, SIZE_MAX);
}

static inline int eng_pack_range(void *flat, int d, size_t d_itemsize, void *const *parts, const size_t *counts,
                                 size_t nparts, int s, size_t s_itemsize, double scale, size_t off, size_t n) {
  return eng_move_range(1, flat, d, d_itemsize, parts, counts, nparts, s, s_itemsize, scale, off, n);
}

static inline int eng_unpack_range(const void *flat, int s, size_t s_itemsize, void *const *parts,
                                   const size_t *counts, size_t nparts, int d, size_t d_itemsize, double scale,
                                   size_t off, size_t n) {
  return eng_move_range(0, (void *)flat, s, s_itemsize, parts, counts, nparts, d, d_itemsize, scale, off, n);
}

/* ---- many-input reduction (the shared-memory collectives) ---- */

#define ENG_REDUCE_BLOCK 8192 /* bytes: an L1-resident staging block */

/* dst1 (and dst2 unless NULL) = srcs[0] op srcs[1] op ... op srcs[nsrc - 1], in that order (so every
 * rank that reduces the same inputs gets the same bits), divided by `divisor` when it is not 0 (AVG).
 * Works through an L1-resident block, so a destination may alias any source. */
static void eng_reduce_many(eng_reduce_fn fn, void *dst1, void *dst2, const void *const *srcs, int nsrc,
                            size_t n, size_t itemsize, int dtype, double divisor) {
  _Alignas(64) char tmp[ENG_REDUCE_BLOCK];
  const size_t per = ENG_REDUCE_BLOCK / itemsize;
  if (nsrc == 2 && dst2 == NULL && divisor == 0.0) { /* one element-wise pass: dst may alias either source */
    fn(dst1, srcs[0], srcs[1], n);
    return;
  }
  for (size_t off = 0; off < n; off += per) {
    const size_t m = n - off < per ? n - off : per;
    const size_t b = off * itemsize;
    if (nsrc == 1) {
      memcpy(tmp, (const char *)srcs[0] + b, m * itemsize);
    } else {
      fn(tmp, (const char *)srcs[0] + b, (const char *)srcs[1] + b, m);
      for (int k = 2; k < nsrc; k++) fn(tmp, tmp, (const char *)srcs[k] + b, m);
    }
    if (divisor != 0.0) eng_scale(tmp, m, dtype, divisor, 1);
    memcpy((char *)dst1 + b, tmp, m * itemsize);
    if (dst2 != NULL) memcpy((char *)dst2 + b, tmp, m * itemsize);
  }
}

#endif
