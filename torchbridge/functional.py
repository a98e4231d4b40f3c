"""torch's functional collectives (torch.ops._c10d_functional, what torch.compile's graphs call) on an
engine group. Two of their C++ kernels ask the group for its C++ backend of the tensors' device, which a
ProcessGroup written in Python has not got (torch's PyProcessGroup forwards neither `all_gather_single`
nor `startCoalescing` to Python): all_gather_into_tensor_out (inductor's all-gather bucketing and its
FSDP pass) and batch_p2p_ops (a compiled batch_isend_irecv). Both failed on an engine group with "No
backend type associated with device type cpu".

Their CPU and CUDA kernels here do for an engine group what torch's C++ does for a C++ group (the same
calls, the same Works registered for wait_tensor), and hand every other group to torch's own kernel."""

import torch
from torch._C._distributed_c10d import AllgatherOptions, _register_work, _resolve_process_group

from .process_group import EngineProcessGroup

_TORCH_KERNEL = torch._C.DispatchKey.CompositeExplicitAutograd
_DEVICES = ("CPU", "CUDA")
_library = []   # the registration lives as long as its Library object


def _engine_group(group):
    """The engine group a functional collective names (by name or as the group itself), else None."""
    if isinstance(group, str):
        group = _resolve_process_group(group)
    return group if isinstance(group, EngineProcessGroup) else None


def all_gather_into_tensor_out(input, group_size, group_name, *, out):
    group = _engine_group(group_name)
    if group is None:
        return torch.ops._c10d_functional.all_gather_into_tensor_out.default._op_dk(
            _TORCH_KERNEL, input, group_size, group_name, out=out)
    if not input.is_contiguous():
        raise RuntimeError("all_gather_into_tensor_out: the input must be contiguous (call .contiguous())")
    _register_work(out, group._allgather_base(out, input, AllgatherOptions()))
    return out


def batch_p2p_ops(op_list, peer_list, tag_list, tensors, group_name):
    group = _engine_group(group_name)
    if group is None or not op_list:
        return torch.ops._c10d_functional.batch_p2p_ops.default._op_dk(
            _TORCH_KERNEL, op_list, peer_list, tag_list, tensors, group_name)
    if not len(op_list) == len(peer_list) == len(tag_list) == len(tensors):
        raise RuntimeError(f"batch_p2p_ops: {len(op_list)} ops, {len(peer_list)} peers, {len(tag_list)} tags and "
                           f"{len(tensors)} tensors: give one of each per operation")
    unknown = sorted(set(op_list) - {"isend", "irecv"})
    if unknown:   # (refused before any is posted: torch's kernel posts the ones before it)
        raise RuntimeError(f"batch_p2p_ops: unsupported operation {unknown[0]!r}: each is 'isend' or 'irecv'")
    results = []
    for op, peer, tag, t in zip(op_list, peer_list, tag_list, tensors):
        if op == "isend":
            work = group.send([t], peer, tag)
            placeholder = torch.empty(0, dtype=t.dtype, device=t.device)   # (torch's: the graph waits on it)
            _register_work(t, work)
            _register_work(placeholder, work)
            results.append(placeholder)
        else:
            work = group.recv([t], peer, tag)
            _register_work(t, work)
            results.append(t)
    return results


def install():
    """Registers the kernels, once per process (at the first engine group)."""
    if _library:
        return
    library = torch.library.Library("_c10d_functional", "IMPL")
    for kernel in (all_gather_into_tensor_out, batch_p2p_ops):
        for device in _DEVICES:
            library.impl(kernel.__name__, kernel, device)
    _library.append(library)
