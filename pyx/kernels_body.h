/* The element-wise kernels, written once and compiled once per instruction set.
 *
 * kernels.h includes this file once for each ISA it builds (baseline, and on x86-64 also AVX2 and
 * AVX-512, each under its own `#pragma GCC target`), with ENG_ISA naming the copy: every function
 * here is suffixed with it and the file ends with that ISA's table, eng_kernels_<ISA>. The loops are
 * plain C the compiler vectorises for the target, so every ISA computes the same bits (IEEE arithmetic
 * is exact per element, and the build passes -ffp-contract=off so no ISA fuses a multiply and an add
 * that another rounds twice). The one ISA-specific part, float16 through F16C where
 * kernels.h sets ENG_F16C, gives the same bits as the portable loop (see there).
 *
 * float16 and bfloat16 are reduced in float32 and rounded once, as torch's half arithmetic does. The
 * portable loops take two elements per 32-bit word: an element shifted into the high half of a word *is* its
 * float32 (bfloat16) or the input of the half -> float conversion (float16), and two results merge
 * back into one word with a shift and an OR. So the vectorised loop needs no widening or narrowing
 * shuffles, which cost more than the arithmetic (measured: about twice the throughput of per-element
 * loops with AVX2, docs/tuning.md).
 */

#define ENG_CAT_(a, b) a##_##b
#define ENG_CAT(a, b) ENG_CAT_(a, b)
#define ENG_FN(name) ENG_CAT(name, ENG_ISA)

/* ---- float16 / bfloat16 <-> float32, round to nearest even, branch-free ---- */

/* IEEE half in the high 16 bits of w (low bits zero) -> float (after M. Dukhan's FP16 library, MIT).
 * Selects by mask rather than ?: so the loops if-convert and vectorise. */
static inline float ENG_FN(half_hi_to_float)(uint32_t w) {
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t normalized = eng_f32_to_bits(eng_f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f);
  const uint32_t denormalized = eng_f32_to_bits(eng_f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f);
  const uint32_t small = 0u - (uint32_t)(two_w < (1u << 27));
  return eng_f32_from_bits(sign | (denormalized & small) | (normalized & ~small));
}

/* float -> IEEE half in the low 16 bits (upper bits zero), round to nearest even; NaN gives
 * 0x7E00 with the NaN's sign, overflow gives inf. */
static inline uint32_t ENG_FN(float_to_half)(float f) {
  const uint32_t w = eng_f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  base = eng_f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = eng_f32_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint32_t nan = 0u - (uint32_t)(shl1_w > 0xFF000000u);
  return (sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan);
}

static inline float ENG_FN(bf16_hi_to_float)(uint32_t w) { return eng_f32_from_bits(w); }

