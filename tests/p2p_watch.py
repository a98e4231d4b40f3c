"""The point-to-point watch of the tests that drive one rank's transport in process against a peer
written by hand (tests/test_tcp_transport.py, tests/test_shm_queues.py)."""

from engine.watch import EngineTimeout


class Deadline:
    """A wait past `seconds` raises (a broken transport fails the test, not hangs it)."""

    def __init__(self, seconds=10.0):
        self.seconds = seconds

    def __call__(self, elapsed):
        pass

    def peer_timeout(self, what, peer, tag, elapsed):
        if elapsed > self.seconds:
            raise EngineTimeout(f"{what}: no result after {elapsed:.1f} s")
