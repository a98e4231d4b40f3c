# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""engine._progress: the progress engine, a module of its own (it moves no data: it orders the group's
operations and runs them, on the caller's thread or its own)."""

from cpython.pythread cimport PyThread_get_thread_ident
from pthread cimport *
from shm cimport eng_now, eng_sleep

# Progress: a background thread per process group that runs the group's operations in issue order
# (Horovod's pattern: user-facing calls only enqueue). Compiled because a synchronous call goes through
# it on every collective: its state changes happen in C while the GIL is held, so they are atomic with
# respect to every other Python thread without a lock; the condition variable is touched only when a
# thread must sleep or be woken.
#
# - run(fn, a, b, c): a caller that will wait at once (torch's async_op=False) runs fn(a, b, c) in
#   place when nothing is queued or running: no thread hand-off, no lock, no allocation.
# - submit(fn, args): returns a Task at once. The thread starts it after a short grace, so a caller that
#   waits right away runs it itself (wait() takes a task that is first in line and not started) instead
#   of sleeping while the thread runs it: async_op=True + wait() costs about what a synchronous call does.
# Order is kept either way: only the head of the queue runs, and never two at once.
# - A task's done callbacks (a torch Future's then(): DDP's comm hooks) run before the next task starts.
#   What one issues takes the place in line it would have had had it run when it was registered (the
#   Work's get_future()): after what was queued before that, ahead of what was queued since. A callback
#   registered on a task already done runs at once, in the registering thread, and what it issues goes
#   to the back: the same place. So every rank issues its collectives in one order whether its callback
#   ran early or late (PowerSGD's hook issues two allreduces from callbacks while backward queues the
#   next buckets'; a script may issue two allreduces and chain a third on the first's future), where
#   nothing was issued between the get_future() and the then() (torch's Future hides the then()).
# - drive(driver) / kick(): while it has nothing to run, the thread moves the point-to-point messages
#   left in flight on the group's user channel (a pipeline stage's isend while it computes the next
#   micro-batch), without the GIL, as Gloo's own threads do.

import atexit
import collections
import sys
import threading
import traceback
import weakref

from engine import failure, forks
from engine._core import EngineError, EngineTimeout
from engine._core import set_thread_polite   # the core's waits read it (a thread-local of engine._core)


def ran(error):
    """error, marked as raised by a run of the call, or after it (not by a check before it): torch's
    adapter counts the refusals of its own checks as the group's calls (torchbridge.process_group),
    not these (was_run)."""
    try:
        error.__dict__["_engine_ran"] = True
    except (AttributeError, TypeError):
        pass
    return error


def was_run(error):
    """Whether ran() marked error."""
    return getattr(error, "__dict__", {}).get("_engine_ran", False)

cdef enum:
    TASK_PENDING = 0
    TASK_RUNNING = 1
    TASK_DONE = 2

PENDING, RUNNING, DONE = TASK_PENDING, TASK_RUNNING, TASK_DONE


cdef class Task:
    """One queued operation: fn(*args), its state, error, and the callbacks to run once it is done;
    outputs and progress: what the Work that carries it gives back, and the engine that runs it."""
    cdef public object fn, args, error, callbacks, outputs, progress
    cdef public str name
    cdef public int state
    cdef double submitted
    cdef long long seq              # its place in line: what submit() counted, or its issuing callback's
    cdef bint nested                # claimed inside another task's callbacks, by the thread running them

    @property
    def done(self):
        return self.state == TASK_DONE


# Every live progress engine, drained when the process ends normally. A daemon thread still running
# a task when Python finalizes dies as it takes the GIL back; where that is inside one of torch's C++
# calls (a tensor op releases the GIL, as does completing a torch Future) the C++ runtime aborts the
# process instead ("terminate called without an active exception", SIGABRT). So what is queued runs
# to its end first, each task bounded by its group's timeout, as Gloo's destructor does.
_live = weakref.WeakSet()


def _drain_at_exit():
    cdef Progress progress
    for progress in list(_live):
        if progress.refusal is None:
            progress.refusal = RuntimeError(
                "a collective was issued while the process exits, after the engine ran what its process groups "
                "had queued (an exit hook registered before the group was made?); issue it before the script ends")
        try:
            progress.close()
        except BaseException:   # one engine's failure must not keep the others from draining
            pass


