"""The progress engine (engine.progress, pyx/progress.pyx) on its own: issue order, and callbacks that
run on its thread and wait there for work queued behind them."""

import contextlib
import re
import threading
import time

from engine.progress import Progress


def test_a_callback_on_the_engines_thread_that_waits_for_queued_work_runs_it_in_order():
    """A task's done callbacks run on the engine's thread; one that submits a task and waits for it, or
    waits for a task queued earlier, gets it run there, in queue order (a torch Future's then(), as
    PowerSGD's hook chains its allreduces), instead of waiting for its own thread for ever."""
    progress = Progress(name="engine-progress-test")
    order, waited = [], threading.Event()
    try:
        gate = threading.Event()
        first = progress.submit(lambda: (gate.wait(10), order.append("first")), (), "first")
        queued = progress.submit(lambda: order.append("queued"), (), "queued")

        def callback(task):
            assert threading.current_thread().name == "engine-progress-test"
            progress.wait(queued)                   # queued before: run here
            assert queued.done
            inner = progress.submit(lambda: order.append("inner"), (), "inner")
            assert inner.done                       # submitted here: run here at once
            progress.wait(inner)
            order.append("callback")
            waited.set()

        progress.add_done_callback(first, callback)
        gate.set()
        assert waited.wait(10), f"the callback still waits: {order}"
        assert order == ["first", "queued", "inner", "callback"], order
        later = progress.submit(lambda: order.append("later"), (), "later")
        progress.wait(later)
        assert order[-1] == "later"
    finally:
        if waited.is_set():   # (else its thread is stuck in the callback: close() would join it for ever)
            progress.close()


