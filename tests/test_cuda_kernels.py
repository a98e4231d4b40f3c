"""The engine's GPU kernels (engine/cuda/kernels.cu) against torch, every dtype and op.

- On a GPU: the real kernels, compiled by NVRTC and launched through cupy.
- Everywhere with g++: the same source compiled for the CPU (cuda_on_cpu.h), so their arithmetic
  (float16/bfloat16 rounding, NaN in MIN/MAX, integer wrap, bool, pack offsets) is checked on
  machines without a GPU too.
- With cupy's NVRTC installed (the cuda12/cuda13 extra): the source compiles for sm_80 and sm_90 and
  defines every kernel the Python side can ask for. NVRTC needs no GPU.
"""

import re
import shutil

import pytest
import torch

from cuda_kernel_cases import CpuCompiledRunner, GpuRunner, check_all, ops_for
from engine.cuda import kernels as gk
from engine.cuda.tables import FLOATING, KERNEL_DTYPES
from engine.fusion import ITEMSIZE

def every_kernel_name():
    names = {gk.reduce_kernel_name(d, op) for d in KERNEL_DTYPES for op in ops_for(d)}
    names |= {f"scale_{d}" for d in FLOATING}
    for direction in ("pack", "unpack"):
        for d in KERNEL_DTYPES:
            names.add(gk.move_kernel_name(direction, d, d, ITEMSIZE[d], 1.0))
        for d in FLOATING:
            names.add(gk.move_kernel_name(direction, d, d, ITEMSIZE[d], 0.5))
        for s, d in (("float32", "float16"), ("float32", "bfloat16"), ("float16", "float32"), ("bfloat16", "float32")):
            names.add(gk.move_kernel_name(direction, s, d, ITEMSIZE[s], 1.0))
    return names


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build kernels.cu for the CPU")
def test_kernel_source_on_cpu_matches_torch(tmp_path):
    assert check_all(CpuCompiledRunner(str(tmp_path))) == 58


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_match_torch():
    pytest.importorskip("cupy", reason="needs the cuda12/cuda13 extra (cupy)")
    assert check_all(GpuRunner(torch.cuda.current_device())) == 58


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_nvrtc_compiles_every_kernel(arch):
    pytest.importorskip("cupy", reason="needs cupy (the cuda12/cuda13 extra) for NVRTC")
    try:
        from cupy.cuda import nvrtc
        prog = nvrtc.createProgram(gk.source(), "kernels.cu", [], [])
    except Exception as exc:  # cupy present but libnvrtc missing
        pytest.skip(f"NVRTC not loadable: {exc}")
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", "-std=c++17"])
    except Exception:
        pytest.fail(nvrtc.getProgramLog(prog))
    entries = set(re.findall(r"\.entry (\w+)", nvrtc.getPTX(prog).decode()))
    assert every_kernel_name() <= entries


def test_move_kernel_refuses_unsupported_conversions():
    with pytest.raises(TypeError, match="float32 <-> float16/bfloat16"):
        gk.move_kernel_name("pack", "int32", "float16", 4, 1.0)
    with pytest.raises(TypeError, match="with scale"):
        gk.move_kernel_name("pack", "int32", "int32", 4, 0.5)
