"""Two Python process groups that measure the torch layer:
- nop does nothing: torch.distributed's own share of every call (argument checks, dispatch, the Work);
- direct makes the engine's direct call and nothing more: the torch call as it would be with an adapter
  that costs nothing.
So tables can split a call's time into torch's, the adapter's and the engine's."""

import torch
import torch.distributed as dist


class _Done(dist._Work):
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result([])
        return fut


_DONE = _Done()


class _PythonGroup(dist.ProcessGroup):
    """A group made in Python is its own backend: torch 2.15's batch_isend_irecv asks a group for its
    device's backend before it sends, and C++ knows none for a Python group."""

    supports_coalescing = False

    def _get_backend(self, device):
        return self


class NopProcessGroup(_PythonGroup):
    def getBackendName(self):
        return "nop"

    def _nothing(self, *args, **kwargs):
        return _DONE

    allreduce = broadcast = reduce = allgather = all_gather_single = gather = scatter = _nothing
    reduce_scatter = reduce_scatter_single = alltoall = alltoall_base = all_to_all_single = barrier = _nothing
    send = recv = recv_anysource = allreduce_coalesced = _nothing


class DirectProcessGroup(_PythonGroup):
    """A group whose collectives run the one call it was made with (the engine's direct call on the
    bench case's own buffers: nothing read from torch's options, no Work made) and whose send/recv are
    the communicator's blocking ones. Unlike nop's call followed by the direct one, the wait sits
    inside torch's call, where any backend's does: a pingpong's critical path then holds torch's own
    return from recv and entry into send, as the engine's does. Only what the bench's cases call."""

    def getBackendName(self):
        return "direct"

    def _call(self, *args, **kwargs):
        self.call()
        return _DONE

    allreduce = broadcast = reduce = all_gather_single = reduce_scatter_single = all_to_all_single = _call
    alltoall_base = barrier = _call

    def send(self, tensors, dst, tag):
        self.comm.send(tensors[0], dst, tag)
        return _DONE

    def recv(self, tensors, src, tag):
        self.comm.recv(tensors[0], src, tag)
        return _DONE


def _register(name, cls):
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, lambda opts, _options: cls(opts.group_rank, opts.group_size),
                                      extended_api=True, devices=["cpu"])


def direct_group(comm, call=None):
    """A group of every rank on the direct backend (collective over all ranks): its collectives run
    call(), its send/recv comm's."""
    _register("direct", DirectProcessGroup)
    group = dist.new_group(backend="direct")
    group.comm, group.call = comm, call
    return group


def nop_group():
    """A group of every rank on the do-nothing backend (registered on first use)."""
    _register("nop", NopProcessGroup)
    return dist.new_group(backend="nop")
