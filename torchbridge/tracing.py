"""What torch's tools see of each c10d call of an engine group: profiler events and torch's collective
hooks, both fired by `traced`, which wraps every general c10d method of the group. The latency path
(torchbridge._fastpath) hands a call to the general method whenever a profiler runs or a hook is set.

- Profiler: under torch's profiler every call records an event named as torch's own backends name
  theirs ("engine:all_reduce", with the inputs' shapes when shapes are recorded), from the call until
  its work completes. Without a profiler that costs one test of torch's own flag
  (torch.autograd.profiler._is_profiler_enabled, what torch's compiler checks for the same reason).
- Collective hooks (torch 2.14+): `register_pre_hook(id, fn)` and `register_post_hook(id, fn)` on the
  group. torch fires them from its dispatcher, which a Python group's methods never pass through, so
  the group fires them itself, with torch's own PreHookArgs and PostHookArgs: what torch's backends
  give (the op's name, async_op, input and output tensors, root or peer, op_id). TORCH_DIST_NAN_CHECK=1
  checks every input for NaN first, as torch's NanCheckHook does on its own backends (torch attaches
  that hook to the group's C++ base, where nothing fires it)."""

import functools
import itertools
import os

import torch
from torch.autograd import profiler as _autograd_profiler

from engine._core import REFUSALS
from engine.progress import ran

from .work import CollectiveWork, PointToPointWork

_RecordFunction = torch._C._profiler._RecordFunctionFast  # records the inputs' shapes when asked to

try:   # torch 2.14+
    from torch._C._distributed_c10d import HookOpName as _HookOpName, PostHookArgs, PreHookArgs
except ImportError:
    _HookOpName = PreHookArgs = PostHookArgs = None
_BROADCAST = _HookOpName.BROADCAST if _HookOpName is not None else None


def _hook_name(name):
    """torch's HookOpName: the op's own ("ALLGATHER_BASE", torch 2.15), else its family's ("ALLGATHER")."""
    if _HookOpName is None:
        return None
    words = name.split("_")
    for candidate in (name, "_".join(words[:2]), words[0]):
        if candidate in _HookOpName.__members__:
            return _HookOpName.__members__[candidate]
    return _HookOpName.UNKNOWN


# What torch's hooks see of a call, from the c10d method's arguments: (inputs, outputs, root, options).
def _flat(lists): return [t for ts in lists for t in ts]
def _tensors(tensors, opts=None): return tensors, [], -1, opts
def _fused(tensors, *_, **__): return tensors, [], -1, None   # (always queued: async_op)
def _rooted(tensors, opts): return tensors, [], opts.rootRank, opts
def _pair(output, input, opts=None): return [input], [output], -1, opts
def _pairs(outputs, inputs, opts=None): return inputs, outputs, -1, opts
def _split_pair(output, input, _out_splits, _in_splits, opts=None): return [input], [output], -1, opts
def _gathered(output_lists, inputs, opts=None): return inputs, _flat(output_lists), -1, opts
def _gather(output_lists, inputs, opts): return inputs, _flat(output_lists), opts.rootRank, opts
def _gather_single(output, input, opts): return [input], [output], opts.rootRank, opts
def _scattered(outputs, input_lists, opts=None): return _flat(input_lists[:1]), outputs, -1, opts
def _scatter(outputs, input_lists, opts): return _flat(input_lists[:1]), outputs, opts.rootRank, opts
def _barrier(opts=None): return [], [], -1, opts
def _send(tensors, dst, _tag): return tensors, [], dst, None
def _recv(tensors, src, _tag): return [], tensors, src, None
def _recv_any(tensors, _tag): return [], tensors, -1, None


# Each traced method's profiler event, torch's hook name, and view (above).
CALLS = {
    "all_reduce": ("ALLREDUCE", _tensors),
    "all_reduce_coalesced": ("ALLREDUCE_COALESCED", _tensors),
    "fused_allreduce": ("ALLREDUCE", _fused),          # DDP's buckets and DistributedOptimizer's
    "reduce": ("REDUCE", _rooted),
    "broadcast": ("BROADCAST", _rooted),
    "reduce_scatter": ("REDUCE_SCATTER", _scattered),
    "reduce_scatter_tensor": ("REDUCE_SCATTER_BASE", _pair),
    "reduce_scatter_tensor_coalesced": ("REDUCE_SCATTER_TENSOR_COALESCED", _pairs),
    "all_gather": ("ALLGATHER", _gathered),
    "all_gather_into_tensor": ("ALLGATHER_BASE", _pair),
    "all_gather_into_tensor_coalesced": ("ALLGATHER_INTO_TENSOR_COALESCED", _pairs),
    "all_gather_coalesced": ("ALLGATHER_COALESCED", _gathered),
    "gather": ("GATHER", _gather),
    "gather_single": ("GATHER", _gather_single),
    "scatter": ("SCATTER", _scatter),
    "all_to_all": ("ALLTOALL", _pairs),
    "all_to_all_single": ("ALLTOALL_BASE", _split_pair),
    "barrier": ("BARRIER", _barrier),
    "monitored_barrier": (None, None),   # (torch runs Gloo's past its dispatcher: no hooks)
    "send": ("SEND", _send),
    "recv": ("RECV", _recv),
    "recvAnySource": ("RECV", _recv_any),
}


