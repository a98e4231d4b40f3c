"""The compiled element-wise kernels, callable on any buffer (each is one GIL-free C call).

The kernels are compiled once per instruction set (x86-64: baseline SSE2, AVX2, AVX-512; other CPUs:
the baseline) and the highest one this CPU runs is chosen at import; ENGINE_ISA names another (for
example `baseline`). Every ISA computes the same bits for the same inputs."""

from . import _core
from ._core import copy_into, pack, ring_block, ring_schedule, scale, unpack
from .ops import op_code

__all__ = ["copy_into", "cpu", "isa", "isas", "pack", "reduce_into", "ring_block", "ring_schedule", "scale", "unpack", "use_isa"]


def reduce_into(dst, a, b, op="sum", threads=1):
    """dst = a (op) b element-wise; dst may be a or b. float16/bfloat16 compute in float32 and round once.
    threads > 1: split over that many threads (this one and helpers), as a threaded collective's kernels are."""
    _core.reduce_into(dst, a, b, op_code(op), threads)


def isa():
    """The instruction set the kernels run: 'baseline', 'avx2' or 'avx512'."""
    return _core.kernel_isa()


def cpu():
    """This machine's CPU as the thresholds and benchmarks name it: {"model": /proc/cpuinfo's model name
    (None where there is none), "flags": which of the vector extensions the kernels care about it has}."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16", "asimd", "sve")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


def isas():
    """The instruction sets this build has and this CPU runs, lowest first."""
    return _core.kernel_isas()


def use_isa(name):
    """Runs the kernels of `name` ('auto': the highest this CPU runs) from now on, in this process, and
    returns the previous one. For tests and measurements; ENGINE_ISA chooses at import. Raises
    ValueError for an unknown name, RuntimeError for an ISA this build or CPU lacks."""
    return _core.use_kernel_isa(name)
