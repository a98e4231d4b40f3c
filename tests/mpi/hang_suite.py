"""A suite whose one test waits for ever, beside a thread that waits too: tests/test_faults.py's check
that a launch past its timeout shows where each rank's threads waited (tests/mpirun.py: ask_for_stacks,
timed_out_report)."""

import threading
import time


def test_waits_for_ever():
    never = threading.Event()
    threading.Thread(target=never.wait, name="beside", daemon=True).start()
    time.sleep(3600)