def traced(name, inputs=None):
    """A c10d method that, under torch's profiler, records the event "engine:<name>" (with the shapes
    of inputs(*args): the tensors torch's own backends record) from the call until its work completes,
    and fires the group's collective hooks around the call."""
    title = "engine:" + name
    kind, view = CALLS[name]
    hook = _hook_name(kind) if kind is not None else None
    # (a collective's refusal by the adapter's checks counts as the group's call: the group's _refused)
    refusable = kind is not None and kind not in ("SEND", "RECV")

    def wrap(method):
        @functools.wraps(method)
        def traced(self, *args, **kwargs):
            try:
                return run(self, args, kwargs)
            except REFUSALS as exc:
                if refusable:
                    self._refused(kind, exc, args, kwargs, view)
                raise

        def run(self, args, kwargs):
            hooks = self._call_hooks if hook is not None else None
            if not _autograd_profiler._is_profiler_enabled and hooks is None:
                return method(self, *args, **kwargs)
            event = None
            if _autograd_profiler._is_profiler_enabled:
                event = _RecordFunction(title, list(inputs(*args)) if inputs is not None else [])
                event.__enter__()
            try:
                if hooks is None:
                    work = method(self, *args, **kwargs)
                else:
                    op_id, async_op = hooks.before(self, hook, *view(*args, **kwargs))
                    work = method(self, *args, **kwargs)
                    try:
                        hooks.after(hook, async_op, op_id, work)
                    except BaseException as exc:   # (after the call: no refusal of it)
                        raise ran(exc)
            except BaseException:
                if event is not None:
                    _end(event)
                raise
            if event is not None:
                _end_when_done(work, event)
            return work

        return traced

    return wrap


class CallHooks:
    """One group's collective hooks: torch's pre and post hooks by id (fired in id order, as torch's
    ordered map fires them), and the NaN check."""

    def __init__(self, nan_check):
        self.pre, self.post = {}, {}
        self.nan_check = nan_check
        self.ops = itertools.count()   # op_id: counts the calls made while a hook is set, as torch counts them

    def __bool__(self):
        return bool(self.pre or self.post or self.nan_check)

    def before(self, group, name, inputs, outputs, root, opts):
        """Fires the pre hooks (the NaN check first); returns (op_id, async_op) for after()."""
        async_op = True if opts is None else bool(opts.asyncOp)   # (point-to-point: always, as torch)
        if self.nan_check and (name != _BROADCAST or root == group.rank()):   # (what a rank sends, as torch)
            for t in inputs:
                torch.ops.c10d.check_for_nan(t)
        op_id = next(self.ops)   # (atomic under the GIL: calls from several threads get their own)
        if self.pre:
            args = PreHookArgs()
            args.name, args.async_op, args.root, args.op_id = name, async_op, root, op_id
            args.input_tensors, args.output_tensors = list(inputs), list(outputs)
            for _, fn in sorted(self.pre.items()):
                fn(args)
        return op_id, async_op

    def after(self, name, async_op, op_id, work):
        if self.post:
            args = PostHookArgs()
            args.name, args.async_op, args.op_id, args.work = name, async_op, op_id, work
            for _, fn in sorted(self.post.items()):
                fn(args)


class CollectiveHooks:
    """The collective-hook half of EngineProcessGroup (torch 2.14+): `_call_hooks` is the group's
    CallHooks while any is set, else None (the latency path then stays on)."""

    def _init_call_hooks(self):
        nan_check = PreHookArgs is not None and os.environ.get("TORCH_DIST_NAN_CHECK", "0") == "1"
        self._hooks = CallHooks(nan_check)
        self._call_hooks = self._hooks if self._hooks else None

    def register_pre_hook(self, hook_id, hook):
        _check_hooks()
        self._hooks.pre[int(hook_id)] = hook
        self._hooks_changed()

    def unregister_pre_hook(self, hook_id):
        self._hooks.pre.pop(int(hook_id), None)
        self._hooks_changed()

    def register_post_hook(self, hook_id, hook):
        _check_hooks()
        self._hooks.post[int(hook_id)] = hook
        self._hooks_changed()

    def unregister_post_hook(self, hook_id):
        self._hooks.post.pop(int(hook_id), None)
        self._hooks_changed()

    def _register_on_completion_hook(self, hook):
        raise RuntimeError("backend 'engine': completion hooks (_register_on_completion_hook) are not supported: "
                           "torch runs them for NCCL only (Gloo refuses them too); chain a callback on a Work's "
                           "get_future(), or write every operation's timeline with ENGINE_TRACE=<file>")

    def _hooks_changed(self):
        self._call_hooks = self._hooks if self._hooks else None
        self._fast.hooked = self._call_hooks is not None


def _check_hooks():
    if PreHookArgs is None:
        raise NotImplementedError(f"torch {torch.__version__} has no collective hooks (register_pre_hook and "
                                  "register_post_hook came with torch 2.14)")


def _end(event, *_):
    event.__exit__(None, None, None)


def _end_when_done(work, event):
    """Ends event when work completes, in the thread that completes it (the progress thread, or a
    caller who waits), as torch's backends end theirs. Work already complete (a synchronous call ran in
    place) ends it now, and so does CUDA work: that is enqueued on a stream, and the GPU's own activity
    in the profile shows when it runs."""
    if type(work) is CollectiveWork:
        task = work._task
        task.progress.add_done_callback(task, functools.partial(_end, event))
    elif type(work) is PointToPointWork:
        work.add_done_callback(functools.partial(_end, event))
    else:
        _end(event)


# traced's inputs: the tensors of a c10d method's arguments that torch's own backends record.
def first(tensors, *_): return tensors
def second(_, tensors, *__): return tensors
def second_one(_, tensor, *__): return [tensor]
def root_inputs(_, input_lists, *__): return input_lists[0] if input_lists else []
