"""The GPU kernels' checks against torch, for every dtype and op, written once for two runners:
the real kernels on a GPU (engine.cuda.kernels.GpuKernels) and the same source compiled for the CPU
(cuda_on_cpu.h). References are torch's CPU arithmetic on the same inputs."""

import ctypes
import os
import subprocess

import numpy as np
import torch

from engine.cuda.kernels import SOURCE_PATH, move_kernel_name, reduce_kernel_name
from engine.cuda.tables import FLOATING, KERNEL_DTYPES
from engine.ops import ReduceOp

ALL_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
PART_COUNTS = (5, 0, 1031, 1, 64, 3)


def ops_for(dtype):
    return ALL_OPS[:4] if dtype in FLOATING else ALL_OPS


def sample(dtype, n, gen):
    t = getattr(torch, dtype)
    if dtype == "bool":
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype in FLOATING:
        x = torch.randn(n, generator=gen, dtype=torch.float64) * 50
        x[::97] = float("nan")
        x[1::101] = float("inf")
        x[2::103] = -0.0
        return x.to(t)
    info = torch.iinfo(t)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(t)


def expected(op, a, b):
    if a.dtype == torch.bool:
        return {ReduceOp.SUM: a | b, ReduceOp.PRODUCT: a & b, ReduceOp.MIN: a & b, ReduceOp.MAX: a | b,
                ReduceOp.BAND: a & b, ReduceOp.BOR: a | b, ReduceOp.BXOR: a ^ b}[op]
    return {ReduceOp.SUM: lambda: a + b, ReduceOp.PRODUCT: lambda: a * b,
            ReduceOp.MIN: lambda: torch.minimum(a, b), ReduceOp.MAX: lambda: torch.maximum(a, b),
            ReduceOp.BAND: lambda: a & b, ReduceOp.BOR: lambda: a | b, ReduceOp.BXOR: lambda: a ^ b}[op]()


def same(got, want):
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


def check_reductions(runner, n=1031):
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for dtype in sorted(KERNEL_DTYPES):
        for op in ops_for(dtype):
            a, b = sample(dtype, n, gen), sample(dtype, n, gen)
            got = runner.reduce(a, b, dtype, op)
            same(got, expected(op, a, b))
            checked += 1
    return checked


def check_scale(runner, n=1031):
    gen = torch.Generator().manual_seed(8)
    for dtype in sorted(FLOATING):
        x = sample(dtype, n, gen)
        same(runner.scale(x, dtype, 0.37, False), x * 0.37)
        same(runner.scale(x, dtype, 3.0, True), x / 3)


def check_pack_unpack(runner):
    gen = torch.Generator().manual_seed(9)
    cases = [(d, d, 1.0) for d in sorted(KERNEL_DTYPES)]
    cases += [(d, d, 0.3) for d in sorted(FLOATING)]
    cases += [("float32", "float16", 1.0), ("float32", "bfloat16", 0.25), ("float32", "float16", 0.25)]
    for part_dtype, flat_dtype, scale in cases:
        parts = [sample(part_dtype, c, gen) for c in PART_COUNTS]
        want = torch.cat([(p * scale if scale != 1.0 else p).to(getattr(torch, flat_dtype)) for p in parts])
        flat = runner.pack(parts, part_dtype, flat_dtype, scale)
        same(flat, want)
        back_scale = 1.0 / 3 if flat_dtype in FLOATING else 1.0
        outs = runner.unpack(flat, flat_dtype, [p.numel() for p in parts], part_dtype, back_scale)
        for out, piece in zip(outs, want.split(list(PART_COUNTS))):
            ref = piece.to(getattr(torch, part_dtype))
            same(out, ref * back_scale if back_scale != 1.0 else ref)


def check_all(runner):
    n = check_reductions(runner)
    check_scale(runner)
    check_pack_unpack(runner)
    return n


