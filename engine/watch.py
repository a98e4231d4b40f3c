"""Never hang silently. Each communicator has a Watch: the policy around the flight recorder that its
compiled core keeps (a preallocated C ring of the last operations, written without Python on every
call): stall warnings, timeouts that name the ranks that did not arrive, dumps, and an optional
Chrome-trace timeline.

Every wait of the engine's own (shared memory, the ring, recursive doubling, point-to-point) calls
the watch while it polls; at the timeout it raises EngineTimeout and the operation is abandoned. MPI's
blocking collectives (its reductions and allgather; engine._mpi's `blocks`) block inside MPI, where
nothing can interrupt them: a watchdog thread watches those and, at the timeout, reports, dumps the
flight recorder and aborts the job (as torch's NCCL watchdog tears a job down). Ranks name themselves
as arrived in a key-value store (torch's, for torch groups) once they have waited a second, with what
their call is; at the timeout the ranks without that note are the missing ones. A rank whose note shows
the same call number but another call (collective, dtype, reduce op or root; the count, where every
rank's must be the call's) ends the wait at once with EngineMismatch naming it and both calls, as does
the note of a rank whose call failed in a mismatch: whatever the transport, or MPI's own collectives,
failed to tell from their messages, a stalled mismatch is named within seconds, not at the timeout.
"""

import atexit
import contextlib
import errno
import faulthandler
import json
import os
import signal
import stat
import sys
import threading
import time
import weakref

from . import failure, forks
from ._core import (BROKEN_AFTER, REFUSALS, EngineAborted, EngineError, EngineMismatch, EnginePeerLost,
                    EngineTimeout, describe_call)
from .config import env_duration, env_int, seconds_given

__all__ = ["DEFAULT_TIMEOUT", "EngineAborted", "EngineError", "EngineMismatch", "EnginePeerLost", "EngineTimeout", "Watch"]

DEFAULT_TIMEOUT = 1800.0  # seconds, torch's default for CPU process groups
MAX_RECORDS = 1 << 20     # the most ENGINE_FLIGHT_RECORDER_SIZE keeps (each record holds a call's signature)
STORE_QUERY_SECONDS = 5.0  # the longest a timeout's report waits for the store to name the missing ranks

