"""Never hang silently. Each communicator has a Watch: operation sequence numbers, a flight recorder
of the last operations, stall warnings, timeouts that name the ranks that did not arrive, and an
optional Chrome-trace timeline.

Engine-owned waits (the ring, recursive doubling, point-to-point) call the watch while they poll; at
the timeout it raises EngineTimeout and the operation is abandoned. Native MPI collectives block
inside MPI, where nothing can interrupt them: a watchdog thread watches those and, at the timeout,
reports, dumps the flight recorder and aborts the job (as torch's NCCL watchdog tears a job down).
Ranks name themselves as arrived in a key-value store (torch's, for torch groups) once they have
waited a second; at the timeout the ranks without that note are the missing ones.
"""

import atexit
import collections
import json
import os
import signal
import sys
import threading
import time
import weakref

from ._core import EngineError
from .config import env_int

DEFAULT_TIMEOUT = 1800.0  # seconds, torch's default for CPU process groups


class EngineTimeout(EngineError):
    """An operation did not complete within the group's timeout; the communicator is unusable after it."""


class EngineMismatch(EngineError):
    """Ranks called different collectives (or with different arguments) at the same point."""


class Record:
    """One operation in the flight recorder."""

    __slots__ = ("seq", "op", "count", "dtype", "algorithm", "start", "end", "state", "native", "noted")

    def __init__(self, seq, op, count, dtype, algorithm, native):
        self.seq, self.op, self.count, self.dtype, self.algorithm, self.native = seq, op, count, dtype, algorithm, native
        self.start = time.monotonic()
        self.end = None
        self.state = "running"
        self.noted = 0  # 1: arrival noted in the store, 2: stall warned

    def line(self, t0):
        dur = f"{(self.end - self.start) * 1e3:10.3f} ms" if self.end is not None else \
            f"{'running':>10} {time.monotonic() - self.start:.1f}s"
        return (f"#{self.seq:<6} {self.op:<16} {self.count!s:>12} {self.dtype!s:<9} {self.algorithm or '-':<8} "
                f"start {self.start - t0:10.4f}s {dur} {self.state}")


def _env_seconds(name, default):
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


class Watch:
    """The per-communicator state: sequence numbers, recorder, stall and timeout handling."""

    def __init__(self, group, rank, size, timeout=None, store=None):
        self.group, self.rank, self.size = group, rank, size
        self.timeout = timeout if timeout is not None else _env_seconds("ENGINE_TIMEOUT", DEFAULT_TIMEOUT)
        self.stall = _env_seconds("ENGINE_STALL_WARNING_SECONDS", 60.0)
        self.note_after = min(1.0, self.timeout / 4)
        self.interval = max(0.05, min(0.5, self.timeout / 10))
        self.store = store
        self.seq = 0
        self.current = None
        self.broken = None
        self.t0 = time.monotonic()
        self.recorder = collections.deque(maxlen=env_int("ENGINE_FLIGHT_RECORDER_SIZE", 256))
        self.trace = _Trace.get()
        _registry.add(self)

    # -- bracketing an operation --

    def begin(self, op, count=None, dtype=None, algorithm=None, native=False, numbered=True):
        """Records an operation; numbered ones advance the sequence (debug-mode checks share their op's)."""
        if self.broken:
            raise EngineError(f"{op}: group {self.group!r} is unusable after an earlier failure ({self.broken}); "
                              "destroy it and create a new one, or exit")
        if numbered:
            self.seq += 1
        rec = Record(self.seq if numbered else self.seq + 1, op, count, dtype, algorithm, native)
        self.recorder.append(rec)
        self.current = rec
        return rec

    def end(self, rec, error=None):
        rec.end = time.monotonic()
        rec.state = "done" if error is None else ("timed out" if isinstance(error, EngineTimeout) else "failed")
        self.current = None
        if self.trace is not None:
            self.trace.add(self, rec)
        if error is not None and not isinstance(error, (ValueError, TypeError, EngineTimeout, EngineMismatch)):
            self.dump(f"{rec.op} #{rec.seq} failed: {error}")  # timeouts and mismatches dumped already

    # -- while waiting --

    def __call__(self, elapsed):
        """Called by engine-owned waits every `interval` s; raises EngineTimeout at the timeout."""
        rec = self.current
        if rec is None:
            return
        self.check(rec, elapsed)
        if elapsed >= self.timeout:
            raise self.timed_out(rec, elapsed)

    def check(self, rec, elapsed):
        if rec.noted < 1 and elapsed >= self.note_after:
            rec.noted = 1
            self.note_arrival(rec)
        if rec.noted < 2 and elapsed >= self.stall:
            rec.noted = 2
            missing = self.missing(rec)
            print(f"engine: WARNING rank {self.rank} has waited {elapsed:.0f} s in {rec.op} #{rec.seq} of group "
                  f"{self.group!r}; {self.describe_missing(missing)} (timeout in {self.timeout - elapsed:.0f} s)",
                  file=sys.stderr, flush=True)

    def timed_out(self, rec, elapsed):
        missing = self.missing(rec)
        msg = (f"{rec.op} #{rec.seq} of group {self.group!r} (rank {self.rank} of {self.size}) timed out after "
               f"{elapsed:.1f} s (timeout {self.timeout:g} s): {self.describe_missing(missing)}")
        self.broken = msg
        self.dump(msg)
        return EngineTimeout(msg)

    def mismatch(self, msg):
        self.broken = msg
        self.dump(msg)
        return EngineMismatch(msg)

    def peer_hook(self, what, peer, tag):
        """The watch of one point-to-point wait: raises EngineTimeout naming the peer at the timeout."""
        def hook(elapsed):
            if elapsed >= self.timeout:
                who = "any rank" if peer in (None, -1) else f"rank {peer}"
                msg = (f"{what} {'from' if 'recv' in what else 'to'} {who} (tag {tag}) in group {self.group!r} "
                       f"(rank {self.rank} of {self.size}) timed out after {elapsed:.1f} s (timeout "
                       f"{self.timeout:g} s): {who} never {'sent' if 'recv' in what else 'received'} it")
                self.dump(msg)
                raise EngineTimeout(msg)
        return hook

    # -- who arrived --

    def _key(self, rank):
        return f"engine/{self.group}/waiting-at/{rank}"

    def note_arrival(self, rec):
        """Notes in the store that this rank reached operation rec.seq (written only once a wait stalls)."""
        if self.store is not None:
            try:
                self.store.set(self._key(self.rank), str(rec.seq))
            except Exception:  # a store problem must not hide the real one
                pass

    def missing(self, rec):
        """Ranks with no note of reaching rec.seq; None without a store; a str when the store failed."""
        if self.store is None:
            return None
        try:
            self.note_arrival(rec)
            late = []
            for r in range(self.size):
                if r == self.rank:
                    continue
                key = self._key(r)
                if not self.store.check([key]) or int(self.store.get(key)) < rec.seq:
                    late.append(r)
            return late
        except Exception as exc:
            return f"the store could not be read ({type(exc).__name__}: {exc}; the rank hosting it may have exited)"

    @staticmethod
    def describe_missing(missing):
        if missing is None:
            return "which ranks did not arrive is unknown (this communicator has no store to compare notes)"
        if isinstance(missing, str):
            return f"which ranks did not arrive is unknown: {missing}"
        if not missing:
            return "every rank arrived, yet the operation did not complete (a mismatched call or a lost peer?)"
        return f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive"

    # -- the flight recorder --

    def dump(self, reason, out=None):
        out = out or sys.stderr
        lines = [f"engine: flight recorder of group {self.group!r}, rank {self.rank} of {self.size}: {reason}",
                 f"engine:   last {len(self.recorder)} operations (seq, op, count, dtype, algorithm, start, duration, state)"]
        lines += [f"engine:   {r.line(self.t0)}" for r in self.recorder]
        print("\n".join(lines), file=out, flush=True)
        if self.trace is not None:
            self.trace.write()


