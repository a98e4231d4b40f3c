"""The one buffer layer of the GPU path: a CUDA buffer -> (pointer, element count, item size, dtype
name, device index). Takes torch CUDA tensors and anything with __cuda_array_interface__ (cupy,
numba), contiguous only: the torch bridge hands over contiguous tensors."""

import numpy as np

_TYPESTR_NAMES = {"|b1": "bool", "<f2": "float16", "<f4": "float32", "<f8": "float64"}


def device_message(buf):
    if type(buf).__module__.split(".")[0] == "torch":
        if not buf.is_cuda:
            raise TypeError(f"expected a CUDA tensor, got one on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("the GPU path takes contiguous tensors; call .contiguous() first")
        return buf.data_ptr(), buf.numel(), buf.element_size(), str(buf.dtype)[6:], buf.device.index
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"expected a CUDA tensor or array (__cuda_array_interface__), got {type(buf).__name__}")
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    count = int(np.prod(shape)) if shape else 1
    strides = cai.get("strides")
    if strides is not None and count > 1 and strides != _contiguous_strides(shape, dtype.itemsize):
        raise ValueError("the GPU path takes C-contiguous arrays; make a contiguous copy first")
    name = "bfloat16" if dtype.kind == "V" and dtype.itemsize == 2 else _TYPESTR_NAMES.get(cai["typestr"], dtype.name)
    device = getattr(getattr(buf, "device", None), "id", None)
    return cai["data"][0], count, dtype.itemsize, name, device


def _contiguous_strides(shape, itemsize):
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))