class _StoreLine:
    """The watch's queries to one store connection, run in order on one helper thread.

    torch's store client serves one request at a time per connection (its prefix stores share their
    base's) and gives its reads no timeout: across a cut link, or to a stopped host, a query blocks
    until the kernel gives the connection up, many minutes later, and every later query on that
    connection waits behind it. So a wait never asks the store itself: it hands the line a query and
    waits for the answer a bounded time. Once a query has gone unanswered for STORE_QUERY_SECONDS the
    line takes no more (each later report says so at once): one blocked thread per dead connection,
    not one per report, in a process that outlives its groups (a torchft replica). A line whose queue
    empties ends its thread and leaves the table, LINGER_SECONDS later (a making asks many queries in a
    row: one thread for them all), or at once at exit."""

    _lines = {}               # id(connection) -> its line, while it has work or is stuck
    _lock = threading.Lock()
    _closing = False          # (at exit: no line lingers)
    MAX_QUEUED = 64           # (a line stuck less than STORE_QUERY_SECONDS takes at most this many more)
    LINGER_SECONDS = 0.02     # (longer than the gaps between a making's queries: its steps take milliseconds)

    def __init__(self, conn):
        self.conn, self.queue, self.thread, self.since, self.released = conn, [], None, None, False
        self.more = threading.Condition(self._lock)

    @classmethod
    def release(cls, conn):
        """The asker of conn's line asks no more for now (a making is done): its thread lingers no longer."""
        with cls._lock:
            line = cls._lines.get(id(conn))
            if line is not None:
                line.released = True
                line.more.notify_all()

    @classmethod
    def orphan(cls, why):
        """In a child forked from this process: the lines' threads are not there, and the lock may have
        been copied held; the child's own groups start afresh."""
        cls._lines, cls._lock, cls._closing = {}, threading.Lock(), False

    @classmethod
    def ask(cls, store, query, wait, interrupted=None, owner=None):
        """query() on store's line (or on the line of `owner`, an object of the asker's: its queries are
        not held up by others'); waits up to `wait` s, or until interrupted() (asked every 50 ms: the
        group's abort) says so. Returns (True, its result) or (False, why): the store did not answer in
        time, its line is stuck, or the wait was interrupted. query's exceptions are its result."""
        own = owner is not None
        conn = owner if own else forks.base_store(store)
        done, out = threading.Event(), []
        with cls._lock:
            line = cls._lines.get(id(conn))
            if line is None:
                line = cls._lines[id(conn)] = cls(conn)
            since = line.since if line.since is not None else line.queue[0][3] if line.queue else None
            stuck = time.monotonic() - since if since is not None else 0.0
            if stuck >= STORE_QUERY_SECONDS or len(line.queue) >= cls.MAX_QUEUED:
                return False, (f"the store has not answered a query for {stuck:.0f} s (the rank hosting it, or the "
                               "link to it, may be gone)")
            line.queue.append((query, done, out, time.monotonic()))
            line.more.notify()
            if line.thread is None:
                line.thread = threading.Thread(target=line._serve, daemon=True,
                                               name="engine-store-within" if own else "engine-watch-store")
                try:
                    line.thread.start()
                except RuntimeError:   # (no new threads at interpreter shutdown: the error itself matters more)
                    del cls._lines[id(conn)]
                    return False, "the store could not be asked (the interpreter is shutting down)"
        end = time.monotonic() + wait
        while not done.wait(max(0.0, min(end - time.monotonic(), 0.05 if interrupted is not None else wait))):
            if time.monotonic() >= end:
                return False, (f"the store did not answer within {wait:g} s (the rank hosting it, or the link to it, "
                               "may be gone)")
            if interrupted():
                return False, "the wait for the store's answer was interrupted (the group was aborted)"
        return True, out[0]

    def _serve(self):
        while True:
            with self._lock:
                self.since = None
                if not self.queue and not self._closing and not self.released:
                    self.more.wait(self.LINGER_SECONDS)
                if not self.queue:
                    self.thread = None
                    del self._lines[id(self.conn)]
                    return
                # (the line is stuck from when the query was asked, which its asker's wait counts from)
                query, done, out, self.since = self.queue.pop(0)
            try:
                out.append(query())
            except Exception as exc:
                out.append(exc)
            done.set()

    @classmethod
    def join_all(cls, wait):
        """At exit: a query that returns after Python began finalizing aborts the process as its thread
        takes the GIL back (SIGABRT, "terminate called without an active exception"), so the exit waits
        for the lines' threads, for `wait` s in all: behind a cut link they stay blocked far longer."""
        deadline = time.monotonic() + wait
        with cls._lock:
            cls._closing = True
            for line in cls._lines.values():
                line.more.notify_all()
            threads = [line.thread for line in cls._lines.values() if line.thread is not None]
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0))


forks.track(_StoreLine)
atexit.register(_StoreLine.join_all, STORE_QUERY_SECONDS)


class _LineOfOne:
    """The object a StoreWithin's own line is known by."""


class StoreWithin:
    """A store whose every query ends by a deadline: `seconds` from now (a making's timeout), and
    STORE_QUERY_SECONDS more for the store to answer. A group's making, and a monitored barrier, ask
    their store through one, so that a rank cut off from the store's host raises then, naming the
    store, where torch's store client, which gives its reads no timeout, would block until the kernel
    gives the connection up. The queries run on a line of its own: a wait of the making (its store's
    wait for the others' keys) holds up no other thread's query. Its methods are the store's."""

    def __init__(self, store, seconds, what, line=None):
        self.underlying_store, self.what = store, what   # (forks.base_store reaches the connection through it)
        self.end = time.monotonic() + seconds
        self.line = _LineOfOne() if line is None else line   # (not itself: a cycle keeps the store to the collector)

    @classmethod
    def of(cls, store, seconds, what, line=None):
        """store, bounded by seconds from now (None or infinite: the store as it is, bounded by its own);
        what (or None): what its errors open with; line (an object of the asker's): where the queries of
        several steps (a bootstrap's exchanges) share one line."""
        if isinstance(store, cls):
            store = store.underlying_store
        if store is None or seconds is None or seconds == float("inf"):
            return store
        return cls(store, seconds, what, line)

    @classmethod
    @contextlib.contextmanager
    def bounded(cls, store, seconds, what):
        """of(store, seconds, what), for the queries of a with block: its line ends with the block."""
        within = cls.of(store, seconds, what)
        try:
            yield within
        finally:
            if isinstance(within, cls):
                cls.release(within.line)

    @staticmethod
    def release(line):
        """The queries asked on line (the object given to of() as its line) are done for now: the line's
        thread ends at once, not LINGER_SECONDS later (a group made leaves no thread behind)."""
        _StoreLine.release(line)

    def __getattr__(self, name):
        method = getattr(self.underlying_store, name)
        if name.startswith("_") or not callable(method):
            return method
        return lambda *args, **kwargs: self._ask(method, args, kwargs)

    def _ask(self, method, args, kwargs):
        ok, out = _StoreLine.ask(self.underlying_store, lambda: method(*args, **kwargs),
                                 max(self.end - time.monotonic(), 0.0) + STORE_QUERY_SECONDS, owner=self.line)
        if not ok:
            base = forks.base_store(self.underlying_store)
            where = f" (the store: {base.host} port {base.port})" if hasattr(base, "host") else ""
            raise ConnectionError(f"{self.what}: {out}{where}" if self.what else f"{out}{where}")
        if isinstance(out, Exception):
            raise out
        return out


