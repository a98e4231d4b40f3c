"""Work objects: what every call of the process group returns (torch's c10d Work contract)."""

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine import failure
from engine.progress import DONE
from engine.watch import EngineTimeout


UNSET_TIMEOUT = timedelta(milliseconds=-1)   # (torch's kUnsetTimeout: the group's own then)


def own_timeout(opts, what):
    """A call's own timeout in seconds from torch's options (dist.barrier(timeout=...)), or None: unset
    (torch's -1 ms), or none given. Any other value not above 0 is refused: Gloo ends such a call at
    once, and the engine's group timeout of 0 is refused alike."""
    timeout = getattr(opts, "timeout", None)
    if timeout is None or timeout == UNSET_TIMEOUT:
        return None
    seconds = timeout.total_seconds()
    if not seconds > 0:
        raise ValueError(f"engine {what}: a call's own timeout must be above 0, got {seconds:g} s (it would end "
                         "the call before it began): pass a positive timeout, or none for the group's")
    return seconds


def in_seconds(timeout, default=None):
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def future_pair():
    """(what the engine completes, what it hands out). torch.futures.Future.set_exception marks a
    future failed for Python's wait() only: C++ sees it completed, with the exception object as its
    value, and DDP's reducer, reading that as the bucket's tensors, crashes the process. The future
    handed out is the first's then(): its callback raises, so it fails in C++ too, and Python's
    wait() raises the same exception."""
    completer = torch.futures.Future()
    return completer, completer.then(lambda fut: fut.value())   # (value() raises what set_exception gave)


def future_error(error, name):
    """error as a torch Future takes it: an Exception only (its set_exception asserts so, inside the
    callback that completes it, and the future never completed); a ^C or sys.exit in the caller's run
    of the call becomes a RuntimeError naming it."""
    if isinstance(error, Exception):
        return error
    wrapped = RuntimeError(f"{name} was interrupted ({type(error).__name__}) before it completed")
    wrapped.__cause__ = error
    return wrapped


# A Work's first get_future() makes its future under this lock: two threads asking at once (a hook's
# and the user's) get the same future, and it completes once. (Reentrant: a coalesced Work's future is
# made from its parts'.)
_FUTURE_LOCK = threading.RLock()


def future_once(work):
    """work's future: made by work._make_future() at the first call, under _FUTURE_LOCK."""
    fut = getattr(work, "_future", None)   # (a slot: unset until made)
    if fut is None:
        with _FUTURE_LOCK:
            fut = getattr(work, "_future", None)
            if fut is None:
                fut = work._future = work._make_future()
    return fut

# Under allow_inflight_collective_as_graph_input_ctx() torch's wait_tensor (eager, or in a compiled graph)
# waits for the Work registered for its tensor, which torch's C++ methods register and a Python group's
# are not: an asynchronous Work registers its outputs itself (a complete one needs no waiting).
_INFLIGHT = getattr(torch._C._distributed_c10d, "_allow_inflight_collective_as_graph_input", None)
_REGISTER = getattr(torch._C._distributed_c10d, "_register_work", None)


def _tensors(outputs):
    for out in outputs or ():
        if isinstance(out, torch.Tensor):
            yield out
        elif isinstance(out, (list, tuple)):
            yield from _tensors(out)


def registered(work, outputs):
    """work, its output tensors registered for torch's wait_tensor where torch asks for it."""
    if _INFLIGHT is not None and _INFLIGHT():
        for t in _tensors(outputs):
            _REGISTER(t, work)
    return work


# Gloo's words for result() on a Work that is not complete yet
NOT_COMPLETED = "Work needs to be completed before calling result(). Should call wait() before result()."


class _OutputsWork(dist._Work):
    """What the engine's Works share: the output tensors as result, nothing to synchronize on CPU,
    success as completion without an exception."""

    __slots__ = ()

    def result(self):
        if not self.is_completed():
            raise RuntimeError(NOT_COMPLETED)
        return list(self._outputs)

    def synchronize(self):
        pass

    def is_success(self):
        return self.is_completed() and self.exception() is None