def test_what_a_callback_issues_runs_before_what_was_queued_behind_its_task():
    """A task's done callbacks run before the next task starts, and what they issue runs at once, ahead
    of what another thread queued behind the task meanwhile (DDP's backward queues the next bucket's
    allreduce while PowerSGD's callback for the last one issues its own): every rank issues its
    collectives in one order, whether its callback ran early or late. Whoever waits for the task
    returns while its callbacks run. The same holds where the callbacks run on a caller's thread that
    ran the task itself, and a callback that raises does not hold the queue."""
    import pytest

    progress = Progress(name="engine-progress-order")
    order = []
    try:
        gate, in_callback, release = threading.Event(), threading.Event(), threading.Event()
        first = progress.submit(lambda: (gate.wait(10), order.append("first")), (), "first")

        def callback(task):
            in_callback.set()
            assert release.wait(10)
            issued = progress.submit(lambda: order.append("issued by the callback"), (), "issued")
            assert issued.done   # (run at once, here)
            order.append("callback")

        progress.add_done_callback(first, callback)
        second = progress.submit(lambda: order.append("second"), (), "second")   # queued behind first
        gate.set()
        assert in_callback.wait(10)
        assert progress.wait(first, 10)              # (returns while the callback runs)
        assert not progress.wait(second, 0.2)        # (waits for the callback)
        release.set()
        assert progress.wait(second, 10)
        assert order == ["first", "issued by the callback", "callback", "second"], order

        # the caller's thread runs the task it waits for (first in line), then its callbacks, there
        del order[:]
        progress.grace = 60.0   # (the engine's thread leaves it to the caller)
        mine = progress.submit(lambda: order.append("mine"), (), "mine")
        progress.add_done_callback(mine, lambda task: (
            order.append(threading.current_thread().name),
            progress.wait(progress.submit(lambda: order.append("issued by the callback"), (), "issued"))))
        progress.add_done_callback(mine, lambda task: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            progress.wait(mine)
        assert order == ["mine", threading.current_thread().name, "issued by the callback"], order
        after = progress.submit(lambda: order.append("after"), (), "after")
        assert progress.wait(after) and order[-1] == "after"   # (without a timeout: here)

        # on the engine's thread, a callback that raises is reported there, and the queue goes on
        progress.grace = 50e-6
        raising = progress.submit(lambda: order.append("raising"), (), "raising")
        progress.add_done_callback(raising, lambda task: 1 / 0)
        last = progress.submit(lambda: order.append("last"), (), "last")
        assert progress.wait(last, 10) and order[-2:] == ["raising", "last"], order
    finally:
        release.set()
        progress.close()


def test_what_a_callback_issues_keeps_the_place_its_registration_had_whether_it_ran_early_or_late():
    """Two tasks queued, then a callback registered on the first that issues a third: the third goes
    after the second on every rank, whether the first was still running when the callback was
    registered (it runs on the thread that ran the first, before the second starts) or already done
    (it runs at once, in the registering thread). It went ahead of the second in the first case and
    behind it in the second: two ranks that differed only in timing paired one's second collective
    with the other's third."""
    for late in (True, False):
        progress = Progress(name="engine-progress-place")
        order, gate, called = [], threading.Event(), threading.Event()
        try:
            first = progress.submit(lambda: (gate.wait(10), order.append("first")), (), "first")
            if not late:
                gate.set()
                assert progress.wait(first, 10)
            hold = threading.Event()
            second = progress.submit(lambda: (hold.wait(10), order.append("second")), (), "second")

            def callback(task):
                third = progress.submit(lambda: order.append("third"), (), "third")
                if late:
                    assert third.done   # (run here, through the second, ahead of it in line)
                called.set()

            if late:
                hold.set()
            progress.add_done_callback(first, callback)
            gate.set()
            hold.set()
            assert called.wait(10)
            assert progress.wait(second, 10)
            progress.wait(progress.submit(lambda: None, (), "last"), 10)
            assert order == ["first", "second", "third"], (late, order)

            # a callback registered by a callback takes the first's place, not what was queued since
            del order[:]
            gate.clear()
            hold.clear()
            first = progress.submit(lambda: (gate.wait(10), order.append("first")), (), "first")
            if not late:
                gate.set()
                assert progress.wait(first, 10)
            second = progress.submit(lambda: (hold.wait(10), order.append("second")), (), "second")
            progress.add_done_callback(first, lambda task: progress.add_done_callback(
                second, lambda task: progress.submit(lambda: order.append("third"), (), "third")))
            fourth = progress.submit(lambda: order.append("fourth"), (), "fourth")
            gate.set()
            hold.set()
            assert progress.wait(fourth, 10)
            assert order == ["first", "second", "third", "fourth"], (late, order)
        finally:
            gate.set()
            progress.close()


def test_a_wait_with_a_timeout_leaves_the_task_to_the_groups_thread_and_returns_at_the_timeout():
    """A caller that waits for a queued task without a timeout runs it itself; with one, it leaves the
    task to the group's thread: run here, a collective whose peer is late would hold the caller past
    its timeout (Work.wait(timeout) as Gloo's: it raises, the call goes on)."""
    progress = Progress(name="engine-progress-timeout")
    release, ran_on = threading.Event(), []
    try:
        task = progress.submit(lambda: (ran_on.append(threading.current_thread().name), release.wait(10)), (),
                               "allreduce")
        started = time.monotonic()
        assert not progress.wait(task, 0.2)
        assert time.monotonic() - started < 5.0
        release.set()
        assert progress.wait(task, 10) and ran_on == ["engine-progress-timeout"], ran_on
    finally:
        release.set()
        progress.close()


def test_a_caller_held_behind_a_callback_for_the_groups_timeout_fails_naming_it():
    """A done callback holds the group's order while it runs; one that waits for a collective another
    thread issues on the same group would wait for ever. That caller fails at the group's timeout
    (stall_seconds), naming the callbacks it waited behind, instead of hanging silently."""
    import pytest

    from engine._core import EngineTimeout

    progress = Progress(name="engine-progress-stall", stall_seconds=0.3)
    blocked, release = threading.Event(), threading.Event()
    try:
        first = progress.submit(lambda: None, (), "allreduce #1")
        progress.add_done_callback(first, lambda task: (blocked.set(), release.wait(10)))
        assert blocked.wait(10)
        with pytest.raises(EngineTimeout, match=r"allreduce #2: Timed out after 0.3 s waiting behind the done "
                                                r"callbacks of allreduce #1, which still run"):
            progress.run(lambda: None, nargs=0, name="allreduce #2")
        release.set()
        after = progress.submit(lambda: None, (), "allreduce #3")
        assert progress.wait(after, 10)
    finally:
        release.set()
        progress.close()


class Channel:
    """A channel as the progress thread sees it through drive(): a C function (ctypes) that says
    whether messages are still in flight, recording when it was called."""

    def __init__(self):
        import ctypes
        self.in_flight, self.calls, self.lock = 0, [], threading.Lock()
        self.fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_double)(self._drive)
        self.driver = (ctypes.cast(self.fn, ctypes.c_void_p).value, 0, self)

    def _drive(self, channel, seconds):
        import time
        with self.lock:
            self.calls.append(time.monotonic())
            busy = self.in_flight
        if busy:
            time.sleep(seconds)
        return busy


