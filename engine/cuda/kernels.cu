/* The engine's GPU kernels: reductions for the ring, scaling (AVG, PREMUL_SUM), and batched
 * pack/unpack with a fused dtype cast and scale for fused allreduce and compression.
 *
 * Compiled at run time by NVRTC (through cupy.RawModule), so it includes no header. The semantics
 * are those of pyx/kernels.h, the CPU kernels: float16 and bfloat16 are reduced in float32 and
 * rounded once to nearest even, MIN/MAX propagate NaN, signed integers wrap on overflow, bool is a
 * byte holding 0/1 with torch's bool arithmetic. Every kernel is a grid-stride loop: one launch
 * covers any count.
 */

typedef signed char i8;
typedef unsigned char u8;
typedef short i16;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define GRID_LOOP(i, n) \
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

/* ---- float16 / bfloat16 <-> float32, bit-exact with pyx/kernels.h ---- */

__device__ __forceinline__ float half_to_float(u16 h) {
  const u32 w = (u32)h << 16;
  const u32 sign = w & 0x80000000u;
  const u32 two_w = w + w;
  const float normalized = __uint_as_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = __uint_as_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const u32 result = sign | (two_w < (1u << 27) ? __float_as_uint(denormalized) : __float_as_uint(normalized));
  return __uint_as_float(result);
}

__device__ __forceinline__ u16 float_to_half(float f) {
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const u32 w = __float_as_uint(f);
  const u32 shl1_w = w + w;
  const u32 sign = w & 0x80000000u;
  u32 bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = __uint_as_float((bias >> 1) + 0x07800000u) + base;
  const u32 bits = __float_as_uint(base);
  const u32 exp_bits = (bits >> 13) & 0x00007C00u;
  const u32 mantissa_bits = bits & 0x00000FFFu;
  const u32 nonsign = exp_bits + mantissa_bits;
  return (u16)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float((u32)h << 16); }

__device__ __forceinline__ u16 float_to_bf16(float f) {
  const u32 w = __float_as_uint(f);
  const u32 rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  return (u16)(f != f ? 0x7FC0u : rounded);
}

/* ---- reductions: dst[i] = a[i] (op) b[i]; dst may alias a or b ---- */

#define REDUCE(NAME, T, EXPR)                                                   \
  extern "C" __global__ void NAME(T *dst, const T *a, const T *b, u64 n) {      \
    GRID_LOOP(i, n) { const T x = a[i], y = b[i]; dst[i] = (T)(EXPR); }         \
  }

#define REDUCE16(NAME, TO_F, FROM_F, EXPR)                                      \
  extern "C" __global__ void NAME(u16 *dst, const u16 *a, const u16 *b, u64 n) { \
    GRID_LOOP(i, n) { const float x = TO_F(a[i]), y = TO_F(b[i]); dst[i] = FROM_F((float)(EXPR)); } \
  }

#define MIN_EXPR ((x < y || x != x) ? x : y)
#define MAX_EXPR ((x > y || x != x) ? x : y)