class CollectiveWork(_OutputsWork):
    """A queued collective. wait() runs it inline when it is next in line (no thread hand-off), or
    blocks until the group's progress thread has run it; get_future() completes when it is done,
    with the output tensors as value (as Gloo's and NCCL's futures do).

    No __init__ of its own (pybind's takes less than half the time then): made by of(task), which
    holds everything in the task (its progress engine and outputs). Slots, not a __dict__: one
    allocation less per asynchronous call."""

    __slots__ = ("_task", "_future", "_completer")

    @staticmethod
    def of(task):
        work = CollectiveWork()
        work._task = task
        return registered(work, task.outputs)

    def wait(self, timeout=None):
        task = self._task
        if timeout is None or not timeout:
            task.progress.wait(task)
        else:
            seconds = in_seconds(timeout)
            if not task.progress.wait(task, seconds if seconds > 0 else None):
                raise EngineTimeout(f"Work.wait: Timed out after {seconds:g} s waiting for {task.name} to complete "
                                    f"(it is still queued or running; the group's own timeout ends it if a rank "
                                    f"never joins)")
        if task.error is not None:
            raise failure.again(task.error)
        return True

    def is_completed(self):
        return self._task.state == DONE

    def exception(self):
        return self._task.error

    def result(self):
        if self._task.state != DONE:
            raise RuntimeError(NOT_COMPLETED)
        return list(self._task.outputs)

    get_future = future_once

    def _make_future(self):
        self._completer, fut = future_pair()
        self._task.progress.add_done_callback(self._task, self._complete_future)
        return fut

    def _complete_future(self, task):
        if task.error is not None:
            self._completer.set_exception(future_error(task.error, task.name))
        else:
            self._completer.set_result(list(task.outputs))


class CompletedWork(_OutputsWork):
    """What a synchronous call (async_op=False) returns: it already ran, in the caller's thread, and
    raised there if it failed. Its result and its future's value are the call's outputs, as an
    asynchronous call's (DDP hooks read them). Made by of(outputs): no __init__ of its own, as
    CollectiveWork."""

    __slots__ = ("_outputs",)

    @staticmethod
    def of(outputs=()):
        work = CompletedWork()
        work._outputs = outputs
        return work

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def exception(self):
        return None

    def get_future(self):
        cuda = {t.device for t in self._outputs if isinstance(t, torch.Tensor) and t.is_cuda}
        fut = torch.futures.Future(devices=sorted(cuda, key=str) or None)
        fut.set_result(list(self._outputs))
        return fut


def all_of(works, outputs, value=None):
    """One Work for the Works of a coalesced call's parts (Gloo's coalesced calls return one); value,
    where given, is its future's value in place of the outputs' list."""
    return works[0] if len(works) == 1 and value is None else CoalescedWork(works, outputs, value)


class CoalescedWork(_OutputsWork):
    """The parts of a coalesced call as one Work: complete when every part is, failed with the first
    part's failure, raised once every part is done (none still writes its output then); its future
    completes likewise, with every part's outputs as value (or the value given: all_gather_coalesced's
    is its output lists, nested as Gloo's)."""

    def __init__(self, works, outputs, value=None):
        super().__init__()
        self._works = works
        self._outputs = list(outputs)
        self._value = value
        self._future = None

    def wait(self, timeout=None):
        seconds = in_seconds(timeout) if timeout else None
        deadline = None if seconds is None else time.monotonic() + seconds
        error = None
        for work in self._works:
            try:
                work.wait(None if deadline is None else max(deadline - time.monotonic(), 1e-6))
            except EngineTimeout as exc:
                if deadline is not None and str(exc).startswith("Work.wait:"):   # (this wait's own: the
                    raise                                                      # parts go on)
                error = error or exc
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise failure.again(error)
        return True

    def synchronize(self):
        for work in self._works:
            work.synchronize()

    def is_completed(self):
        return all(work.is_completed() for work in self._works)

    def exception(self):
        return next((exc for exc in (work.exception() for work in self._works) if exc is not None), None)

    get_future = future_once

    def _make_future(self):
        futures = [work.get_future() for work in self._works]
        if not any(type(work) is CollectiveWork for work in self._works):
            # every part complete (run in place), or ordered on a CUDA stream: as each part's future
            cuda = {t.device for t in self._outputs if isinstance(t, torch.Tensor) and t.is_cuda}
            fut = torch.futures.Future(devices=sorted(cuda, key=str) or None)
            fut.set_result(self._result_value())
        else:
            completer, fut = future_pair()
            left, lock = [len(futures)], threading.Lock()

            def part_done(_):
                with lock:
                    left[0] -= 1
                    if left[0]:
                        return
                error = self.exception()
                if error is not None:
                    completer.set_exception(future_error(error, "a part of a coalesced call"))
                else:
                    completer.set_result(self._result_value())

            for part in futures:
                part.add_done_callback(part_done)
        return fut

    def _result_value(self):
        return list(self._outputs) if self._value is None else [list(outs) for outs in self._value]