# A record of the core's flight recorder: (seq, op, count, dtype, algorithm, start, end, state, native,
# key: what every rank's call must agree on, engine._core.describe_call's words).
SEQ, OP, COUNT, DTYPE, ALGO, START, END, STATE, NATIVE, KEY = range(10)

# Groups this large read their peers' notes from later on in a wait (each read asks the store once per
# peer, on every waiting rank), so a straggler costs the store, and the waits, little.
NOTES_READ_FREELY = 16

# The collectives whose count every rank passes alike (the others' may differ by design: uneven splits,
# a gather's parts), so the notes compare it.
SAME_COUNT = ("allreduce", "broadcast", "reduce")


class Watch:
    """The per-communicator policy: timeouts, stall warnings, arrival notes, dumps, the trace."""

    def __init__(self, group, rank, size, timeout=None, store=None, core=None, notes_id=""):
        """notes_id: what the group's ranks agreed on when they made it, so that the arrival notes of
        another group of the same name in the same store are never taken for this one's."""
        self.group, self.rank, self.size = group, rank, size
        self.notes_id = notes_id
        self.stall = env_duration("ENGINE_STALL_WARNING_SECONDS", 60.0)
        self.store = store
        self.core = core
        self.t0 = time.monotonic()
        self.trace = _Trace.get(rank)
        self._noted = (0, 0)  # (seq, level): 1 arrival noted in the store, 2 stall warned
        self._compare_at = 0.0  # when (seconds into the wait) to compare the notes next: doubling
        self._reported = None   # the last failure the watch raised itself (reported and dumped there)
        self._step = None       # the traced step waiting now (traced()), which no record names
        self._failure = None    # "seq error" of the last call that failed here in a mismatch, a lost peer or
                                # a refusal
        self.call_limit = None  # the running collective's own timeout (call_timeout()), else the group's
        self.on_break = None    # on_break(why), once, when a failure leaves the group unusable (the adapter's
                                # callback: torch's abort hooks run then, as torch's backends run them)
        self._on_break_lock = threading.Lock()
        self.break_parts = None  # break_parts(), with on_break: the stages and MPI communicators of the group
                                 # told (Communicator._break_parts)
        self.whole = None        # a stage's: the watch of the group it is a stage of, which its failures are
                                 # the failures of (a recovery of that group retires them: engine.failure)
        core.set_recorder(env_int("ENGINE_FLIGHT_RECORDER_SIZE", 256, minimum=1, maximum=MAX_RECORDS),
                          tracer=(lambda rec: self.trace.add(self.group, rec)) if self.trace else None,
                          on_failure=self._failed)
        self.set_timeout(timeout)
        _registry.add(self)

    def set_timeout(self, timeout):
        """The group's timeout from the waits' next poll on (None: ENGINE_TIMEOUT's, else torch's
        default); how often the waits call the watch follows it."""
        self.timeout = Watch.timeout_of(timeout)
        self.note_after, self.interval = Watch._pace(self.timeout)
        self.core.set_watch(self, self.interval, p2p=self)

    @contextlib.contextmanager
    def call_timeout(self, seconds):
        """The collectives run inside wait `seconds`, not the group's timeout (c10d's per-call
        options.timeout: dist.barrier(timeout=...)); point-to-point waits keep the group's."""
        self.call_limit = seconds = seconds_given(seconds, "a call's timeout")
        self.note_after, self.interval = (min(mine, call) for mine, call in zip(Watch._pace(self.timeout),
                                                                                Watch._pace(seconds)))
        self.core.set_watch(self, self.interval, p2p=self)
        try:
            yield
        finally:   # (the group's pace, of its timeout now: a set_timeout() meanwhile keeps its own)
            self.call_limit = None
            self.note_after, self.interval = Watch._pace(self.timeout)
            self.core.set_watch(self, self.interval, p2p=self)

    def close(self):
        """Its group was freed: the watchdog no longer looks at it (its thread ends with the last group's,
        now, not when the collector finds this watch and its core, which hold each other), and the
        store goes (torch's: its sockets and rank 0's server thread)."""
        self.store = None
        _registry.discard(self)

    @staticmethod
    def _pace(timeout):
        """(when a wait notes its arrival in the store, how often the waits call the watch) for a timeout."""
        return min(1.0, timeout / 4), max(0.05, min(0.5, timeout / 10))

    @property
    def limit(self):
        """What the running collective may wait: its own timeout (call_timeout()), else the group's."""
        return self.timeout if self.call_limit is None else self.call_limit

    @staticmethod
    def timeout_of(timeout):
        """A group's timeout in seconds: the one given, else ENGINE_TIMEOUT, else torch's default. A
        negative one, 0 or NaN is refused, as ENGINE_TIMEOUT's (NaN never timed out; a negative one or 0
        timed out at once)."""
        if timeout is None:
            return env_duration("ENGINE_TIMEOUT", DEFAULT_TIMEOUT, positive=True)
        return seconds_given(timeout, "a group's timeout", positive=True)

    @property
    def broken(self):
        return self.core.broken

    @property
    def broken_after(self):
        return self.core.broken_after

    # -- while waiting --

    def __call__(self, elapsed):
        """Called by the core's waits every `interval` s; raises EngineTimeout at the timeout."""
        rec = self.core.current()
        limit = self.limit
        if rec is None:
            if self._step is not None and elapsed >= limit:   # (a traced step: recorded by no core)
                raise self._break(f"{self._step} of group {self.group!r} (rank {self.rank} of {self.size}): Timed out "
                                  f"after {elapsed:.1f} s (timeout {limit:g} s): some rank never reached "
                                  "this call (debug mode compares every rank's call first: ENGINE_DEBUG, "
                                  "TORCH_DISTRIBUTED_DEBUG=DETAIL)", EngineTimeout)
            return
        self.check(rec, elapsed)
        if elapsed >= limit:
            raise self.timed_out(rec, elapsed, limit)

    def _store_bound(self, limit=None, before=None):
        """How long a query of the store may hold a wait: a quarter of its timeout, 1-5 s; one made
        `before` s into the wait, no later than the timeout (whose report then waits its own bound)."""
        limit = self.limit if limit is None else limit
        most = min(STORE_QUERY_SECONDS, max(1.0, limit / 4))
        return most if before is None else min(most, max(0.05, limit - before))

    def check(self, rec, elapsed):
        seq, level = self._noted
        if seq != rec[SEQ]:
            level, self._compare_at = 0, self.note_after * 2 * max(1, self.size / NOTES_READ_FREELY)
        if level < 1 and elapsed >= self.note_after:
            level = 1
            self.note_arrival(rec)
        self._noted = (rec[SEQ], level)
        if level >= 1 and elapsed >= self._compare_at and self.store is not None:
            # at 2, 4, 8... s: a wait that lasts for good reason costs the store a few reads, not one a second
            self._compare_at = elapsed * 2
            other = self.other_call(self.notes(rec, self._store_bound(before=elapsed)), rec)
            if other is not None:
                raise self._break(*other)
        if level < 2 and elapsed >= self.stall:
            self._noted = (rec[SEQ], 2)
            missing = self.missing(rec, self._store_bound(before=elapsed))
            print(f"engine: WARNING rank {self.rank} has waited {elapsed:.0f} s in {rec[OP]} #{rec[SEQ]} of group "
                  f"{self.group!r}; {self.describe_missing(missing)} (timeout in {self.limit - elapsed:.0f} s)"
                  f"{self.core.stage_note or ''}",
                  file=sys.stderr, flush=True)

    def timed_out(self, rec, elapsed, limit):
        # (a store whose host is stopped holds the report past the timeout at most a quarter of it longer)
        missing = self.missing(rec, self._store_bound(limit))
        waits = self.core.waiting_on()
        msg = (f"{rec[OP]} #{rec[SEQ]} of group {self.group!r} (rank {self.rank} of {self.size}): Timed out after "
               f"{elapsed:.1f} s (timeout {limit:g} s): {self.describe_missing(missing)}"
               + (f"; {waits}" if waits else ""))
        return self._break(msg, EngineTimeout)

    def mismatch(self, msg, between=False):
        """between: the ranks' calls differ before any ran (debug mode's check): every call begun here has
        ended, so a peer still in one finishes it (CoreComm.set_broken)."""
        return self._break(msg, EngineMismatch, between)

    def _break(self, msg, error, between=False):
        msg += self.core.stage_note or ""   # (a stage's error names its own ranks: say which they are)
        self.core.set_broken(msg, BROKEN_AFTER[error], between=between)
        failure.group_failed(msg, self.whole or self)
        self.dump(msg)
        self._reported = msg
        self._broke()
        return error(msg)

    def _broke(self):
        """The group is broken: on_break(why), once, whichever thread sees it first (before an abort of
        the job, where a call blocked inside MPI must end it)."""
        with self._on_break_lock:
            on_break, self.on_break = self.on_break, None
            break_parts, self.break_parts = self.break_parts, None
        break_parts = break_parts() if break_parts is not None else None   # (a weak reference: the group may be gone)
        if break_parts is not None:
            break_parts()
        if on_break is not None:
            on_break(self.core.broken)

    def _failed(self, rec, exc):
        if isinstance(exc, (EngineTimeout, EnginePeerLost, EngineMismatch)) and self.core.broken is None:
            # (where a stage of a hierarchy failed, the stage is broken: so is the group it serves)
            self.core.set_broken(str(exc), BROKEN_AFTER[type(exc)], getattr(exc, "lost", -1))
        elif self.core.broken is None and not isinstance(exc, (*REFUSALS, EngineAborted)):
            # Anything else out of a running collective (a KeyboardInterrupt, a hook's error) left its steps
            # half done here: the peers' steps, still in it, would pair with this rank's next call's. It
            # is the group's failure: under MPI, where no word of it reaches the peers, the job ends at
            # this rank's exit (they would wait their timeout, this rank in MPI_Finalize).
            midway = (f"{rec[OP]} #{rec[SEQ]} of group {self.group!r} (rank {self.rank} of {self.size}) ended midway: "
                      f"{failure.describe(exc)}")
            self.core.set_broken(midway, "a call that ended midway")
            failure.group_failed(midway, self.whole or self)
        # Timeouts and debug-mode mismatches were dumped where they were raised; bad arguments need none.
        if str(exc) == self._reported:
            return
        if isinstance(exc, (EngineMismatch, EnginePeerLost, *REFUSALS)) and self.store is not None:
            # peers still waiting in this call (a refused call's peers went ahead: _refused, counts.pxi) compare
            # this rank's note with theirs. It is written before the error leaves: torch's store client
            # serves one request at a time, and the rank's next blocking one (the next group's opening,
            # waiting on a rank still in this call) would hold the note back until that rank's timeout.
            # Later notes carry it (_failure), for peers that look after this rank went on. A lost peer's
            # note ends the wait of a peer whose own wait was on a live rank that gave up (inside MPI, a
            # revoke may leave a posted send pending); the store may be across the loss, so it waits less.
            lost = isinstance(exc, EnginePeerLost)
            self._failure = f"{rec[SEQ]} {exc}" if isinstance(exc, EngineMismatch) else \
                f"{rec[SEQ]} {'EnginePeerLost' if lost else type(exc).__name__}: {exc}"
            self.note_arrival(rec, wait=1.0 if lost else STORE_QUERY_SECONDS)
        if not isinstance(exc, (*REFUSALS, EngineTimeout, EngineAborted)):
            self.dump(f"{rec[OP]} #{rec[SEQ]} failed: {exc}")
        self._broken_by(exc)

    def _broken_by(self, exc):
        """What a failed operation, collective or message, leaves: a lost peer or a mismatch ends the job
        at exit under MPI; where the group is broken (those, a corrupt frame), the abort hooks run."""
        if isinstance(exc, (EnginePeerLost, EngineMismatch)):
            failure.group_failed(str(exc), self.whole or self)
        if self.core.broken is not None:
            self._broke()

    message_failed = _broken_by   # (the core calls it for a message whose failure broke the group)

    def peer_timeout(self, what, peer, tag, elapsed):
        """Called while a point-to-point wait polls: raises EngineTimeout naming the peer at the timeout."""
        if elapsed >= self.timeout:
            who = "any rank" if peer in (None, -1) else f"rank {peer}"
            tag_text = "any tag" if tag == -1 else f"tag {tag}"
            msg = (f"{what} {'from' if 'recv' in what else 'to'} {who} ({tag_text}) in group {self.group!r} "
                   f"(rank {self.rank} of {self.size}): Timed out after {elapsed:.1f} s (timeout "
                   f"{self.timeout:g} s): " + (f"nothing came from {who} for it (it did not send it, or the link to "
                                               "it is cut)" if 'recv' in what else
                                               f"{who} did not take it (it did not post the receive, or the link to "
                                               "it is cut)"))
            self.dump(msg)  # the group stays usable: only this wait is abandoned
            raise EngineTimeout(msg)

    @contextlib.contextmanager
    def traced(self, name, count=None, dtype=None):
        """A Python-side step (the debug-mode signature check) on the trace, not numbered; its waits end
        at the group's timeout, as a call's do."""
        start = time.monotonic()
        state = "failed"
        self._step = f"{name} #{self.core.seq + 1}"
        try:
            yield
            state = "done"
        finally:
            self._step = None
            if self.trace is not None:
                self.trace.add(self.group, (self.core.seq + 1, name, count, dtype, None, start, time.monotonic(),
                                            state, False))

    # -- who arrived --

    def _key(self, rank):
        return f"engine/{self.group}/{self.notes_id}/waiting-at/{rank}"

    def note_arrival(self, rec, wait=0.0):
        """Notes in the store that this rank reached operation rec's seq, and what it called there
        (written only once a wait stalls, or a call failed in a mismatch or was refused), on the store's
        line: the caller waits for it at most `wait` s."""
        store = self.store
        if store is not None:
            note = self._note(rec)
            _StoreLine.ask(store, lambda: self._set_note(store, note), wait)

    def _note(self, rec):
        """'seq key count words', and on a line of its own the last call that failed here in a mismatch,
        or was refused: 'its seq, its error'."""
        return f"{rec[SEQ]} {rec[KEY]} {rec[COUNT]} {describe_call(rec[KEY], rec[COUNT])}" + \
            (f"\n{self._failure}" if self._failure else "")

    def _set_note(self, store, note):
        try:
            store.set(self._key(self.rank), note)
        except Exception:  # a store problem must not hide the real one
            pass

    def notes(self, rec, most=None):
        """{rank: (seq, key, count, words, its error or "")} of the other ranks' notes (a rank without one:
        absent); None without a store; a str when the store failed. The store is asked on its line for at
        most `most` s: a store across a cut link would otherwise hold the timeout's report for its own
        timeout (None: STORE_QUERY_SECONDS)."""
        store = self.store
        if store is None:
            return None
        note = self._note(rec)

        def read():
            self._set_note(store, note)
            got = {}
            for r in range(self.size):
                key = self._key(r)
                if r != self.rank and store.check([key]):
                    text = store.get(key)
                    try:
                        seq, call, count, words = (text.decode() if isinstance(text, bytes) else text).split(" ", 3)
                        words, _, failed = words.partition("\n")
                        failed = (int(failed.partition(" ")[0]), failed.partition(" ")[2]) if failed else (0, "")
                        got[r] = (int(seq), int(call), int(count), words, failed)
                    except ValueError:   # not a note this engine writes: as good as none
                        pass
            return got
        answered, got = _StoreLine.ask(store, read, STORE_QUERY_SECONDS if most is None else most,
                                       lambda: self.core.aborted)
        if not answered:
            return got
        if isinstance(got, Exception):
            return (f"the store could not be read ({type(got).__name__}: {got}; the rank hosting it may "
                    "have exited)")
        return got

    def missing(self, rec, most=None):
        """Ranks with no note of reaching rec's seq; None without a store; a str when the store failed
        (or did not answer within `most` s). A rank writes its note only once it stalls: one that did
        its part at once and went on (or left the group) has none, and is not named where the transport
        knows it passed (core.passed())."""
        notes = self.notes(rec, most)
        if notes is None or isinstance(notes, str):
            return notes
        passed = set(self.core.passed())
        return [r for r in range(self.size) if r != self.rank and r not in passed
                and (r not in notes or notes[r][0] < rec[SEQ])]

    def other_call(self, notes, rec):
        """(the error's text, its class) if a rank's note shows it in call rec's seq with another call, or
        failed there (EnginePeerLost where a peer was lost there, else EngineMismatch), else None."""
        if not isinstance(notes, dict):
            return None
        head = f"{rec[OP]} #{rec[SEQ]} of group {self.group!r} (rank {self.rank} of {self.size}): "
        for r, (seq, call, count, theirs, (failed_seq, failed)) in sorted(notes.items()):
            if failed_seq == rec[SEQ]:
                return (f"{head}rank {r} failed this call: {failed} (seen from its note in the store)",
                        EnginePeerLost if failed.startswith("EnginePeerLost: ") else EngineMismatch)
        for r, (seq, call, count, theirs, failed) in sorted(notes.items()):
            if seq == rec[SEQ] and (call != rec[KEY] or (rec[OP] in SAME_COUNT and count != rec[COUNT])):
                return (f"{head}collective mismatch: rank {self.rank} called {describe_call(rec[KEY], rec[COUNT])}; "
                        f"rank {r} called {theirs} (both waited, seen from their notes in the store)", EngineMismatch)
        return None

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
        recs = self.core.records()
        lines = [f"engine: flight recorder of group {self.group!r}, rank {self.rank} of {self.size}: {reason}",
                 f"engine:   last {len(recs)} operations (seq, op, count, dtype, algorithm, start, duration, state)"]
        for rec in recs:
            dur = f"{(rec[END] - rec[START]) * 1e3:10.3f} ms" if rec[END] is not None else \
                f"{'running':>10} {time.monotonic() - rec[START]:.1f}s"
            lines.append(f"engine:   #{rec[SEQ]:<6} {rec[OP]:<16} {rec[COUNT]!s:>12} {rec[DTYPE]!s:<9} "
                         f"{rec[ALGO] or '-':<8} start {rec[START] - self.t0:10.4f}s {dur} {rec[STATE]}")
        print("\n".join(lines), file=out, flush=True)
        if self.trace is not None:
            self.trace.write()


