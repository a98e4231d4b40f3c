"""The engine's group as a torch Backend, for the groups torch builds itself around a backend it is
handed: dist.shrink_group asks the group's backend for a shrunk one (FaultTolerance.shrink) and
registers it on a ProcessGroup of its own. Only torch 2.14 and later let a Python class extend
torch's Backend; before, shrink_group is refused (supports_shrinking is False) and reconfigure leaves
ranks out instead. torch's calls reach an EngineBackend through its C++ dispatch, which is slower
than the group the creator returns (torch calls that one's Python methods directly), so every other
group stays an EngineProcessGroup."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d


def _python_backends():
    """Whether a Python class can extend torch's Backend (before torch 2.14 it has no constructor)."""
    try:
        type("Probe", (_c10d.Backend,), {})(0, 1)
    except TypeError:
        return False
    return True


PYTHON_BACKENDS = _python_backends()
_make_shrunk = getattr(dist.distributed_c10d, "_create_shrunk_process_group", None)
SHRINKS = PYTHON_BACKENDS and _make_shrunk is not None    # (see _shrunk_group)

# The names torch's Backend trampoline looks up (c10d/py/PyBackend.hpp), and the group's methods that
# answer them: the same signatures, except monitored_barrier's options. Not reconfigure: torch reads a
# Backend's rank and size as they were made, so a reconfigured one would misreport them.
_FORWARDED = {name: name for name in (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
    "allgather_coalesced", "all_gather_single_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_single_coalesced", "all_to_all_single", "alltoall", "send",
    "recv", "recv_anysource", "barrier", "shrink", "abort", "shutdown", "get_error", "set_timeout")}
_FORWARDED.update(allreduce_sparse="allreduce", registerAbortHook="register_abort_hook",
                  unregisterAbortHook="unregister_abort_hook")


def _forward(method):
    def forwarded(self, *args):
        return getattr(self.group, method)(*args)
    forwarded.__name__ = method
    return forwarded


def engine_group(group):
    """The EngineProcessGroup behind a torch group: the group itself, or the one the EngineBackend of
    a group torch built (shrink_group) forwards to; None for a group of another backend."""
    if hasattr(group, "fused_allreduce_async"):
        return group
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return None
    return backend.group if PYTHON_BACKENDS and isinstance(backend, EngineBackend) else None


if PYTHON_BACKENDS:
    class EngineBackend(_c10d.Backend):
        """A torch Backend whose every call is its EngineProcessGroup's (`group`)."""

        supports_splitting = False
        supports_coalescing = False
        supports_shrinking = True
        supports_reconfigure = False

        def __init__(self, group):
            super().__init__(group.rank(), group.size())
            self.group = group

        def getBackendName(self):
            return "engine"

        @property
        def options(self):
            return _c10d.Backend.Options("engine", timedelta(seconds=self.group._timeout_seconds()))

        def monitored_barrier(self, opts, wait_all_ranks=False):
            # (torch passes no timeout as a negative one: then the group's)
            timeout = opts.timeout if opts.timeout > timedelta(0) else None
            self.group.monitored_barrier(timeout, wait_all_ranks)

    for _name, _method in _FORWARDED.items():
        setattr(EngineBackend, _name, _forward(_method))

    def _shrunk_group(new_backend, remaining_ranks, metadata, is_default_group):
        """torch's _create_shrunk_process_group, for an EngineBackend registered as a custom backend's,
        which it is, on every device the engine serves. torch registers the backend of a CPU group as
        Gloo's, and torch code that finds a "gloo" group casts its backend to Gloo's class (DDP's
        logger reads its thread count): the process would crash there. It also registers only the old
        group's bound device, else the CPU."""
        if not isinstance(new_backend, EngineBackend):
            return _make_shrunk(new_backend, remaining_ranks, metadata, is_default_group)
        name = metadata["new_group_name"]
        group = dist.ProcessGroup(dist.PrefixStore(f"{name}/", metadata["store"].clone()), new_backend.rank(),
                                  new_backend.size())
        custom = dist.ProcessGroup.BackendType.CUSTOM
        for device in new_backend.group._device_types:
            group._register_backend(device, custom, new_backend)
        group._set_default_backend(custom)
        if metadata.get("bound_device_id") is not None:
            group.bound_device_id = metadata["bound_device_id"]
        group._set_group_name(name)
        group._set_group_desc("default:shrunken" if is_default_group else f"{metadata['original_group_name']}:shrunk")
        if metadata.get("backend_config") is not None:
            dist.distributed_c10d._world.pg_backend_config[group] = metadata["backend_config"]
        return group

    if SHRINKS:
        dist.distributed_c10d._create_shrunk_process_group = _shrunk_group