class PointToPointWork(_OutputsWork):
    """A posted isend/irecv. It never occupies the progress thread, so an isend and an irecv to the
    same peer can't block each other; `finish` copies a staged receive into its tensor. Its
    completion is seen when it is made (a message the transport finished while posting it), or by
    whoever waits on it or tests it; then the done callbacks run.

    One thread at a time waits on the request (`_waiting`), without the lock: a second waiter (the
    user's wait(timeout) while a future's thread waits) waits on `_cond` for that one's outcome, within
    its own timeout, and is_completed() answers at once.

    Made by of() (pybind's own __init__ only, as CollectiveWork); reset() readies one nothing holds
    any more for the next message (torchbridge._fastpath reuses them)."""

    __slots__ = ("_request", "_outputs", "_finish", "_status", "_error", "_lock", "_future", "_callbacks",
                 "_waiting", "_cond")

    @staticmethod
    def of(request, outputs, finish=None, kick=None):
        work = PointToPointWork()
        work._lock = threading.Lock()
        work.reset(request, outputs, finish, kick)
        return registered(work, outputs)

    def reset(self, request, outputs, finish=None, kick=None):
        """kick(): called when the message is left in flight (its group's progress thread moves it)."""
        self._request = request
        self._outputs = outputs
        self._finish = finish
        self._status = self._error = self._future = self._callbacks = self._cond = None
        self._waiting = False
        if finish is None:
            # A message the transport finished while posting it (a small send, a receive whose
            # message was already there) is complete now: its wait() takes no lock. A failure found
            # here (the request is then spent) is kept for wait() to raise.
            try:
                if request.test():
                    self._status = request.wait() or ()
                    return
            except Exception as exc:
                self._error = exc
                return
        if kick is not None:
            kick()

    def wait(self, timeout=None):
        if self._status is not None:   # set last, once any staged copy is made: nothing left to do
            return True
        seconds = in_seconds(timeout) if timeout else None
        callbacks = None
        lock = self._lock
        lock.acquire()   # (not `with`: on every message, and half the cost)
        try:
            if self._waiting:   # another thread waits on the request (a future's): its outcome is this one's
                seconds = self._await_waiter(seconds)
            if self._status is None and self._error is None:
                self._waiting = True
                lock.release()   # (is_completed, add_done_callback and other waiters go on meanwhile)
                try:
                    status, error = self._settle(seconds)
                finally:
                    lock.acquire()
                    self._waiting = False
                    if self._cond is not None:
                        self._cond.notify_all()
                self._error = error
                self._status = status
                callbacks, self._callbacks = self._callbacks, None
        finally:
            lock.release()
        if callbacks:
            for fn in callbacks:
                fn()
        if self._error is not None:
            raise failure.again(self._error)
        return True

    def _settle(self, seconds):
        """Waits on the request (the lock not held): (status, None), or (None, the failure). Raises this
        wait's own timeout (Work.wait(timeout)), the message still posted."""
        try:
            status = self._request.wait(seconds) or ()
            if self._finish is not None:
                self._finish()
            return status, None
        except EngineTimeout as exc:
            if seconds is not None and str(exc).startswith("Work.wait:"):   # (this wait's own: the
                raise                                                      # message stays posted)
            return None, exc
        except Exception as exc:
            return None, exc

    def _await_waiter(self, seconds):
        """With the lock held, until the thread waiting on the request is done (within `seconds`: else
        EngineTimeout, as the request's own wait raises it); the seconds left."""
        cond = self._cond
        if cond is None:
            cond = self._cond = threading.Condition(self._lock)
        if seconds is None:
            while self._waiting:
                cond.wait()
            return None
        deadline = time.monotonic() + seconds
        while self._waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineTimeout(f"Work.wait: Timed out after {seconds:g} s waiting for its isend/irecv to "
                                    "complete (it stays posted: wait on it again; the group's timeout ends it if "
                                    "its peer never comes)")
            cond.wait(left)
        return max(deadline - time.monotonic(), 1e-6)

    def __del__(self):
        # Dropped while its message is in flight (dist.isend unkept): the message still goes, as
        # MPI_Request_free leaves it; freeing the request would cancel it (Request.detach).
        request = getattr(self, "_request", None)
        if request is not None and self._status is None and self._error is None:
            request.detach()

    def add_done_callback(self, fn):
        """fn() runs once the transfer is seen complete (at once if it already is)."""
        with self._lock:
            if self._status is None and self._error is None:
                self._callbacks = (self._callbacks or []) + [fn]
                return
        fn()

    def is_completed(self):
        """Never raises, nor blocks (torch's contract): a failure the test finds is kept, for wait() to
        raise and exception() to give, and the Work is complete."""
        if self._status is not None or self._error is not None:
            return True
        callbacks = None
        with self._lock:
            if self._status is None and self._error is None:
                if self._waiting:   # (another thread waits on the request: it completes the Work)
                    return False
                try:
                    if not self._request.test():
                        return False
                except Exception as exc:
                    self._error = exc
                    callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            for fn in callbacks:
                fn()
        if self._status is None and self._error is None:
            try:
                self.wait()   # (complete: returns at once, after any staged copy)
            except Exception:
                pass          # (kept: wait() raises it, exception() gives it)
        return True

    def exception(self):
        return self._error

    def source_rank(self):
        self.wait()
        if not self._status:   # (torch's own words and type, as Gloo's send Work raises them)
            raise RuntimeError("sourceRank() may only be called on work objects that correspond to a recv or "
                               "recv-from-any call.")
        return self._status[0]

    _source_rank = source_rank

    get_future = future_once

    def _make_future(self):
        completer, future = future_pair()

        def complete():
            try:
                self.wait()
                completer.set_result(list(self._outputs))
            except Exception as exc:
                completer.set_exception(exc)

        threading.Thread(target=complete, name="engine-p2p-future", daemon=True).start()
        return future


