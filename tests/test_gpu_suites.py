"""The CUDA suites (tests/gpu/) under mpiexec. Each needs a GPU and skips, with its reason, without one.

One GPU cannot host two NCCL ranks, so a one-GPU machine runs: world size 1 over NCCL through the
whole backend path, and 2 ranks sharing the GPU over the host-staged MPI path. The multi-rank NCCL
runs need one GPU per rank and run wherever two or more exist.
"""

import os
import re

import pytest
import torch

from mpirun import run_pytest, suite_report
from test_faults import launch

SUITE = os.path.join(os.path.dirname(__file__), "gpu", "test_cuda_backend.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _has_cupy():
    try:
        import cupy  # noqa: F401
        return True
    except ImportError:
        return False


def requires(gpus, nccl):
    """Skips, naming the first thing missing: the GPUs, then cupy's NCCL."""
    if GPUS < gpus:
        return pytest.mark.skip(reason="needs a CUDA GPU" if gpus == 1 else
                                f"needs {gpus} or more GPUs (NCCL puts one rank per GPU); found {GPUS}")
    if nccl and not _has_cupy():
        return pytest.mark.skip(reason="needs the cuda12/cuda13 extra (cupy, NCCL)")
    return pytest.mark.skipif(False, reason="")


def run_suite(nranks, transport):
    proc = run_pytest(nranks, SUITE, timeout=600, env={"ENGINE_CUDA_TRANSPORT": transport})
    if proc.returncode != 0:
        pytest.fail(f"CUDA suite, {nranks} ranks, {transport}: exit {proc.returncode}\n"
                    f"{suite_report(proc.stdout, proc.stderr)}", pytrace=False)


@requires(1, nccl=True)
def test_world_size_1_over_nccl():
    run_suite(1, "nccl")


@requires(1, nccl=False)
def test_two_ranks_on_one_gpu_over_the_staged_path():
    run_suite(2, "staged")


@requires(2, nccl=True)
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_ranks_over_nccl(nranks):
    if nranks > GPUS:
        pytest.skip(f"needs {nranks} GPUs, found {GPUS}")
    run_suite(nranks, "nccl")


@requires(2, nccl=True)
def test_skipped_cuda_all_reduce_raises_after_the_timeout():
    proc, _, out = launch("cuda_skip_allreduce.py", 2, 120, ENGINE_CUDA_TRANSPORT="nccl")
    raised = re.findall(r"rank 0: raised after ([\d.]+) s: EngineTimeout: (.*)", out)
    assert raised and float(raised[0][0]) < 15, out[-3000:]
    assert "did not complete on the GPU within 5 s" in raised[0][1]
