/* Lets g++ compile engine/cuda/kernels.cu for the CPU, as one thread of a one-block grid (each
 * kernel is a grid-stride loop, so that thread covers every element). tests/test_cuda_kernels.py uses
 * it to check the GPU kernels' arithmetic against torch on machines without a GPU; on a GPU the same
 * checks run the real kernels (tests/gpu/). */
#include <cmath>
#include <cstring>

struct engine_dim3 { unsigned x; };
static const engine_dim3 blockIdx = {0}, threadIdx = {0}, blockDim = {1}, gridDim = {1};

#define __global__
#define __device__
#define __forceinline__ inline

static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
