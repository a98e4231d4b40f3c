"""Profiler events for the adapter's c10d methods: under torch's profiler every call records an event
named as torch's own backends name theirs ("engine:all_reduce", with the inputs' shapes when shapes are
recorded), from the call until its work completes. Without a profiler that costs one test of torch's own
flag (torch.autograd.profiler._is_profiler_enabled, what torch's compiler checks for the same reason)."""

import functools

import torch
from torch.autograd import profiler as _autograd_profiler

from .work import CollectiveWork, PointToPointWork

_RecordFunction = torch._C._profiler._RecordFunctionFast  # records the inputs' shapes when asked to


def traced(name, inputs=None):
    """A c10d method that, under torch's profiler, records the event "engine:<name>" (with the shapes
    of inputs(*args): the tensors torch's own backends record) from the call until its work completes."""
    title = "engine:" + name

    def wrap(method):
        @functools.wraps(method)
        def traced(self, *args, **kwargs):
            if not _autograd_profiler._is_profiler_enabled:
                return method(self, *args, **kwargs)
            event = _RecordFunction(title, list(inputs(*args)) if inputs is not None else [])
            event.__enter__()
            try:
                work = method(self, *args, **kwargs)
            except BaseException:
                _end(event)
                raise
            _end_when_done(work, event)
            return work

        return traced

    return wrap


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
