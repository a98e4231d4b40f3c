/* The subset of DLPack (v0.x, capsule name "dltensor") the engine reads. */
#ifndef ENGINE_DLPACK_H
#define ENGINE_DLPACK_H
#include <stdint.h>

typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLComplex = 5, kDLBool = 6,
       /* DLPack 1.1's small float formats (the engine moves them, never reduces them) */
       kDLFloat8_e4m3fn = 10, kDLFloat8_e4m3fnuz = 11, kDLFloat8_e5m2 = 12, kDLFloat8_e5m2fnuz = 13,
       kDLFloat8_e8m0fnu = 14, kDLFloat4_e2m1fn = 17 };
enum { kDLCPU = 1, kDLCUDAHost = 3 };
#endif
