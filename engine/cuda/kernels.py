"""The engine's GPU kernels (kernels.cu), compiled once per device by NVRTC through cupy.RawModule
(cupy caches the binary on disk), launched on the caller's CUDA stream. Everything here takes device
pointers and ints, like cupy.cuda.nccl: the buffer layer (buffers.py) is the only place that reads
tensors."""

import os
import threading

import numpy as np

from . import load_cupy
from .tables import FLOATING, KERNEL_DTYPES, OP_NAMES

SOURCE_PATH = os.path.join(os.path.dirname(__file__), "kernels.cu")
BLOCK = 256
_ITEM_COPY = {1: "copy1", 2: "copy2", 4: "copy4", 8: "copy8"}
_CONVERSIONS = {("float32", "float16"), ("float32", "bfloat16"), ("float16", "float32"), ("bfloat16", "float32")}


def source():
    with open(SOURCE_PATH) as f:
        return f.read()


def reduce_kernel_name(dtype, op):
    return f"reduce_{OP_NAMES[op]}_{dtype}"


def move_kernel_name(direction, src, dst, itemsize, scale):
    """pack_/unpack_ + what converts one element from dtype src to dtype dst (times scale)."""
    if src == dst and scale == 1.0:
        return f"{direction}_{_ITEM_COPY[itemsize]}"
    if (src == dst and src in FLOATING) or (src, dst) in _CONVERSIONS:
        return f"{direction}_{src}_{dst}"
    raise TypeError(f"cannot {direction} {src} to {dst}" + (f" with scale {scale}" if src == dst else "") +
                    ": the GPU kernels convert float32 <-> float16/bfloat16 and scale floating dtypes only")


class GpuKernels:
    """kernels.cu on one device."""

    _lock = threading.Lock()
    _by_device = {}

    @classmethod
    def on(cls, device):
        with cls._lock:
            k = cls._by_device.get(device)
            if k is None:
                k = cls._by_device[device] = cls(device)
            return k

    def __init__(self, device):
        self._cupy, _ = load_cupy()
        self.device = device
        with self._cupy.cuda.Device(device):
            self._module = self._cupy.RawModule(code=source(), options=("-std=c++17",))
            self._max_grid = 8 * self._cupy.cuda.Device(device).attributes["MultiProcessorCount"]
        self._functions = {}
        self._streams = {}

    def _stream(self, handle):
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = self._cupy.cuda.ExternalStream(handle, self.device)
        return s

    def _launch(self, name, n, args, stream):
        if n == 0:
            return
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self._module.get_function(name)
        grid = min((n + BLOCK - 1) // BLOCK, self._max_grid)
        with self._cupy.cuda.Device(self.device), self._stream(stream):
            fn((grid,), (BLOCK,), args)

    def reduce(self, dst, a, b, count, dtype, op, stream):
        """dst = a (op) b over count elements; dst may be a or b."""
        if dtype not in KERNEL_DTYPES or op not in OP_NAMES:
            raise TypeError(f"no GPU reduction kernel for {dtype} with op {op}")
        self._launch(reduce_kernel_name(dtype, op), count,
                     (np.uint64(dst), np.uint64(a), np.uint64(b), np.uint64(count)), stream)

    def scale(self, ptr, count, dtype, factor, stream, divide=False):
        if dtype not in FLOATING:
            raise TypeError(f"scaling needs a floating dtype, got {dtype}")
        self._launch(f"scale_{dtype}", count, (np.uint64(ptr), np.uint64(count), np.float64(factor),
                                               np.int32(1 if divide else 0)), stream)

    def pack(self, flat, flat_dtype, parts, part_dtype, itemsize, stream, scale=1.0):
        """flat <- concat(parts) converted to flat_dtype, times scale. parts: (pointer, count) pairs."""
        name = move_kernel_name("pack", part_dtype, flat_dtype, itemsize, scale)
        self._move(name, flat, parts, scale, stream)

    def unpack(self, flat, flat_dtype, parts, part_dtype, itemsize, stream, scale=1.0):
        """parts <- split(flat) converted to part_dtype, times scale."""
        name = move_kernel_name("unpack", flat_dtype, part_dtype, itemsize, scale)
        self._move(name, flat, parts, scale, stream)

    def _move(self, name, flat, parts, scale, stream):
        # One table (part pointers, then offsets) copied to the device on the stream: one launch for
        # the whole bucket. The table comes from cupy's stream-ordered pool, so it is reused safely.
        n = len(parts)
        host = np.empty(2 * n + 1, dtype=np.uint64)
        host[:n] = [p for p, _ in parts]
        host[n] = 0
        np.cumsum([c for _, c in parts], out=host[n + 1:])
        total = int(host[-1])
        if total == 0:
            return
        cp = self._cupy
        with cp.cuda.Device(self.device), self._stream(stream):
            table = cp.empty(host.size, dtype=cp.uint64)
            table.set(host)
        ptrs = table.data.ptr
        self._launch(name, total, (np.uint64(flat), np.uint64(ptrs), np.uint64(ptrs + 8 * n), np.int32(n),
                                   np.float64(scale)), stream)