/* SUM and PRODUCT in the unsigned twin: signed overflow wraps (as torch's does) instead of being UB. */
#define INT_KERNELS(S, T, UT)                          \
  REDUCE(reduce_sum_##S, T, (UT)x + (UT)y)             \
  REDUCE(reduce_product_##S, T, (UT)x * (UT)y)         \
  REDUCE(reduce_min_##S, T, x < y ? x : y)             \
  REDUCE(reduce_max_##S, T, x > y ? x : y)             \
  REDUCE(reduce_band_##S, T, x & y)                    \
  REDUCE(reduce_bor_##S, T, x | y)                     \
  REDUCE(reduce_bxor_##S, T, x ^ y)

INT_KERNELS(int8, i8, u8)
INT_KERNELS(uint8, u8, u8)
INT_KERNELS(int16, i16, u16)
INT_KERNELS(int32, i32, u32)
INT_KERNELS(int64, i64, u64)

/* bool: SUM and MAX are OR, PRODUCT and MIN are AND. */
REDUCE(reduce_sum_bool, u8, x | y)
REDUCE(reduce_product_bool, u8, x & y)
REDUCE(reduce_min_bool, u8, x & y)
REDUCE(reduce_max_bool, u8, x | y)
REDUCE(reduce_band_bool, u8, x & y)
REDUCE(reduce_bor_bool, u8, x | y)
REDUCE(reduce_bxor_bool, u8, x ^ y)

#define FLOAT_KERNELS(S, T)                            \
  REDUCE(reduce_sum_##S, T, x + y)                     \
  REDUCE(reduce_product_##S, T, x * y)                 \
  REDUCE(reduce_min_##S, T, MIN_EXPR)                  \
  REDUCE(reduce_max_##S, T, MAX_EXPR)

FLOAT_KERNELS(float32, float)
FLOAT_KERNELS(float64, double)

#define HALF_KERNELS(S, TO_F, FROM_F)                  \
  REDUCE16(reduce_sum_##S, TO_F, FROM_F, x + y)        \
  REDUCE16(reduce_product_##S, TO_F, FROM_F, x * y)    \
  REDUCE16(reduce_min_##S, TO_F, FROM_F, MIN_EXPR)     \
  REDUCE16(reduce_max_##S, TO_F, FROM_F, MAX_EXPR)

HALF_KERNELS(float16, half_to_float, float_to_half)
HALF_KERNELS(bfloat16, bf16_to_float, float_to_bf16)

/* ---- scaling in place: x * factor, or x / factor (AVG divides, as torch's sum / world_size) ---- */

#define SCALE(S, T, LOAD, STORE, FT)                                                      \
  extern "C" __global__ void scale_##S(T *x, u64 n, double factor, int divide) {         \
    const FT f = (FT)factor;                                                              \
    if (divide) { GRID_LOOP(i, n) x[i] = STORE((FT)LOAD(x[i]) / f); }                     \
    else        { GRID_LOOP(i, n) x[i] = STORE((FT)LOAD(x[i]) * f); }                     \
  }
#define ID(v) (v)

SCALE(float32, float, ID, ID, float)
SCALE(float64, double, ID, ID, double)
SCALE(float16, u16, half_to_float, float_to_half, float)
SCALE(bfloat16, u16, bf16_to_float, float_to_bf16, float)

/* ---- batched pack / unpack ----
 * One launch moves every part of a bucket: ptrs[k] is part k's device address, offs[k] its first
 * element in the flat buffer (offs[nparts] == total). A thread finds its part by binary search,
 * so the launch costs the same for 2 parts or 2,000. CONV converts one element x of type S. */

__device__ __forceinline__ int find_part(const u64 *offs, int nparts, u64 i) {
  int lo = 0, hi = nparts - 1;  /* the last k with offs[k] <= i (skips empty parts) */
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offs[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

#define XFER(SUF, S, D, CONV)                                                                   \
  extern "C" __global__ void pack_##SUF(D *flat, const u64 *ptrs, const u64 *offs, int nparts,   \
                                        double scale) {                                         \
    const float fs = (float)scale; (void)fs;                                                    \
    GRID_LOOP(i, offs[nparts]) {                                                                \
      const int k = find_part(offs, nparts, i);                                                 \
      const S x = ((const S *)ptrs[k])[i - offs[k]];                                            \
      flat[i] = CONV;                                                                           \
    }                                                                                           \
  }                                                                                             \
  extern "C" __global__ void unpack_##SUF(const S *flat, const u64 *ptrs, const u64 *offs,       \
                                          int nparts, double scale) {                           \
    const float fs = (float)scale; (void)fs;                                                    \
    GRID_LOOP(i, offs[nparts]) {                                                                \
      const int k = find_part(offs, nparts, i);                                                 \
      const S x = flat[i];                                                                      \
      ((D *)ptrs[k])[i - offs[k]] = CONV;                                                       \
    }                                                                                           \
  }

/* Unscaled same-dtype moves copy by item size; scaled ones compute as the CPU kernels do. */
XFER(copy1, u8, u8, x)
XFER(copy2, u16, u16, x)
XFER(copy4, u32, u32, x)
XFER(copy8, u64, u64, x)
XFER(float32_float32, float, float, x * fs)
XFER(float64_float64, double, double, x * scale)
XFER(float16_float16, u16, u16, float_to_half(half_to_float(x) * fs))
XFER(bfloat16_bfloat16, u16, u16, float_to_bf16(bf16_to_float(x) * fs))
XFER(float32_float16, float, u16, float_to_half(x * fs))
XFER(float32_bfloat16, float, u16, float_to_bf16(x * fs))
XFER(float16_float32, u16, float, half_to_float(x) * fs)
XFER(bfloat16_float32, u16, float, bf16_to_float(x) * fs)