class _Registry:
    """Every live Watch, for the watchdog thread and the dump signal."""

    def __init__(self):
        self.watches = weakref.WeakSet()
        self.lock = threading.Lock()
        self.thread = None
        self.gone = threading.Event()   # set when a watch is discarded: the thread may be the last one's
        forks.track(self)

    def orphan(self, why):
        """In a child forked from this process: the thread is not there, and the lock may have been copied
        held; the child's own groups start them again."""
        self.lock, self.thread, self.gone = threading.Lock(), None, threading.Event()

    def add(self, watch):
        with self.lock:
            # (A watch collected without close() leaves the WeakSet by itself; the thread sees that within
            # its 0.25 s. A finalizer that woke it by gone.set() deadlocked: the collector can run it on
            # the thread inside gone.wait(), which holds the lock set() takes, and close() then waited on it.)
            self.watches.add(watch)
            if self.thread is None:
                self.thread = threading.Thread(target=self._watchdog, name="engine-watchdog", daemon=True)
                self.thread.start()
                _install_dump_signal()

    def discard(self, watch):
        with self.lock:
            self.watches.discard(watch)
            last = self.thread if not self.watches else None
        self.gone.set()
        if last is not None and last is not threading.current_thread():
            last.join(1.0)   # (the last group's end leaves no thread: it ends now, not soon after)

    def snapshot(self):
        """The live watches, as a list. list() of the WeakSet raises when another thread's add() changes
        it meanwhile (it killed the watchdog, which add() then never started again, so MPI's blocking
        calls had no timeout); the lock is not taken, since the dump signal's handler runs on a thread
        that may hold it."""
        while True:
            try:
                return list(self.watches)
            except RuntimeError:   # (changed size during iteration: read it again)
                continue

    def _watchdog(self):
        # MPI's blocking collectives block in MPI: here they get their stall warning and, at the timeout, the end.
        # The thread ends with the last group (destroy_process_group leaves no thread behind); the next one
        # starts it again.
        while True:
            if self.gone.wait(0.25):
                self.gone.clear()
            with self.lock:
                if not self.watches:
                    self.thread = None
                    return
            self._check_native()

    def _check_native(self):
        # (A frame of its own: a loop variable left in the thread's frame would keep the last group it saw,
        # its segment, sockets and store, alive after the group is destroyed.)
        for watch in self.snapshot():
            if getattr(watch.core, "released", False):   # (freed while a call was inside: the last call out
                watch.close()                            # freed its transports; free() could not close it)
                continue
            rec = watch.core.current()
            if rec is None or not rec[NATIVE]:
                continue
            elapsed = time.monotonic() - rec[START]
            try:
                watch.check(rec, elapsed)
                err = watch.timed_out(rec, elapsed, watch.limit) if elapsed >= watch.limit else None
            except EngineMismatch as exc:
                err = exc
            if err is not None:
                failure.abort(3, f"engine: {err}; the call is blocked inside MPI and cannot be interrupted: "
                                 "aborting the job")


