"""The GPU path's answer to "never hang silently": NCCL kernels wait on the device, not the host, so
a missing rank shows up as a CUDA event that never completes. A watchdog thread polls the events of
enqueued collectives (and NCCL's asynchronous error state); past the group's timeout it aborts the
NCCL communicator (ncclCommAbort frees the stuck kernels), and every later call or wait on that group
raises EngineTimeout naming the collective, as torch's NCCL watchdog does. on_fail(why) runs first, once
(the adapter runs torch's abort hooks there)."""

import sys
import threading
import time

from .. import forks
from ..watch import EngineTimeout

POLL_SECONDS = 0.05


class Watchdog:
    def __init__(self, name, rank, size, timeout, on_fail=None):
        self.name, self.rank, self.size, self.timeout = name, rank, size, timeout
        self.on_fail = on_fail
        self._pending = []  # (event with .query(), deadline, its seconds, what, communicator)
        self._cond = threading.Condition()
        self._thread = None
        self._closed = False
        self.error = None
        forks.track(self)

    def orphan(self, why):
        """In a child forked from this process: the thread is not there, and the lock may have been copied
        held; nothing is watched there."""
        self._cond, self._thread, self._pending, self._closed = threading.Condition(), None, [], True

    def watch(self, event, what, comm, seconds=None):
        """Called after enqueueing `what` on comm and recording `event` after it. seconds: the call's own
        timeout (None: the group's)."""
        if self.error is not None:
            raise self.error
        seconds = self.timeout if seconds is None else seconds
        with self._cond:
            self._pending.append((event, time.monotonic() + seconds, seconds, what, comm))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"engine-cuda-watchdog-{self.name}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self):
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                pending = list(self._pending)
            done = set()
            checked = set()  # NCCL's error state is asked once per communicator per poll
            now = time.monotonic()
            for item in pending:
                event, deadline, seconds, what, comm = item
                try:
                    complete = event.query()
                except Exception as exc:   # a sticky CUDA error (a kernel's illegal access): every later
                    self._fail(comm, EngineTimeout(   # call of the process fails too
                        f"{what} of group '{self.name}' (rank {self.rank} of {self.size}) failed on the GPU: {exc}"))
                    return
                if complete:
                    done.add(id(item))
                    continue
                if id(comm) not in checked:
                    checked.add(id(comm))
                    try:
                        comm.check_async_error()
                    except Exception as exc:  # a peer died or the network failed: NCCL knows already
                        self._fail(comm, EngineTimeout(f"{what} of group '{self.name}' (rank {self.rank} of "
                                                       f"{self.size}) failed in NCCL: {exc}"))
                        return
                if now > deadline:
                    self._fail(comm, EngineTimeout(
                        f"{what} of group '{self.name}' (rank {self.rank} of {self.size}): Timed out: it did not "
                        f"complete on the GPU within {seconds:g} s: a rank did not join it, or joined a different "
                        f"collective; the NCCL communicator was aborted"))
                    return
            with self._cond:
                self._pending = [p for p in self._pending if id(p) not in done]
            time.sleep(POLL_SECONDS)

    def _fail(self, comm, error):
        with self._cond:
            if self._closed or self.error is not None:   # (the group was aborted, or closed, meanwhile)
                return
            self.error = error
        print(f"engine: {error}", file=sys.stderr, flush=True)
        if self.on_fail is not None:
            on_fail, self.on_fail = self.on_fail, None
            on_fail(str(error))
        comm.abort(error)
        with self._cond:
            self._pending.clear()

    def abort(self, error):
        """The group was aborted: its Works raise error from now on (unless it failed before), and
        nothing more is watched."""
        with self._cond:
            if self.error is None:
                self.error = error
            self.on_fail = None
            self._pending.clear()
            self._closed = True
            self._cond.notify()

    def unfinished(self):
        """Whether a watched collective has not completed on the GPU yet."""
        with self._cond:
            pending = list(self._pending)
        return any(not event.query() for event, *_ in pending)

    def close(self):
        with self._cond:
            self._closed = True
            self._cond.notify()