def may_have_gone(kicks, called):
    """Whether the thread may rightly have begun the drive recorded at `called`: it goes at some moment
    t <= called (the driver records its call later, once it has the GIL) that lies 1 ms or more after
    the kick it last saw, with the caller's next kick not yet seen. Kick i was seen somewhere between
    its (begun, returned) times, so a drive is right only if some kick begun 1 ms before `called` or
    earlier was followed by one that returned over 1 ms after it began, or by none: a caller the
    machine held (kicking or sleeping) past 1 ms. A drive in the middle of unbroken kicking is early."""
    for (begun, _), after in zip(kicks, kicks[1:] + [None]):
        if begun <= called - 1e-3 and (after is None or after[1] - begun > 1e-3):
            return True
    return False


def test_messages_left_in_flight_are_moved_once_the_caller_is_away():
    """kick(): the thread moves the channel only once the caller posted nothing for 1 ms, keeps at it
    while something is in flight, stops when nothing is, and runs a task submitted meanwhile first."""
    import time
    progress, channel = Progress(name="engine-progress-test"), Channel()
    try:
        progress.drive(channel.driver)
        time.sleep(0.05)
        assert channel.calls == []                       # nothing posted: never driven
        channel.in_flight = 1
        kicks, until = [], time.monotonic() + 0.05
        while time.monotonic() < until:                  # the caller still posting: left to it
            begun = time.monotonic()
            progress.kick()
            kicks.append((begun, time.monotonic()))
            time.sleep(0.0002)
        with channel.lock:
            early = [c for c in channel.calls if not may_have_gone(kicks, c)]
            channel.calls.clear()
        assert not early, (early, kicks)
        away = kicks[-1][0]
        deadline = away + 5
        while len(channel.calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(channel.calls) >= 3 and channel.calls[0] >= away   # moved again and again while in flight
        ran = threading.Event()
        task = progress.submit(ran.set, (), "task")      # a task waits for no message
        assert progress.wait(task, timeout=5) and ran.is_set()
        channel.in_flight = 0
        time.sleep(0.02)
        with channel.lock:
            seen = len(channel.calls)
        time.sleep(0.05)
        assert len(channel.calls) == seen                # nothing in flight: left alone
        progress.kick()
        deadline = time.monotonic() + 5
        while len(channel.calls) == seen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(channel.calls) == seen + 1            # a new kick: looked at once, found quiet
    finally:
        channel.in_flight = 1                            # (close() ends the thread however busy the channel)
        progress.close()


def test_the_error_an_aborted_engine_refuses_with_keeps_one_calls_traceback():
    """After abort(error), every submit raises that one error object (as does a broken group's stand-in,
    torchbridge.fault.Unavailable): its traceback is this call's, not every refused call's so far
    strung together (a retry loop grew it, and the memory it holds, without end)."""
    import traceback

    import pytest

    from torchbridge.fault import Unavailable
    progress = Progress(name="engine-progress-refusal")
    error = RuntimeError("the group was aborted")
    progress.abort(error)
    stand_in = Unavailable(RuntimeError("the group broke"), 0, 2)
    for call in (lambda: progress.submit(lambda: None, (), "op"), stand_in):
        depths = []
        for _ in range(50):
            with pytest.raises(RuntimeError) as caught:
                call()
            depths.append(len(traceback.extract_tb(caught.value.__traceback__)))
        assert depths[-1] == depths[0], depths[:3] + depths[-3:]
    progress.close()


@contextlib.contextmanager
def callers_progress(name):
    """A progress engine whose thread leaves every task to the caller that waits for it (a grace of a
    minute), closed after."""
    progress = Progress(name=name)
    progress.grace = 60.0
    try:
        yield progress
    finally:
        progress.grace = 50e-6
        progress.close()


def interrupted():
    """A call a ^C interrupts, in the caller's thread."""
    raise KeyboardInterrupt


def test_every_done_callback_runs_when_one_raises_and_a_future_takes_an_interrupt_as_an_error():
    """A task the caller runs itself, interrupted (KeyboardInterrupt, SystemExit from a signal handler):
    the caller gets the interrupt, every done callback still runs, and the Work's torch Future completes
    failed with a RuntimeError naming it (torch's Future takes an Exception only: its assertion ended
    the callbacks, and the future never completed)."""
    import pytest
    import torch  # noqa: F401  (torchbridge.work)

    from torchbridge.work import CollectiveWork
    with callers_progress("engine-progress-interrupt") as progress:
        task = progress.submit(interrupted, (), "allreduce")
        work = CollectiveWork.of(task)
        task.outputs = []
        fut = work.get_future()
        ran = []
        progress.add_done_callback(task, lambda t: ran.append("after"))
        with pytest.raises(KeyboardInterrupt):
            work.wait()
        assert ran == ["after"] and fut.done()
        with pytest.raises(RuntimeError, match=r"allreduce was interrupted \(KeyboardInterrupt\) before it completed"):
            fut.wait()


def test_closing_leaves_callbacks_stuck_behind_the_groups_order_after_its_timeout_rather_than_hang():
    """A done callback that waits, through a torch Future (which can't run it), for an operation queued
    behind its task waits for ever: that operation runs only once the callbacks return. The process's
    exit drains every group (close()), and hung with it; close() gives up on such callbacks once they
    held the order for the group's timeout, saying so. (In a process of its own: its stuck thread.)"""
    import subprocess
    import sys

    script = """
import threading, time
from engine.progress import Progress
progress = Progress(name="engine-progress-stuck", stall_seconds=1.0)
later_ran = threading.Event()
first = progress.submit(lambda: None, (), "allreduce #1")
later = progress.submit(later_ran.set, (), "allreduce #2")
progress.add_done_callback(first, lambda task: later_ran.wait())   # (as f2.wait() would)
time.sleep(0.3)
started = time.monotonic()
progress.close()
print(f"closed after {time.monotonic() - started:.1f} s", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "closed after" in proc.stdout, proc.stdout + proc.stderr
    assert float(proc.stdout.split("closed after ")[1].split()[0]) < 5
    assert re.search(r"engine: engine-progress-stuck: the done callbacks of allreduce #1 still run after \d+ s \(the "
                     r"group's timeout is 1 s\), holding 1 queued operation\(s\) behind them", proc.stderr), proc.stderr


def test_a_coalesced_calls_future_completes_failed_when_a_part_was_interrupted():
    """A coalesced call's Work (torchbridge.work.CoalescedWork) whose part the caller ran and a ^C
    interrupted: its future completes failed, with a RuntimeError naming the interrupt (it took the
    KeyboardInterrupt as given, torch's Future asserted inside the callback, and it never completed)."""
    import pytest
    import torch

    from torchbridge.work import CoalescedWork, CollectiveWork
    with callers_progress("engine-progress-coalesced") as progress:
        tasks = [progress.submit(lambda: None, (), "allreduce part 0"), progress.submit(interrupted, (), "allreduce part 1")]
        parts = []
        for task in tasks:
            task.outputs = [torch.zeros(1)]
            parts.append(CollectiveWork.of(task))
        work = CoalescedWork(parts, [t.outputs[0] for t in tasks])
        fut = work.get_future()
        parts[0].wait()
        with pytest.raises(KeyboardInterrupt):
            parts[1].wait()
        assert fut.done()
        with pytest.raises(RuntimeError, match=r"a part of a coalesced call was interrupted \(KeyboardInterrupt\)"):
            fut.wait()


def test_a_failed_works_error_raised_on_every_wait_keeps_the_traceback_it_first_had():
    """A failed Work waited on again and again (a loop retrying wait(), every queued call of an aborted
    group sharing the abort's error): each raise added the waiter's frames to the one stored error's
    traceback, which grew with every wait and kept every waiter's frames, and their tensors, alive."""
    import traceback

    import torch  # noqa: F401  (torchbridge.work)

    from torchbridge.work import CollectiveWork
    progress = Progress(name="engine-progress-again")
    try:
        def failing():
            raise ValueError("the call failed")
        task = progress.submit(failing, (), "allreduce")
        task.outputs = []
        work = CollectiveWork.of(task)
        depths = []
        for _ in range(5):
            try:
                work.wait()
            except ValueError as exc:
                depths.append(len(traceback.extract_tb(exc.__traceback__)))
        assert len(depths) == 5 and len(set(depths)) == 1, depths
        assert any(frame.name == "failing" for frame in traceback.extract_tb(task.error.__traceback__))
    finally:
        progress.close()