class GpuRunner:
    """The real kernels on a CUDA device, on torch's current stream."""

    def __init__(self, device=0):
        from engine.cuda.kernels import GpuKernels
        self.k = GpuKernels.on(device)
        self.device = torch.device("cuda", device)

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def reduce(self, a, b, dtype, op):
        a, b = a.to(self.device), b.to(self.device)
        dst = torch.empty_like(a)
        self.k.reduce(dst.data_ptr(), a.data_ptr(), b.data_ptr(), a.numel(), dtype, op, self._stream())
        return dst.cpu()

    def scale(self, x, dtype, factor, divide):
        y = x.to(self.device)
        self.k.scale(y.data_ptr(), y.numel(), dtype, factor, self._stream(), divide=divide)
        return y.cpu()

    def pack(self, parts, part_dtype, flat_dtype, scale):
        parts = [p.to(self.device) for p in parts]
        flat = torch.empty(sum(p.numel() for p in parts), dtype=getattr(torch, flat_dtype), device=self.device)
        self.k.pack(flat.data_ptr(), flat_dtype, [(p.data_ptr(), p.numel()) for p in parts], part_dtype,
                    parts[0].element_size(), self._stream(), scale)
        return flat.cpu()

    def unpack(self, flat, flat_dtype, counts, part_dtype, scale):
        flat = flat.to(self.device)
        outs = [torch.empty(c, dtype=getattr(torch, part_dtype), device=self.device) for c in counts]
        self.k.unpack(flat.data_ptr(), flat_dtype, [(o.data_ptr(), o.numel()) for o in outs], part_dtype,
                      outs[0].element_size(), self._stream(), scale)
        return [o.cpu() for o in outs]


class CpuCompiledRunner:
    """kernels.cu built by g++ with cuda_on_cpu.h: the same source, one CPU thread as the grid."""

    def __init__(self, workdir):
        lib = os.path.join(workdir, "engine_cuda_kernels_cpu.so")
        shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_on_cpu.h")
        subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-include", shim, "-x", "c++", SOURCE_PATH,
                        "-o", lib], check=True, capture_output=True, text=True)
        self.lib = ctypes.CDLL(lib)

    def _fn(self, name):
        return getattr(self.lib, name)

    def reduce(self, a, b, dtype, op):
        dst = torch.empty_like(a)
        self._fn(reduce_kernel_name(dtype, op))(ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(a.data_ptr()),
                                                 ctypes.c_void_p(b.data_ptr()), ctypes.c_uint64(a.numel()))
        return dst

    def scale(self, x, dtype, factor, divide):
        y = x.clone()
        self._fn(f"scale_{dtype}")(ctypes.c_void_p(y.data_ptr()), ctypes.c_uint64(y.numel()), ctypes.c_double(factor),
                                   ctypes.c_int(int(divide)))
        return y

    def _move(self, name, flat, tensors, scale):
        ptrs = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
        offs = np.zeros(len(tensors) + 1, dtype=np.uint64)
        np.cumsum([t.numel() for t in tensors], out=offs[1:])
        self._fn(name)(ctypes.c_void_p(flat.data_ptr()), ctypes.c_void_p(ptrs.ctypes.data),
                       ctypes.c_void_p(offs.ctypes.data), ctypes.c_int(len(tensors)), ctypes.c_double(scale))

    def pack(self, parts, part_dtype, flat_dtype, scale):
        flat = torch.empty(sum(p.numel() for p in parts), dtype=getattr(torch, flat_dtype))
        self._move(move_kernel_name("pack", part_dtype, flat_dtype, parts[0].element_size(), scale), flat, parts, scale)
        return flat

    def unpack(self, flat, flat_dtype, counts, part_dtype, scale):
        outs = [torch.empty(c, dtype=getattr(torch, part_dtype)) for c in counts]
        self._move(move_kernel_name("unpack", flat_dtype, part_dtype, outs[0].element_size(), scale), flat, outs, scale)
        return outs
