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
    if not dist.is_available():
        return
    # torch 2.15 hooks a flight recorder onto the groups of backends missing from this set, and the hook
    # asks C++ for the group's name, which a Python group keeps in Python. The engine records itself.
    getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", set()).add(BACKEND)
    if BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND, _create_process_group, extended_api=True, devices=["cpu", "cuda"])
    _wrap_init_process_group(dist)


def _create_process_group(opts, backend_options):
    from .creation import create_process_group
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
        named = backend is not None and BACKEND in str(backend).lower().replace(":", ",").split(",")
        if not named or dist.is_initialized():  # a second init: torch refuses it at once
            return original(backend, init_method, *args, **kwargs)
        if ":" in str(backend):
            _warn_of_devices_given_to_others(dist, backend)
        try:
            if (init_method is None or str(init_method).startswith("env://")) and kwargs.get("store") is None:
                from .launch import prepare_env
                timeout = kwargs.get("timeout")
                prepare_env(world_size=kwargs.get("world_size", -1), rank=kwargs.get("rank", -1),
                            timeout=timeout.total_seconds() if hasattr(timeout, "total_seconds") else None)
            group = _bounded_init(dist, original, backend, init_method, args, kwargs)
        except BaseException as exc:
            _failed_at_init(exc)
            raise
        _succeeded_at_init()
        return group

    init_process_group._engine_wrapped = True
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _warn_of_devices_given_to_others(dist, backend):
    """A backend string that gives some device to another backend ("cpu:gloo,cuda:engine") can't be
    honoured: torch hands a backend that makes a whole ProcessGroup, as this one does, every device of
    the group. Said once, at init, rather than found out from a trace."""
    given = dist.distributed_c10d.BackendConfig(dist.Backend(backend)).get_device_backend_map()
    others = {device: name for device, name in given.items() if name != BACKEND}
    if others:
        routed = ", ".join(f"{device} tensors go to {BACKEND}, not {name}" for device, name in others.items())
        warnings.warn(f"init_process_group(backend={backend!r}): backend {BACKEND!r} makes the whole group, so torch "
                      f"gives it every device's tensors: {routed}. Name {BACKEND!r} alone, or another backend for "
                      "every device", UserWarning, stacklevel=3)


def _bounded_init(dist, original, backend, init_method, args, kwargs):
    """torch's init_process_group with its rendezvous bounded by the timeout (torchbridge.rendezvous:
    torch's TCPStore client can wait forever): the store it makes is passed on as torch's own, under
    the prefix torch gives the store it makes itself (a store passed in it takes as it is)."""
    import inspect
    from . import rendezvous
    call = inspect.signature(original).bind(backend, init_method, *args, **kwargs)
    given = call.arguments
    if given.get("timeout") is not None:   # (torch's own check, before the rendezvous reads it)
        dist.distributed_c10d._check_valid_timeout(given["timeout"])
    if given.get("store") is not None or not rendezvous.bounded(given.get("init_method")):
        return original(backend, init_method, *args, **kwargs)
    timeout = given.get("timeout") or dist.distributed_c10d._get_default_timeout(dist.Backend(backend))
    store, rank, world_size = rendezvous.rendezvous(given.get("init_method"), given.get("rank", -1),
                                                    given.get("world_size", -1), timeout)
    store.set_timeout(timeout)
    given.update(init_method=None, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size)
    return original(*call.args, **call.kwargs)


def _failed_at_init(exc):
    """A rank whose init_process_group fails (a RANK that disagrees with the launcher, a rendezvous
    error, anything) must not leave the others waiting for it. With MPI up (the engine's own bootstrap,
    or a script or library that initialised MPI first) the rank would wait in MPI_Finalize for ranks
    that wait for it: it aborts the job at exit instead (engine.failure). Without MPI up, Open MPI's
    mpirun and torchrun see the process exit non-zero and end the job; MPICH's mpiexec (Hydra) and srun
    do not, and the others wait for this rank inside MPI_Init: it starts MPI, to abort the job at exit
    (not a torchrun worker's: detect_launcher says no launcher there)."""
    import sys
    from engine import failure
    from engine.launcher import detect_launcher
    MPI = sys.modules.get("mpi4py.MPI")   # looked up, never imported: `import torch` must not load MPI
    if MPI is None or not MPI.Is_initialized():
        launched = detect_launcher()
        if launched is None or launched[0] == "Open MPI" or launched[2] == 1:
            return
        print(f"engine: rank {launched[1]}: init_process_group failed ({failure.describe(exc)}); starting MPI, "
              f"which the other ranks wait in, to end the job at exit ({launched[0]} does not end it at this "
              "rank's exit)", file=sys.stderr, flush=True)
    elif MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    try:
        from engine import mpi
        mpi.load()  # arms the failure policy (and starts MPI where it is not up)
    except Exception as start:   # (the user's error is the one to raise, this one only said)
        print(f"engine: MPI could not start to end the job ({failure.describe(start)})", file=sys.stderr, flush=True)
        return
    failure.init_failed(failure.describe(exc))


def _succeeded_at_init():
    """A world made: an earlier init_process_group's failure is withdrawn, and so are the failures of
    groups of an earlier world (torch makes a world only once the last one was destroyed or aborted)
    where this one spans the MPI job: every rank met after them."""
    import sys
    failure = sys.modules.get("engine.failure")
    if failure is None:
        return
    failure.init_succeeded()
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_world_size() == MPI.COMM_WORLD.Get_size():
            failure.recovered()