class CudaWork(_OutputsWork):
    """A collective enqueued on a CUDA stream, done when `event` (recorded after it) is. As with torch's
    NCCL backend, wait() makes the current stream wait for the event and returns without blocking the
    host; the future is CUDA-aware (its value is ready for work on the stream that awaits it). The
    group's watchdog turns a collective that never completes into an error raised here."""

    def __init__(self, event, outputs, device, watchdog, flush=None):
        super().__init__()
        self._event = event
        self._outputs = outputs
        self._device = device
        self._watchdog = watchdog
        self._flush = flush  # posts deferred point-to-point (its event is recorded then)
        self._future = None
        self._error = None   # why its deferred message was never posted (fail())

    def fail(self, error):
        """Its deferred message could not be posted: it is complete, failed with error (its event is
        never recorded, and an event never recorded reads as complete)."""
        self._error = error
        self._flush = None

    def _post(self):
        if self._flush is not None:
            flush, self._flush = self._flush, None
            flush()

    def _raise_failure(self):
        self._post()
        if self._error is not None:
            raise failure.again(self._error)
        if self._watchdog.error is not None:
            raise failure.again(self._watchdog.error)

    def wait(self, timeout=None):
        """Without a timeout, the current stream waits for the work (the host goes on). With one, as
        torch's NCCL Work: the host waits for it, at most that long, then raises (it stays enqueued;
        the group's watchdog ends it if a rank never joins)."""
        self._raise_failure()
        seconds = in_seconds(timeout) if timeout else None
        if seconds:
            deadline, pause = time.monotonic() + seconds, 20e-6
            while not self._event.query():
                self._raise_failure()
                if time.monotonic() >= deadline:
                    raise EngineTimeout(f"Work.wait: Timed out after {seconds:g} s waiting for the collective on the "
                                        "CUDA stream to complete (it stays enqueued; the group's watchdog ends it "
                                        "if a rank never joins)")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def synchronize(self):
        self.wait()

    def result(self):   # (NCCL's: the outputs, complete or not: they are ready for work on the stream)
        return list(self._outputs)

    def is_completed(self):
        try:
            self._post()
        except Exception:
            pass   # (kept by fail(): exception() gives it, wait() raises it)
        return self._error is not None or bool(self._event.query())

    def is_success(self):
        return self.is_completed() and self.exception() is None

    def exception(self):
        return self._error if self._error is not None else self._watchdog.error

    get_future = future_once

    def _make_future(self):
        self._raise_failure()
        fut = torch.futures.Future(devices=[torch.device("cuda", self._device)])
        with torch.cuda.device(self._device):
            torch.cuda.current_stream().wait_event(self._event)
            fut.set_result(list(self._outputs))
        return fut
