"""The progress engine (engine.progress, pyx/progress.pyx) on its own: issue order, and callbacks that
run on its thread and wait there for work queued behind them."""

import threading

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
