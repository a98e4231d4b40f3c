"""Registration of the "engine" backend, run by torch at `import torch` (entry point group
"torch.backends"). It must stay cheap and must never make `import torch` fail."""

import functools
import warnings

BACKEND = "engine"


def register():
    try:
        _register()
    except Exception as exc:  # never break `import torch`
        warnings.warn(f"torchbridge: backend {BACKEND!r} not registered: {exc}", RuntimeWarning, stacklevel=2)


def _register():
    import torch.distributed as dist
    if not dist.is_available() or BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND, _create_process_group, extended_api=True, devices=["cpu", "cuda"])
    _wrap_init_process_group(dist)


def _create_process_group(opts, backend_options):
    from .process_group import create_process_group
    return create_process_group(opts, backend_options)


def _wrap_init_process_group(dist):
    """Before torch's env:// rendezvous runs for backend "engine", fill RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT from the MPI launcher (torch reads them; mpirun doesn't set them)."""
    c10d = dist.distributed_c10d
    original = c10d.init_process_group
    if getattr(original, "_engine_wrapped", False):
        return

    @functools.wraps(original)
    def init_process_group(backend=None, init_method=None, *args, **kwargs):
        if _names_engine(backend) and init_method in (None, "env://") and kwargs.get("store") is None:
            from .launch import prepare_env
            prepare_env(world_size=kwargs.get("world_size", -1), rank=kwargs.get("rank", -1))
        return original(backend, init_method, *args, **kwargs)

    init_process_group._engine_wrapped = True
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _names_engine(backend):
    return backend is not None and BACKEND in str(backend).lower().replace(":", ",").split(",")
