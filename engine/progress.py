"""A background thread per process group that runs its operations in issue order.

Callers submit an operation and get a Task back at once (Horovod's pattern: user-facing calls only
enqueue). A caller that waits on a task which has not started yet, is first in line and has nothing
running ahead of it runs the task itself instead of waking the thread and sleeping: synchronous calls
pay no thread hand-off, while asynchronous ones (DDP's buckets) overlap with the caller's work.
Order is kept either way: only the head of the queue runs, and never two at once. A caller that
will wait at once anyway (torch's async_op=False) uses run(), which runs the operation in place when
nothing is queued, without waking the thread at all.
"""

import collections
import threading

from . import _core

PENDING, RUNNING, DONE = 0, 1, 2


class Task:
    """One operation: its function, state, error, and the callbacks to run when it completes."""

    __slots__ = ("fn", "state", "error", "callbacks", "name")

    def __init__(self, fn, name):
        self.fn = fn
        self.name = name
        self.state = PENDING
        self.error = None
        self.callbacks = None


class Progress:
    def __init__(self, name="engine-progress"):
        lock = threading.Lock()
        self._cv = threading.Condition(lock)        # a task finished (waiters sleep here)
        self._work = threading.Condition(lock)      # work for the thread (only it sleeps here)
        self._queue = collections.deque()
        self._running = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, name="op"):
        task = Task(fn, name)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{name}: this process group was shut down (destroy_process_group); "
                                   "create a new one with init_process_group / new_group")
            self._queue.append(task)
            if not self._running:
                self._work.notify()
        return task

    def run(self, fn, name="op"):
        """Runs fn now, in this thread, after everything queued before it; raises what fn raises."""
        with self._cv:
            idle = not self._running and not self._queue and not self._closed
            if idle:
                self._running = True
        if not idle:
            task = self.submit(fn, name)
            self.wait(task)
            if task.error is not None:
                raise task.error
            return
        try:
            fn()
        finally:
            with self._cv:
                self._running = False
                if self._queue or self._closed:
                    self._work.notify()

    def add_done_callback(self, task, callback):
        """callback(task) runs once the task is done (at once if it already is)."""
        with self._cv:
            if task.state != DONE:
                if task.callbacks is None:
                    task.callbacks = []
                task.callbacks.append(callback)
                return
        callback(task)

    def wait(self, task, timeout=None):
        """Blocks until task is done (running it here if it is next in line); False on timeout."""
        with self._cv:
            if task.state == PENDING and not self._running and self._queue and self._queue[0] is task:
                self._queue.popleft()
                task.state = RUNNING
                self._running = True
            elif task.state != DONE:
                if not self._cv.wait_for(lambda: task.state == DONE, timeout):
                    return False
                return True
            else:
                return True
        self._run(task)
        return True

    def close(self):
        """Runs what is queued, then stops the thread."""
        with self._cv:
            self._closed = True
            self._work.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _loop(self):
        _core.set_thread_polite(True)  # leave the core to the computation this thread overlaps with
        while True:
            with self._cv:
                while not self._queue or self._running:
                    if self._closed and not self._queue:
                        return
                    self._work.wait()
                task = self._queue.popleft()
                task.state = RUNNING
                self._running = True
            self._run(task)

    def _run(self, task):
        try:
            task.fn()
        except BaseException as exc:  # delivered to whoever waits on the task
            task.error = exc
        with self._cv:
            task.state = DONE
            task.fn = None
            self._running = False
            callbacks, task.callbacks = task.callbacks, None
            self._cv.notify_all()
            if self._queue or self._closed:  # the thread sleeps until there is work: don't wake it otherwise
                self._work.notify()
        for cb in callbacks or ():
            cb(task)