cdef double ACTIVE_WINDOW = 0.02   # after the last submit the idle thread polls (no wake-up needed) this long,
cdef double POLL = 1e-3            # every this often, without the GIL; then it sleeps until submit signals it
cdef double DRIVE_SLEEP = 1e-3     # the longest sleep between moves of the user's messages in flight,
cdef double DRIVE_NAP = 20e-6      # the first, after some moved (doubling while none do)
cdef double DRIVE_AFTER = 1e-3     # the thread moves messages once the caller posted none for this long:
                                   # a caller still posting and waiting moves them itself, uncontended

ctypedef int (*channel_driver)(void *channel, double seconds) noexcept nogil


cdef class Progress:
    cdef object queue
    cdef bint running, closed
    cdef int pending                # tasks in the queue: written under the GIL, read by the idle thread without it
    cdef int deep                   # the thread sleeps on `cond` until signalled
    cdef double last_submit
    cdef pthread_mutex_t mtx
    cdef pthread_cond_t cond
    cdef int waiters
    cdef object cv                  # callers waiting for a task the thread runs
    cdef object thread
    cdef object refusal             # what submit() raises once closed (abort's error), or None
    cdef Task current               # the task running now, or None
    cdef unsigned long cb_thread    # the thread running a task's callbacks, the run slot still held (0: none)
    cdef double cb_since            # since when (the outermost task's callbacks)
    cdef str cb_of                  # whose callbacks (the task's name)
    cdef long long submits          # tasks submitted so far, not by callbacks: the places in line
    cdef long long cb_seq           # the place of the callback running now (what it issues goes after it)
    cdef public double stall_seconds   # a waiter held this long behind callbacks fails (the group's timeout)
    cdef public double grace
    cdef channel_driver driver      # moves the user's messages in flight (drive()), or NULL
    cdef void *channel
    cdef object channel_owner       # holds channel
    cdef unsigned int kicks         # messages left in flight so far (kick())
    cdef unsigned int quiet_at      # kicks when the thread last found none in flight
    cdef double last_kick
    cdef object __weakref__

    def __cinit__(self, *args, **kwargs):
        pthread_mutex_init(&self.mtx, NULL)
        pthread_cond_init(&self.cond, NULL)

    def __dealloc__(self):
        pthread_cond_destroy(&self.cond)
        pthread_mutex_destroy(&self.mtx)

    def __init__(self, name="engine-progress", double grace=50e-6, double stall_seconds=1800.0):
        self.queue = collections.deque()
        self.stall_seconds = stall_seconds
        self.cv = threading.Condition(threading.RLock())   # (re-entrant: abort() from a signal handler while this thread holds it)
        self.grace = grace
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()
        _live.add(self)
        forks.track(self)
        # registered again with each engine, so it runs before the exit hooks registered since (atexit
        # runs the newest first): the TCP transports' goodbye, MPI's finalize
        atexit.unregister(_drain_at_exit)
        atexit.register(_drain_at_exit)

    def drive(self, driver):
        """driver: (address of a function(channel, seconds) that moves the channel's messages in flight
        and says whether some still are, address of the channel, its owner), a communicator's `driver`.
        While the thread has nothing to run it moves the messages kick() reports, as Gloo's own threads
        do: a peer blocked on one is not held up while this rank computes or waits outside the engine.
        Set once, before any kick()."""
        fn, channel, owner = driver
        self.channel_owner = owner
        self.channel = <void*><size_t>channel
        self.driver = <channel_driver><size_t>fn

    def kick(self):
        """A message posted on the driven channel was left in flight: the thread moves it once the
        caller has posted none for DRIVE_AFTER (a caller that waits sooner moves it itself)."""
        if self.driver != NULL:
            self.last_kick = eng_now()
            self.kicks += 1
            self._signal()

    def run(self, fn, a=None, b=None, c=None, int nargs=3, str name="op"):
        """fn(a, b, c) (its first nargs of them) now, in this thread, after everything queued before
        it; raises what fn raises."""
        cdef Task task
        if not self.running and not self.queue and not self.closed:  # atomic: no GIL release in between
            self.running = True
            try:
                if nargs == 3:
                    fn(a, b, c)
                elif nargs == 2:
                    fn(a, b)
                elif nargs == 1:
                    fn(a)
                else:
                    fn()
            except BaseException as exc:
                raise ran(exc)
            finally:
                self._finished()
            return
        task = self.submit(fn, (a, b, c)[:nargs], name)
        self.wait(task)
        if task.error is not None:
            raise failure.again(ran(task.error))

    def submit(self, fn, tuple args=(), str name="op", outputs=None):
        """Queues fn(*args); returns its Task at once."""
        cdef Task task = Task.__new__(Task)
        task.outputs = outputs
        task.progress = self
        if self.closed:
            if self.refusal is not None:
                raise self.refusal.with_traceback(None)   # (one object, raised again: its traceback would grow each time)
            raise RuntimeError(f"{name}: this process group was shut down (destroy_process_group); "
                               "create a new one with init_process_group / new_group")
        task.fn = fn
        task.args = args
        task.name = name
        task.submitted = self.last_submit = eng_now()
        # (issued by a callback of the task just run: it goes to its callback's place and runs, through
        # what is ahead of it, here, at once; see wait)
        inline = PyThread_get_thread_ident() == self.cb_thread
        if inline:
            task.seq = self.cb_seq
            self.queue.insert(self._place_of(self.cb_seq), task)
        else:
            self.submits += 1
            task.seq = self.submits
            self.queue.append(task)
        self.pending += 1
        self._signal()
        if inline:
            self.wait(task)
        return task

    cdef Py_ssize_t _place_of(self, long long seq):
        """Where in the queue a task issued at place seq goes: behind every task of a place up to seq."""
        cdef Py_ssize_t i = 0
        cdef Task queued
        for queued in self.queue:
            if queued.seq > seq:
                return i
            i += 1
        return i

    cdef void _signal(self) noexcept:
        # Under the mutex the idle thread checks `pending` before it sleeps, so this can't miss it;
        # uncontended and without a sleeper this is two atomic operations, no system call.
        pthread_mutex_lock(&self.mtx)
        if self.deep:
            pthread_cond_signal(&self.cond)
        pthread_mutex_unlock(&self.mtx)

    def wait(self, Task task, timeout=None):
        """Blocks until task is done, running it here if it is first in line and nothing runs (without
        a timeout); False on timeout, the task still queued or running. Inside a callback of a task (a torch Future's then(): PowerSGD's hook submits its
        next allreduce there and waits for it), on whichever thread ran the task (the engine's own
        or a caller's), it runs the queue through, in order, up to task: left to the thread's loop,
        task would wait for this very thread for ever."""
        cdef double until = -1 if timeout is None else eng_now() + timeout
        cdef bint through = PyThread_get_thread_ident() == self.cb_thread
        # (with a timeout the group's thread runs the task: run here, it would block past the timeout)
        cdef bint claims = through or until < 0
        cdef Task mine
        cdef double left, start = eng_now(), stall
        while task.state != TASK_DONE:
            mine = self._runnable_for(task, through)
            if claims and self._claim(mine):
                self._execute(mine)
                continue
            with self.cv:   # (a task's end, here or on another thread, wakes this)
                self.waiters += 1
                try:
                    if task.state == TASK_DONE or (claims and self._claimable(self._runnable_for(task, through))):
                        continue
                    if until >= 0 and eng_now() >= until:
                        return False
                    left = -1 if until < 0 else max(until - eng_now(), 0)
                    if self.cb_thread and not through:   # (held by callbacks on another thread: see _stalled)
                        stall = max(self.cb_since, start) + self.stall_seconds - eng_now()
                        if stall <= 0:
                            raise self._stalled(task)
                        left = stall if left < 0 else min(left, stall)
                    self.cv.wait(None if left < 0 else left)
                finally:
                    self.waiters -= 1
        return True

    def _stalled(self, Task task):
        """What a waiter raises once the done callbacks of the task before its own have run for the
        group's timeout: they hold the group's order (what they issue runs next), so one that waits
        for a collective another thread issues on this group waits for ever."""
        return EngineTimeout(f"{task.name}: Timed out after {self.stall_seconds:g} s waiting behind the done callbacks "
                             f"of {self.cb_of}, which still run: a collective a callback issues runs next, so a "
                             "callback that waits for one another thread issues on this group never returns; "
                             "issue it from the callback")

    cdef Task _runnable_for(self, Task task, bint through):
        """The task a waiter for task may run itself: task; through the queue (inside a task's
        callbacks), whatever is first in line."""
        return self.queue[0] if through and self.queue else task

    cdef bint _claimable(self, Task task):
        """Task is first in line and nothing runs (but the callbacks of the task before it, on this
        thread, which may run what they issue)."""
        return task.state == TASK_PENDING and self.queue and self.queue[0] is task and (
            not self.running or PyThread_get_thread_ident() == self.cb_thread)

    cdef bint _claim(self, Task task):
        """Takes task to run here if it is first in line and nothing runs (atomic under the GIL)."""
        if self._claimable(task):
            self.queue.popleft()
            self.pending -= 1
            task.state = TASK_RUNNING
            task.nested = self.running
            self.running = True
            self.current = task     # (from here: a fork before _execute starts must still find it)
            return True
        return False

    def add_done_callback(self, Task task, callback):
        """callback(task) runs once the task is done (at once if it already is). What it issues goes
        where it would have gone had it run now (see submit)."""
        if task.state != TASK_DONE:
            if task.callbacks is None:
                task.callbacks = []
            # (registered inside another callback: at that callback's place, not at what other threads
            # have queued meanwhile)
            task.callbacks.append((callback, self.cb_seq if PyThread_get_thread_ident() == self.cb_thread
                                   else self.submits))
            return
        callback(task)

    def close(self):
        """Runs what is queued, then stops the thread. Done callbacks that have held the group's order
        for its timeout (stall_seconds) are left running, said on stderr: one that waits for work
        queued behind it through a torch Future (which can't run what it waits for, as wait() here
        does) waits for ever, and the process's exit (_drain_at_exit) or the group's destroy with it."""
        self.closed = True
        self._signal()
        if threading.current_thread() is self.thread:
            return
        while self.thread.is_alive():
            self.thread.join(0.1)
            if self.cb_thread and eng_now() - self.cb_since >= self.stall_seconds and self.thread.is_alive():
                sys.stderr.write(f"engine: {self.thread.name}: the done callbacks of {self.cb_of} still run after "
                                 f"{eng_now() - self.cb_since:.0f} s (the group's timeout is {self.stall_seconds:g} "
                                 f"s), holding {len(self.queue)} queued operation(s) behind them: a callback that "
                                 "waits for one of those (through its torch Future) waits for ever. Left running; "
                                 "wait on the Work instead, or issue the operation from the callback\n")
                return

    def orphan(self, why):
        """In a child forked from this process (engine/forks.py), where this thread is not, and its locks
        may have been copied held: what was queued or running fails, and every later call is refused,
        with EngineError naming the fork."""
        pthread_mutex_init(&self.mtx, NULL)
        pthread_cond_init(&self.cond, NULL)
        self.cv = threading.Condition(threading.RLock())   # (re-entrant: abort() from a signal handler while this thread holds it)
        self.deep = self.waiters = 0
        if self.current is not None and self.current.state != TASK_DONE:
            self.queue.appendleft(self.current)   # (its thread is not here to end it: abort fails it)
            self.pending += 1
        self.current = None
        self.running = False
        self.cb_thread = 0
        self.abort(EngineError(f"{why}, and this process group came with the fork; {forks.ADVICE}"))

    def abort(self, error):
        """Fails every queued task with `error` at once (their waiters wake, their callbacks run) and
        refuses new ones with it. A task already running ends on its own (its group's waits were
        aborted first). Returns whether one still runs."""
        cdef Task task
        self.closed = True
        self.refusal = error
        failed = []
        while self.queue:
            task = self.queue.popleft()
            self.pending -= 1
            task.error = error
            task.state = TASK_DONE
            task.fn = task.args = None
            failed.append(task)
        with self.cv:
            self.cv.notify_all()
        self._signal()
        for task in failed:
            callbacks, task.callbacks = task.callbacks, None
            for cb, _ in callbacks or ():
                cb(task)
        return self.running

    @property
    def idle(self):
        """Nothing queued and nothing running."""
        return not self.running and not self.queue

    cdef void _wake(self):
        if self.waiters:
            with self.cv:
                self.cv.notify_all()

    cdef void _finished(self):
        self.running = False
        self._wake()
        if self.queue:
            self._signal()

    cdef _execute(self, Task task):
        cdef unsigned long outer
        cdef long long outer_seq
        callbacks = None   # (self.current is task since _claim)
        try:
            task.fn(*task.args)
        except BaseException as exc:  # delivered to whoever waits on the task
            task.error = exc
        self.current = None
        task.state = TASK_DONE
        task.fn = task.args = None
        callbacks, task.callbacks = task.callbacks, None
        try:
            if callbacks:
                # (the run slot stays held: the next task waits for them, and what they issue runs first)
                outer, self.cb_thread = self.cb_thread, PyThread_get_thread_ident()
                outer_seq = self.cb_seq
                if not outer:
                    self.cb_since, self.cb_of = eng_now(), task.name
                self._wake()   # (whoever waits for this task returns now)
                failed = None
                try:
                    for cb, self.cb_seq in callbacks:
                        try:
                            cb(task)
                        except BaseException as exc:   # (the others still run: one is a torch Future's)
                            if failed is None:
                                failed = exc
                finally:
                    self.cb_thread = outer
                    self.cb_seq = outer_seq
                if failed is not None:
                    raise failed
        finally:
            if task.nested:   # (the callbacks that ran it still hold the slot)
                self._wake()
            else:
                self._finished()

    cdef Task _take(self):
        """The head task if the thread may start it now: nothing runs, and its grace is over (a caller
        that waits at once runs it itself)."""
        cdef Task task
        if self.running or not self.queue:
            return None
        task = self.queue[0]
        if task.submitted + self.grace > eng_now() and not self.closed:
            return None
        self._claim(task)
        return task

    cdef void _idle(self) noexcept nogil:
        """Waits, without the GIL, until there is a task the thread may start: one queued, nothing
        running, and the newest past its grace (a caller who waits at once has run it by then). Polls
        while submits are recent, then sleeps until submit() signals. It takes the GIL only to start a
        task: a thread that woke for a task its caller then ran would make that caller wait for the GIL.
        Meanwhile it moves the driven channel's messages left in flight (kick()) once the caller has
        posted none for DRIVE_AFTER."""
        cdef double t, nap = DRIVE_NAP
        cdef unsigned int kicks
        cdef int busy
        while True:
            t = eng_now()
            if self.closed:
                if not self.running:
                    return
                eng_sleep(POLL)   # (aborted while a caller runs a task: the loop has nothing to do until it ends)
                continue
            if self.pending and not self.running and t - self.last_submit >= self.grace:
                return
            kicks = self.kicks   # (read first: a kick after it makes the next round drive again)
            if kicks != self.quiet_at:
                if t - self.last_kick < DRIVE_AFTER:
                    eng_sleep(min(self.last_kick + DRIVE_AFTER - t, POLL))
                    continue
                busy = self.driver(self.channel, nap)
                if not busy:
                    self.quiet_at = kicks
                nap = DRIVE_NAP if busy != 1 else min(2 * nap, DRIVE_SLEEP)
                continue
            if self.pending or t - self.last_submit < ACTIVE_WINDOW:
                eng_sleep(POLL)
                continue
            pthread_mutex_lock(&self.mtx)
            self.deep = 1
            if not (self.closed or self.pending or self.kicks != self.quiet_at):
                pthread_cond_wait(&self.cond, &self.mtx)
            self.deep = 0
            pthread_mutex_unlock(&self.mtx)

    def _loop(self):
        cdef Task task
        set_thread_polite(True)  # leave the core to the computation this thread overlaps with
        while True:
            task = self._take()
            if task is not None:
                try:
                    self._execute(task)
                except BaseException:   # (a done callback raised here: there is no caller to hand it to)
                    sys.stderr.write(f"engine: a done callback of {task.name} raised on the progress thread "
                                     f"(the group goes on):\n{traceback.format_exc()}")
                continue
            if self.closed and not self.queue and not self.running:
                return
            with nogil:
                self._idle()
