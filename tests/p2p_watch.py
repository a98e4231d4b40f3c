"""The point-to-point watch, and the receive loop, of the tests that drive one rank's transport in
process against a peer written by hand (tests/test_tcp_transport.py, tests/test_shm_queues.py)."""

import numpy as np

from engine.watch import EngineError, EngineTimeout


class Deadline:
    """A wait past `seconds` raises (a broken transport fails the test, not hangs it)."""

    def __init__(self, seconds=10.0):
        self.seconds = seconds

    def __call__(self, elapsed):
        pass

    def peer_timeout(self, what, peer, tag, elapsed):
        if elapsed > self.seconds:
            raise EngineTimeout(f"{what}: no result after {elapsed:.1f} s")

    def message_failed(self, exc):
        """A message's failure broke the group (engine.watch.Watch runs the abort hooks here): the
        error itself is what the test reads."""


def receive_until_it_ends(core, frames, nbytes, names, timeout_ends):
    """Receives from rank 1 into nbytes until what it sent ends: each receive ends whole, truncated, or
    in an error whose text holds `names`; the watch's timeout ends it only where timeout_ends (a
    message left half written). Never more messages than the `frames` sent."""
    out = np.zeros(nbytes, np.uint8)
    for _ in range(frames + 1):
        try:
            core.recv(out, 1, -1)
        except EngineTimeout:
            if timeout_ends:
                return
            raise
        except EngineError as exc:
            if "truncated" in str(exc):
                continue
            assert names in str(exc), exc
            return
    raise AssertionError(f"{frames + 1} messages from {frames} frames")