class _Registry:
    """Every live Watch, for the watchdog thread and the dump signal."""

    def __init__(self):
        self.watches = weakref.WeakSet()
        self.lock = threading.Lock()
        self.thread = None

    def add(self, watch):
        with self.lock:
            self.watches.add(watch)
            if self.thread is None:
                self.thread = threading.Thread(target=self._watchdog, name="engine-watchdog", daemon=True)
                self.thread.start()
                _install_dump_signal()

    def _watchdog(self):
        # Native MPI collectives block in MPI: here they get their stall warning and, at the timeout, the end.
        while True:
            time.sleep(0.25)
            for watch in list(self.watches):
                rec = watch.current
                if rec is None or not rec.native or rec.end is not None:
                    continue
                elapsed = time.monotonic() - rec.start
                watch.check(rec, elapsed)
                if elapsed >= watch.timeout:
                    err = watch.timed_out(rec, elapsed)
                    print(f"engine: {err}; the call is blocked inside MPI and cannot be interrupted: "
                          "aborting the job", file=sys.stderr, flush=True)
                    from mpi4py import MPI
                    MPI.COMM_WORLD.Abort(3)

    def dump_all(self, reason):
        for watch in list(self.watches):
            watch.dump(reason)


_registry = _Registry()


def _install_dump_signal():
    """SIGUSR1 dumps every flight recorder to stderr (only if the program has not claimed SIGUSR1)."""
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, lambda *_: _registry.dump_all("SIGUSR1"))
    except (ValueError, OSError):
        pass


class _Trace:
    """ENGINE_TRACE=<file>: a Chrome-trace (Perfetto) timeline of every operation; one file per rank
    (`{rank}` in the name is replaced, else `.rank<r>` is added before the extension)."""

    _instance = None

    @classmethod
    def get(cls):
        path = os.environ.get("ENGINE_TRACE")
        if not path:
            return None
        if cls._instance is None:
            cls._instance = cls(path)
        return cls._instance

    def __init__(self, path):
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
        if "{rank}" in path:
            path = path.replace("{rank}", str(rank))
        else:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{rank}{ext or '.json'}"
        self.path, self.rank = path, rank
        self.events = []
        self.epoch = time.monotonic()
        atexit.register(self.write)

    def add(self, watch, rec):
        self.events.append({"name": rec.op, "cat": watch.group, "ph": "X", "pid": self.rank, "tid": watch.group,
                            "ts": (rec.start - self.epoch) * 1e6, "dur": (rec.end - rec.start) * 1e6,
                            "args": {"seq": rec.seq, "count": rec.count, "dtype": rec.dtype,
                                     "algorithm": rec.algorithm, "state": rec.state}})

    def write(self):
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        with open(self.path, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
