"""The engine's group as a torch Backend, for the groups torch builds itself around a backend it is
handed: dist.shrink_group asks the group's backend for a shrunk one (FaultTolerance.shrink) and
registers it on a ProcessGroup of its own. Only torch 2.14 and later let a Python class extend
torch's Backend; before, shrink_group is refused (supports_shrinking is False) and reconfigure leaves
ranks out instead. torch's calls reach an EngineBackend through its C++ dispatch, which is slower
than the group the creator returns (torch calls that one's Python methods directly), so every other
group stays an EngineProcessGroup."""

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
SHRINKS = PYTHON_BACKENDS and _make_shrunk is not None    # (see _registered_as_custom)

# The names torch's Backend trampoline looks up (c10d/py/PyBackend.hpp), and the group's methods that
# answer them: the same signatures, except monitored_barrier's options.
_FORWARDED = {name: name for name in (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
    "allgather_coalesced", "all_gather_single_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_single_coalesced", "all_to_all_single", "alltoall", "send",
    "recv", "recv_anysource", "barrier", "get_reconfigure_handle", "reconfigure", "shrink", "abort", "shutdown",
    "get_error", "set_timeout")}
_FORWARDED.update(allreduce_sparse="allreduce", registerAbortHook="register_abort_hook",
                  unregisterAbortHook="unregister_abort_hook")


def _forward(method):
    def forwarded(self, *args):
        return getattr(self.group, method)(*args)
    forwarded.__name__ = method
    return forwarded


if PYTHON_BACKENDS:
    class EngineBackend(_c10d.Backend):
        """A torch Backend whose every call is its EngineProcessGroup's (`group`)."""

        supports_splitting = False
        supports_coalescing = False
        supports_shrinking = True
        supports_reconfigure = True

        def __init__(self, group):
            super().__init__(group.rank(), group.size())
            self.group = group

        def getBackendName(self):
            return "engine"

        def monitored_barrier(self, opts, wait_all_ranks=False):
            self.group.monitored_barrier(opts.timeout, wait_all_ranks)

    for _name, _method in _FORWARDED.items():
        setattr(EngineBackend, _name, _forward(_method))


    def _registered_as_custom(new_backend, *args, **kwargs):
        """torch's shrink_group registers the backend of a CPU group as Gloo's, and torch code that
        finds a "gloo" group casts its backend to Gloo's class (DDP's logger reads its thread count):
        the process would crash there. The group made around an EngineBackend is registered again,
        as a custom backend's, which is what it is."""
        group = _make_shrunk(new_backend, *args, **kwargs)
        if isinstance(new_backend, EngineBackend):
            for device in group._device_types:
                group._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, new_backend)
            group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        return group

    if SHRINKS:
        dist.distributed_c10d._create_shrunk_process_group = _registered_as_custom