_registry = _Registry()


def catches(signum, pid="self"):
    """Whether process `pid` catches `signum` by a handler of its own, its SigCgt mask in /proc (False
    where there is none, or the process is gone). For this process it sees handlers Python's signal
    module doesn't know of too: faulthandler's, a C library's. (tests/mpirun.py asks it of the ranks.)"""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def _install_dump_signal():
    """SIGUSR1 prints every thread's stack and dumps every flight recorder to stderr (only if the program
    has not claimed SIGUSR1, in Python or below it). The stacks come from faulthandler's C handler, at
    once, even while a thread waits where Python's handlers can't run (another library's wait,
    MPI_Finalize); it then passes the signal on to Python's handler, which dumps the recorders once the
    main thread runs Python again."""
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(sig) in (signal.SIG_DFL, None) and not catches(sig):
            signal.signal(sig, lambda *_: [watch.dump("SIGUSR1") for watch in _registry.snapshot()])
            faulthandler.register(sig, file=2, all_threads=True, chain=True)
    except (ValueError, OSError, RuntimeError):
        pass


def _own_file(path):
    """path opened for writing, emptied, and readable by this user only: a link there is not followed,
    and a file another user made there (in a shared folder such as /tmp), or anything but a plain file
    (a FIFO would block the open), is refused, not written into."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(13, "Permission denied: not a plain file")
        if st.st_uid != os.geteuid():
            raise PermissionError(13, "Permission denied: another user owns this file")
        os.fchmod(fd, 0o600)   # (one made before keeps its mode otherwise)
        os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "w")
    except BaseException:
        os.close(fd)
        raise


class _Trace:
    """ENGINE_TRACE=<file>: a Chrome-trace (Perfetto) timeline of every collective; one file per rank
    (`{rank}` in the name is replaced, else `.rank<r>` is added before the extension)."""

    _instance = None

    @classmethod
    def get(cls, rank):
        path = os.environ.get("ENGINE_TRACE")
        if not path:
            return None
        if cls._instance is None:
            cls._instance = cls(path, rank)
        return cls._instance

    def __init__(self, path, rank):
        if "{rank}" in path:
            path = path.replace("{rank}", str(rank))
        else:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{rank}{ext or '.json'}"
        try:   # (here, not at exit, where the whole run's timeline would be lost)
            _own_file(path).close()
        except OSError as exc:
            why = {errno.ELOOP: "a symbolic link, not followed",   # (ENXIO: a FIFO no process reads)
                   errno.ENXIO: "not a plain file"}.get(exc.errno, exc.strerror)
            raise ValueError(f"ENGINE_TRACE={os.environ.get('ENGINE_TRACE')!r}: can't write this rank's trace "
                             f"{path!r} ({why})") from None
        self.path, self.rank = path, rank
        self.events = []
        self.epoch = time.monotonic()
        forks.at_exit(self.write)

    def add(self, group, rec):
        end = rec[END] if rec[END] is not None else time.monotonic()
        self.events.append({"name": rec[OP], "cat": group, "ph": "X", "pid": self.rank, "tid": group,
                            "ts": (rec[START] - self.epoch) * 1e6, "dur": (end - rec[START]) * 1e6,
                            "args": {"seq": rec[SEQ], "count": rec[COUNT], "dtype": rec[DTYPE],
                                     "algorithm": rec[ALGO], "state": rec[STATE]}})

    def write(self):
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        with _own_file(self.path) as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
