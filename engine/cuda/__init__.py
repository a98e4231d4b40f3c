"""CUDA tensors: NCCL through cupy.cuda.nccl, the engine's GPU kernels, and a host-staged path over MPI.

Nothing here imports cupy until a CUDA tensor arrives: a CPU-only install never needs CUDA.
"""

EXTRA_HINT = ("install the engine's CUDA extra, `pip install engine[cuda12]` (CUDA 12) or "
              "`pip install engine[cuda13]` (CUDA 13), which brings cupy and NCCL; or set "
              "ENGINE_CUDA_TRANSPORT=staged to move CUDA tensors through host memory over MPI")


def load_cupy():
    """(cupy, cupy.cuda.nccl), or an ImportError that names the extra to install."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ImportError(f"backend 'engine' got a CUDA tensor, but cupy is not importable ({exc}): "
                          f"{EXTRA_HINT}") from exc
    if not getattr(nccl, "available", False):
        raise ImportError(f"cupy {cupy.__version__} is installed but its NCCL is not available (libnccl not "
                          f"found): {EXTRA_HINT}")
    return cupy, nccl
