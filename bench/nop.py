"""A process group that does nothing: torch.distributed's own share of every call (argument checks,
dispatch, the Work), so tables can split a call's time into torch's, the adapter's and the engine's."""

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


class NopProcessGroup(dist.ProcessGroup):
    def getBackendName(self):
        return "nop"

    def _nothing(self, *args, **kwargs):
        return _DONE

    allreduce = broadcast = reduce = allgather = all_gather_single = gather = scatter = _nothing
    reduce_scatter = reduce_scatter_single = alltoall = alltoall_base = all_to_all_single = barrier = _nothing
    send = recv = recv_anysource = allreduce_coalesced = _nothing


def nop_group():
    """A group of every rank on the do-nothing backend (registered on first use)."""
    if "nop" not in dist.Backend.backend_list:
        dist.Backend.register_backend("nop", lambda opts, _options: NopProcessGroup(opts.group_rank, opts.group_size),
                                      extended_api=True, devices=["cpu"])
    return dist.new_group(backend="nop")