/* float -> bfloat16 in the low 16 bits, as torch's c10::BFloat16 rounds (nearest even, NaN -> 0x7FC0). */
static inline uint32_t ENG_FN(float_to_bf16)(float f) {
  const uint32_t w = eng_f32_to_bits(f);
  return f != f ? 0x7FC0u : (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
}

/* ---- reductions ---- */

#define ENG_LOOP(NAME, T, EXPR)                                                    \
  static void ENG_FN(NAME)(void *dst_, const void *a_, const void *b_, size_t n) { \
    T *dst = (T *)dst_; const T *a = (const T *)a_; const T *b = (const T *)b_;   \
    for (size_t i = 0; i < n; i++) { const T x = a[i], y = b[i]; dst[i] = (T)(EXPR); } \
  }

/* 16-bit floats, two per word (see the top of this file). EXPR reads floats x and y. The last
 * element of an odd count goes alone, through the same conversions. */
#define ENG_LOOP16(NAME, HI_TO_F, F_TO_LO, EXPR)                                             \
  static void ENG_FN(NAME)(void *dst_, const void *a_, const void *b_, size_t n) {           \
    char *dst = (char *)dst_; const char *a = (const char *)a_, *b = (const char *)b_;       \
    const size_t pairs = n / 2;                                                              \
    for (size_t i = 0; i < pairs; i++) {                                                     \
      uint32_t pa, pb; memcpy(&pa, a + 4 * i, 4); memcpy(&pb, b + 4 * i, 4);                 \
      float x = ENG_FN(HI_TO_F)(ENG_FIRST_HI(pa)), y = ENG_FN(HI_TO_F)(ENG_FIRST_HI(pb));    \
      const uint32_t first = ENG_FN(F_TO_LO)((float)(EXPR));                                 \
      x = ENG_FN(HI_TO_F)(ENG_SECOND_HI(pa)); y = ENG_FN(HI_TO_F)(ENG_SECOND_HI(pb));        \
      const uint32_t out = ENG_PAIR(first, ENG_FN(F_TO_LO)((float)(EXPR)));                  \
      memcpy(dst + 4 * i, &out, 4);                                                          \
    }                                                                                        \
    if (n & 1) {                                                                             \
      uint16_t ha, hb; memcpy(&ha, a + 4 * pairs, 2); memcpy(&hb, b + 4 * pairs, 2);         \
      const float x = ENG_FN(HI_TO_F)((uint32_t)ha << 16), y = ENG_FN(HI_TO_F)((uint32_t)hb << 16); \
      const uint16_t out = (uint16_t)ENG_FN(F_TO_LO)((float)(EXPR));                         \
      memcpy(dst + 4 * pairs, &out, 2);                                                      \
    }                                                                                        \
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

/* bool: SUM and MAX are OR, PRODUCT and MIN are AND (torch's bool arithmetic), on what the bytes mean:
 * any nonzero byte is True (a uint8 mask viewed as bool holds 2s), and each result is a 0/1 byte, as
 * MPI's logical ops and torch's give (2 & 1 would be 0: False). */
ENG_LOOP(eng_or_bool, uint8_t, (x | y) != 0)
ENG_LOOP(eng_and_bool, uint8_t, (x != 0) & (y != 0))
ENG_LOOP(eng_xor_bool, uint8_t, (x != 0) ^ (y != 0))

#define ENG_FLOAT_KERNELS(SUFFIX, T)               \
  ENG_LOOP(eng_sum_##SUFFIX, T, x + y)             \
  ENG_LOOP(eng_prod_##SUFFIX, T, x * y)            \
  ENG_LOOP(eng_min_##SUFFIX, T, ENG_MIN_EXPR)      \
  ENG_LOOP(eng_max_##SUFFIX, T, ENG_MAX_EXPR)

ENG_FLOAT_KERNELS(f32, float)
ENG_FLOAT_KERNELS(f64, double)

#define ENG_HALF_KERNELS(SUFFIX, HI_TO_F, F_TO_LO)                 \
  ENG_LOOP16(eng_sum_##SUFFIX, HI_TO_F, F_TO_LO, x + y)            \
  ENG_LOOP16(eng_prod_##SUFFIX, HI_TO_F, F_TO_LO, x * y)           \
  ENG_LOOP16(eng_min_##SUFFIX, HI_TO_F, F_TO_LO, ENG_MIN_EXPR)     \
  ENG_LOOP16(eng_max_##SUFFIX, HI_TO_F, F_TO_LO, ENG_MAX_EXPR)

#if ENG_F16C
/* float16 through F16C's conversions, eight elements at a time, then the portable loops for the rest:
 * GCC doesn't vectorise conversions of C's _Float16, and the branch-free ones above make a float16
 * kernel cost several times a memcpy. Same bits: the instructions round to nearest even like
 * float_to_half and keep a NaN's payload like half_hi_to_float, and f16c_store makes a NaN the quiet
 * float NaN with its sign and no payload, which converts to float_to_half's 0x7E00 with that sign. */
static inline __m256 ENG_FN(f16c_load)(const char *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline void ENG_FN(f16c_store)(char *p, __m256 r) {
  const __m256 quiet = _mm256_or_ps(_mm256_and_ps(r, _mm256_set1_ps(-0.0f)),
                                    _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
  r = _mm256_blendv_ps(r, quiet, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
  _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
}

/* VOP combines __m256 x and y as EXPR does. */
#define ENG_F16C_LOOP(NAME, VOP)                                                               \
  static void ENG_FN(eng_##NAME##_f16)(void *dst_, const void *a_, const void *b_, size_t n) { \
    char *dst = (char *)dst_; const char *a = (const char *)a_, *b = (const char *)b_;         \
    size_t i = 0;                                                                              \
    for (; i + 8 <= n; i += 8) {                                                               \
      const __m256 x = ENG_FN(f16c_load)(a + 2 * i), y = ENG_FN(f16c_load)(b + 2 * i);         \
      ENG_FN(f16c_store)(dst + 2 * i, (VOP));                                                  \
    }                                                                                          \
    if (i < n) ENG_FN(eng_##NAME##_f16_tail)(dst + 2 * i, a + 2 * i, b + 2 * i, n - i);       \
  }
ENG_HALF_KERNELS(f16_tail, half_hi_to_float, float_to_half)
ENG_F16C_LOOP(sum, _mm256_add_ps(x, y))
ENG_F16C_LOOP(prod, _mm256_mul_ps(x, y))
/* ENG_MIN_EXPR and ENG_MAX_EXPR: x where it wins or is NaN, else y */
#define ENG_PICK(CMP) _mm256_blendv_ps(y, x, _mm256_or_ps(_mm256_cmp_ps(x, y, CMP), _mm256_cmp_ps(x, x, _CMP_UNORD_Q)))
ENG_F16C_LOOP(min, ENG_PICK(_CMP_LT_OQ))
ENG_F16C_LOOP(max, ENG_PICK(_CMP_GT_OQ))
#undef ENG_PICK
#undef ENG_F16C_LOOP

/* The scale (AVG's division) and the casts: the first multiple of eight elements of n, in place (scale)
 * or from in to out; each returns how many it did, and the portable loop does the rest. */
static size_t ENG_FN(f16c_scale)(char *p, size_t n, float f, int divide) {
  const __m256 vf = _mm256_set1_ps(f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = ENG_FN(f16c_load)(p + 2 * i);
    ENG_FN(f16c_store)(p + 2 * i, divide ? _mm256_div_ps(x, vf) : _mm256_mul_ps(x, vf));
  }
  return i;
}

static size_t ENG_FN(f16c_narrow)(char *out, const float *in, size_t n, float scale, int scaled) {
  const __m256 vs = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    ENG_FN(f16c_store)(out + 2 * i, scaled ? _mm256_mul_ps(x, vs) : x);
  }
  return i;
}

static size_t ENG_FN(f16c_widen)(float *out, const char *in, size_t n, float scale, int scaled) {
  const __m256 vs = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = ENG_FN(f16c_load)(in + 2 * i);
    _mm256_storeu_ps(out + i, scaled ? _mm256_mul_ps(x, vs) : x);
  }
  return i;
}
#else
ENG_HALF_KERNELS(f16, half_hi_to_float, float_to_half)
#endif
ENG_WIDE_BEGIN
ENG_HALF_KERNELS(bf16, bf16_hi_to_float, float_to_bf16)
ENG_WIDE_END

/* ---- scaling: x = x * factor, or x = x / factor (AVG divides, like torch's sum / world_size) ---- */

#define ENG_SCALE_LOOP(T, FT)                                                    \
  {                                                                              \
    T *p = (T *)data; const FT f = (FT)factor;                                   \
    if (divide) { for (size_t i = 0; i < n; i++) p[i] = p[i] / f; }              \
    else        { for (size_t i = 0; i < n; i++) p[i] = p[i] * f; }              \
  }

/* 16-bit floats two per word, as the reductions. */
#define ENG_UNARY16(NAME, HI_TO_F, F_TO_LO, EXPR)                                            \
  static void ENG_FN(NAME)(void *p_, size_t n, float f) {                                    \
    char *p = (char *)p_;                                                                    \
    const size_t pairs = n / 2;                                                              \
    for (size_t i = 0; i < pairs; i++) {                                                     \
      uint32_t w; memcpy(&w, p + 4 * i, 4);                                                  \
      float x = ENG_FN(HI_TO_F)(ENG_FIRST_HI(w));                                            \
      const uint32_t first = ENG_FN(F_TO_LO)((float)(EXPR));                                 \
      x = ENG_FN(HI_TO_F)(ENG_SECOND_HI(w));                                                 \
      const uint32_t out = ENG_PAIR(first, ENG_FN(F_TO_LO)((float)(EXPR)));                  \
      memcpy(p + 4 * i, &out, 4);                                                            \
    }                                                                                        \
    if (n & 1) {                                                                             \
      uint16_t h; memcpy(&h, p + 4 * pairs, 2);                                              \
      const float x = ENG_FN(HI_TO_F)((uint32_t)h << 16);                                    \
      const uint16_t out = (uint16_t)ENG_FN(F_TO_LO)((float)(EXPR));                         \
      memcpy(p + 4 * pairs, &out, 2);                                                        \
    }                                                                                        \
  }

ENG_UNARY16(eng_div_f16, half_hi_to_float, float_to_half, x / f)
ENG_UNARY16(eng_mul_f16, half_hi_to_float, float_to_half, x * f)
ENG_UNARY16(eng_div_bf16, bf16_hi_to_float, float_to_bf16, x / f)
ENG_UNARY16(eng_mul_bf16, bf16_hi_to_float, float_to_bf16, x * f)

/* Returns 0, or -1 when dtype is not a floating type. */
static int ENG_FN(eng_scale)(void *data, size_t n, int dtype, double factor, int divide) {
  switch (dtype) {
  case ENG_FLOAT32: ENG_SCALE_LOOP(float, float) return 0;
  case ENG_FLOAT64: ENG_SCALE_LOOP(double, double) return 0;
  case ENG_FLOAT16: {
    size_t done = 0;
#if ENG_F16C
    done = ENG_FN(f16c_scale)((char *)data, n, (float)factor, divide);
#endif
    (divide ? ENG_FN(eng_div_f16) : ENG_FN(eng_mul_f16))((char *)data + 2 * done, n - done, (float)factor);
    return 0;
  }
  case ENG_BFLOAT16: (divide ? ENG_FN(eng_div_bf16) : ENG_FN(eng_mul_bf16))(data, n, (float)factor); return 0;
  default: return -1;
  }
}

/* ---- casts between float32 and the 16-bit floats, with a fused scale ---- */

/* float32 -> 16 bits, two per word. */
#define ENG_NARROW(F_TO_LO, EXPR)                                                        \
  {                                                                                      \
    const float *in = (const float *)src; char *out = (char *)dst;                       \
    const size_t pairs = n / 2;                                                          \
    for (size_t i = 0; i < pairs; i++) {                                                 \
      float x = in[2 * i];                                                               \
      const uint32_t first = ENG_FN(F_TO_LO)(EXPR);                                      \
      x = in[2 * i + 1];                                                                 \
      const uint32_t word = ENG_PAIR(first, ENG_FN(F_TO_LO)(EXPR));                      \
      memcpy(out + 4 * i, &word, 4);                                                     \
    }                                                                                    \
    if (n & 1) {                                                                         \
      const float x = in[n - 1];                                                         \
      const uint16_t h = (uint16_t)ENG_FN(F_TO_LO)(EXPR);                                \
      memcpy(out + 4 * pairs, &h, 2);                                                    \
    }                                                                                    \
  }

/* 16 bits -> float32, one element at a time (widening vectorises without shuffles). */
#define ENG_WIDEN(HI_TO_F, EXPR)                                                         \
  {                                                                                      \
    const uint16_t *in = (const uint16_t *)src; float *out = (float *)dst;               \
    for (size_t i = 0; i < n; i++) { const float x = ENG_FN(HI_TO_F)((uint32_t)in[i] << 16); out[i] = (EXPR); } \
  }

/* dst (dtype d) <- src (dtype s) * scale for float32 <-> float16 / bfloat16; returns 0, or -1 for
 * another pair (kernels.h handles same-dtype moves). */
static int ENG_FN(eng_cast)(void *dst, int d, const void *src, int s, size_t n, double scale) {
  const float fs = (float)scale;
  const int scaled = scale != 1.0;
#if ENG_F16C
  /* float16 <-> float32 through F16C, the rest below */
  if (s == ENG_FLOAT32 && d == ENG_FLOAT16) {
    const size_t done = ENG_FN(f16c_narrow)((char *)dst, (const float *)src, n, fs, scaled);
    dst = (char *)dst + 2 * done; src = (const float *)src + done; n -= done;
  } else if (s == ENG_FLOAT16 && d == ENG_FLOAT32) {
    const size_t done = ENG_FN(f16c_widen)((float *)dst, (const char *)src, n, fs, scaled);
    dst = (float *)dst + done; src = (const char *)src + 2 * done; n -= done;
  }
#endif
/* one pair: its loop with and without the scale (no multiply where it is 1) */
#define ENG_CAST(S, D, MOVE, FN) \
  if (s == S && d == D) { if (scaled) MOVE(FN, x * fs) else MOVE(FN, x) return 0; }
  ENG_CAST(ENG_FLOAT32, ENG_FLOAT16, ENG_NARROW, float_to_half)
  ENG_CAST(ENG_FLOAT32, ENG_BFLOAT16, ENG_NARROW, float_to_bf16)
  ENG_CAST(ENG_FLOAT16, ENG_FLOAT32, ENG_WIDEN, half_hi_to_float)
  ENG_CAST(ENG_BFLOAT16, ENG_FLOAT32, ENG_WIDEN, bf16_hi_to_float)
#undef ENG_CAST
  return -1;
}

/* ---- this ISA's table ---- */

#define ENG_INT_ROW(S) {ENG_FN(eng_sum_##S), ENG_FN(eng_prod_##S), ENG_FN(eng_min_##S), ENG_FN(eng_max_##S), \
                        ENG_FN(eng_band_##S), ENG_FN(eng_bor_##S), ENG_FN(eng_bxor_##S)}
#define ENG_FLOAT_ROW(S) {ENG_FN(eng_sum_##S), ENG_FN(eng_prod_##S), ENG_FN(eng_min_##S), ENG_FN(eng_max_##S), \
                          NULL, NULL, NULL}

/* [dtype][op]; NULL where the pair is not defined (BAND on float32, anything on complex). */
static const struct eng_kernel_table ENG_CAT(eng_kernels, ENG_ISA) = {
  {
    [ENG_BOOL] = {ENG_FN(eng_or_bool), ENG_FN(eng_and_bool), ENG_FN(eng_and_bool), ENG_FN(eng_or_bool),
                  ENG_FN(eng_and_bool), ENG_FN(eng_or_bool), ENG_FN(eng_xor_bool)},
    [ENG_INT8] = ENG_INT_ROW(i8),   [ENG_UINT8] = ENG_INT_ROW(u8),
    [ENG_INT16] = ENG_INT_ROW(i16), [ENG_UINT16] = ENG_INT_ROW(u16),
    [ENG_INT32] = ENG_INT_ROW(i32), [ENG_UINT32] = ENG_INT_ROW(u32),
    [ENG_INT64] = ENG_INT_ROW(i64), [ENG_UINT64] = ENG_INT_ROW(u64),
    [ENG_FLOAT16] = ENG_FLOAT_ROW(f16), [ENG_BFLOAT16] = ENG_FLOAT_ROW(bf16),
    [ENG_FLOAT32] = ENG_FLOAT_ROW(f32), [ENG_FLOAT64] = ENG_FLOAT_ROW(f64),
  },
  ENG_FN(eng_scale),
  ENG_FN(eng_cast),
};

#undef ENG_INT_ROW
#undef ENG_FLOAT_ROW
#undef ENG_FN
