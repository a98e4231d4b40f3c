"""The watch's arrival notes (engine/watch.py), in one process: what a waiting rank notes in the
group's store, when it reads its peers' notes, and which of them end its wait: in EngineMismatch (another
call, or a peer's call that failed in one), in EnginePeerLost (a peer's call that lost a rank). The rest of
this file: the watchdog that times the waits, and monitored barriers and makings whose store stops
answering. tests/test_faults.py runs the notes across processes
(test_mismatched_calls_raise_without_debug_mode)."""

import os
import re
import signal
import subprocess
import sys

import pytest

from engine._core import (DTYPE_NAMES, OP_KIND_NAMES, OP_NAMES, EngineMismatch, EnginePeerLost, EngineTimeout,
                          describe_call)
from engine.watch import Watch
from torchrun import clean_env


class Store:
    """torch's Store API as the watch uses it, counting the lookups."""

    def __init__(self):
        self.data, self.checks = {}, 0

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        self.checks += 1
        return all(k in self.data for k in keys)


class Core:
    """What a watch asks of a group's compiled core, with the record of the call it waits in."""

    def __init__(self):
        self.rec, self.broken, self.aborted = None, None, False
        self.past = []   # the peers the transport knows passed the call
        self.stage_note = None   # (not a stage of a hierarchy)

    def set_recorder(self, *args, **kwargs):
        pass

    def set_watch(self, *args, **kwargs):
        pass

    def current(self):
        return self.rec

    def records(self):
        return [self.rec] if self.rec else []

    def set_broken(self, why, after=None, lost=-1, between=False):
        self.broken, self.broken_after = why, after

    def waiting_on(self):
        return None

    def passed(self):
        return self.past


def key(op, dtype="float32", red=None, root=-1):
    """A call's key as recorder.pxi's call_key() builds it (engine._core.pxd call_word(): red, a reduce
    op's name, as its Rule.ops bit, AVG its own; root -1 for none)."""
    opbit = 9 if red is None else OP_NAMES.index(red)   # (OPBIT_NONE; "avg" is bit 7)
    return OP_KIND_NAMES.index(op) | (DTYPE_NAMES.index(dtype) + 1) << 8 | opbit << 16 | (root + 1) << 32


def record(seq, k, count=8):
    # (seq, op, count, dtype, algorithm, start, end, state, native, key), as the flight recorder gives it
    return (seq, OP_KIND_NAMES[k & 0xFF], count, "float32", "ring", 0.0, None, "running", False, k)


def watch(rank, size, store, notes_id="g1"):
    core = Core()
    return Watch("g", rank, size, timeout=60, store=store, core=core, notes_id=notes_id), core


ALLREDUCE_SUM, ALLREDUCE_MAX = key("allreduce", red="sum"), key("allreduce", red="max")
BROADCAST_0 = key("broadcast", root=0)


def test_a_peer_noted_in_another_call_of_the_same_number_ends_the_wait_naming_both_calls():
    store = Store()
    w0, core0 = watch(0, 3, store)
    w1, core1 = watch(1, 3, store)
    core1.rec = record(3, BROADCAST_0)
    w1.check(core1.rec, 1.2)                        # rank 1 waited 1 s: noted
    core0.rec = record(3, ALLREDUCE_SUM)
    w0.check(core0.rec, 1.5)                        # rank 0 noted, has not compared yet
    with pytest.raises(EngineMismatch) as err:
        w0.check(core0.rec, 2.1)
    assert ("allreduce #3 of group 'g' (rank 0 of 3): collective mismatch: rank 0 called allreduce of 8 float32, "
            "op SUM; rank 1 called broadcast of 8 float32, root 0") in str(err.value)
    assert core0.broken == str(err.value)


@pytest.mark.parametrize("op,ends", [("allreduce", True), ("broadcast", True), ("allgather", False),
                                     ("alltoall", False)])
def test_a_peer_noted_in_the_same_call_with_another_count_ends_the_wait_where_counts_must_agree(op, ends):
    """An allreduce, broadcast or reduce of 16 elements against one of 8 (MPI's own collectives tell
    nothing: the ranks wait on each other); an allgather's or alltoall's counts are each rank's own."""
    store = Store()
    w0, core0 = watch(0, 2, store)
    w1, core1 = watch(1, 2, store)
    core1.rec = record(3, key(op), count=16)
    w1.check(core1.rec, 1.2)
    core0.rec = record(3, key(op))
    w0.check(core0.rec, 1.5)
    if not ends:
        w0.check(core0.rec, 2.1)
        assert core0.broken is None
        return
    with pytest.raises(EngineMismatch, match=rf"{op} #3 of group 'g' \(rank 0 of 2\): collective mismatch: rank 0 "
                                             rf"called {op} of 8 float32; rank 1 called {op} of 16 float32"):
        w0.check(core0.rec, 2.1)


@pytest.mark.parametrize("failure,shown", [
    (EngineMismatch("allreduce failed: rank 2 sent a message of another size"), ""),
    (EnginePeerLost("allreduce failed: rank 3 (pid 77) exited"), "EnginePeerLost: ")])
def test_a_peer_whose_call_failed_in_a_mismatch_or_lost_a_rank_ends_the_wait_with_its_error(monkeypatch, failure,
                                                                                           shown):
    """Rank 1's allreduce failed, its note says so: it met a message longer than its receive, or it lost
    rank 3 (whose process exited) and gave the call up. Rank 0, waiting on it in the same call with the
    same count, ends at its next read of the notes, not at its timeout, naming rank 1 and its error, as
    the same error (inside MPI the revoke that should end rank 0's wait on a live rank may leave its
    posted send pending: the note ends it)."""
    from engine import failure as failures
    monkeypatch.setattr(failures, "_group_failure", [])   # (this process is no MPI job to end at exit)
    store = Store()
    w0, core0 = watch(0, 3, store)
    w1, core1 = watch(1, 3, store)
    core1.rec = record(3, ALLREDUCE_SUM)
    w1._failed(core1.rec, failure)
    core0.rec = record(3, ALLREDUCE_SUM)
    w0.check(core0.rec, 1.5)
    with pytest.raises(type(failure), match=re.escape(f"allreduce #3 of group 'g' (rank 0 of 3): rank 1 failed this "
                                                      f"call: {shown}{failure} (seen from its note in the store)")):
        w0.check(core0.rec, 2.1)
    after = {EngineMismatch: "a collective mismatch", EnginePeerLost: "a peer was lost"}
    assert core0.broken_after == after[type(failure)]


@pytest.mark.parametrize("moved_on", [False, True])
def test_a_peer_that_refused_the_call_ends_the_wait_with_its_error_even_once_it_went_on(monkeypatch, moved_on):
    """Rank 1's checks refused alltoall #3 (its own counts did not fill its buffer: CoreComm.refused
    counts and records it, with no dtype in its key); rank 0, which went ahead, ends at its next read
    of the notes naming rank 1 and its error, not a mismatch of calls, and not at its timeout; still
    so once rank 1 went on and noted its wait in call #4 (the note carries its last failure)."""
    from engine import failure
    monkeypatch.setattr(failure, "_group_failure", [])
    store = Store()
    w0, core0 = watch(0, 2, store)
    w1, core1 = watch(1, 2, store)
    refused = record(3, OP_KIND_NAMES.index("alltoall") | 9 << 16, count=0)
    w1._failed(refused, ValueError("alltoall: recv_counts add up to 25 but recvbuf has 24 elements"))
    assert core1.broken is None    # (bad arguments leave the group usable)
    if moved_on:
        core1.rec = record(4, key("alltoall"))
        w1.check(core1.rec, 1.2)
    core0.rec = record(3, key("alltoall"))
    w0.check(core0.rec, 1.5)
    with pytest.raises(EngineMismatch, match=r"alltoall #3 of group 'g' \(rank 0 of 2\): rank 1 failed this call: "
                                             r"ValueError: alltoall: recv_counts add up to 25 but recvbuf has 24 "
                                             r"elements \(seen from its note in the store\)"):
        w0.check(core0.rec, 2.1)


@pytest.mark.parametrize("theirs", ["same call", "earlier call", "later call", "other group", "garbage"])
def test_notes_that_show_no_other_call_leave_the_wait_alone(theirs):
    store = Store()
    w0, core0 = watch(0, 2, store)
    w1, core1 = watch(1, 2, store, notes_id="g2" if theirs == "other group" else "g1")
    seq = {"earlier call": 2, "later call": 4}.get(theirs, 3)
    core1.rec = record(seq, ALLREDUCE_SUM if theirs == "same call" else ALLREDUCE_MAX)
    if theirs == "garbage":                         # not a note this engine writes: as good as none
        store.set(w1._key(1), "5")
    else:
        w1.check(core1.rec, 1.2)
    core0.rec = record(3, ALLREDUCE_SUM)
    for elapsed in (1.2, 2.1, 4.5, 9.0):
        w0.check(core0.rec, elapsed)
    assert core0.broken is None


@pytest.mark.parametrize("size,reads", [(4, [2.0, 4.0, 8.0, 16.0, 32.0]), (64, [8.0, 16.0, 32.0])])
def test_reads_of_the_notes_double_in_spacing_and_start_later_in_large_groups(size, reads):
    store = Store()
    w, core = watch(0, size, store)
    core.rec = record(1, ALLREDUCE_SUM)
    read_at = []
    for step in range(1, 400):                      # a wait the watch is called in every 0.1 s, for 40 s
        before = store.checks
        w.check(core.rec, step / 10)
        if store.checks != before:
            read_at.append(step / 10)
    assert read_at == reads


def test_the_stall_warning_counts_down_to_the_calls_own_timeout(monkeypatch, capsys):
    """2 s into a call with its own 4 s timeout (dist.barrier(timeout=...)) in a group whose timeout is
    60 s, the stall warning says the timeout comes in 2 s (it said 58 s, the group's); a call without
    one counts down to the group's."""
    monkeypatch.setenv("ENGINE_STALL_WARNING_SECONDS", "2")
    w, core = watch(0, 2, Store())
    core.rec = record(1, ALLREDUCE_SUM)
    with w.call_timeout(4.0):
        w.check(core.rec, 2.1)
    assert "rank 1 did not arrive (timeout in 2 s)" in capsys.readouterr().err
    core.rec = record(2, ALLREDUCE_SUM)
    w.check(core.rec, 2.1)
    assert "rank 1 did not arrive (timeout in 58 s)" in capsys.readouterr().err


def test_a_rank_the_transport_knows_passed_the_call_is_not_named_as_not_arrived():
    """A rank notes its arrival only once it stalls: one that did its part at once and went on (a
    broadcast's receiver) or left the group has no note; where the transport knows it passed (the
    shared-memory flags, TCP's goodbye: core.passed()) the reports leave it out of who did not arrive."""
    w, core = watch(0, 3, Store())
    core.rec = record(1, ALLREDUCE_SUM)
    assert w.missing(core.rec) == [1, 2]
    core.past = [1]
    assert w.missing(core.rec) == [2]
    assert "rank 2 did not arrive" in str(w.timed_out(core.rec, 5.0, 5.0))


def test_a_set_timeout_during_a_calls_own_timeout_keeps_its_pace_after_it():
    """set_timeout(0.2) while a call with its own 5 s timeout waits: once the call is out, the waits
    poll and note as a 0.2 s timeout asks (the call's end put back the pace it found when it began, the
    60 s group's: a 0.2 s timeout was enforced up to half a second late)."""
    w, _ = watch(0, 2, Store())
    with w.call_timeout(5.0):
        w.set_timeout(0.2)
    assert (w.note_after, w.interval) == Watch._pace(0.2) == (0.05, 0.05)


def test_a_call_key_in_words():
    assert describe_call(key("reduce", red="avg", root=2), 5) == "reduce of 5 float32, op AVG, root 2"
    assert describe_call(key("allgather", "bfloat16"), 16) == "allgather of 16 bfloat16"


def test_a_rank_whose_call_fails_in_a_mismatch_has_noted_it_when_the_error_leaves(monkeypatch):
    """A peer still waiting in the call learns of the mismatch from this rank's note. torch's store
    client serves one request at a time per connection, and the rank's next request may block it
    (opening the next group, it waits for a key that the peer, still in this call, will not set
    until its timeout): the note is written before the error leaves the call, not after. Here another
    thread's wait holds the connection for 1 s when the call fails."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from engine import failure
    monkeypatch.setattr(failure, "_group_failure", [])   # (this process is no MPI job to end at exit)
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))
    store = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    w1, core1 = watch(1, 3, dist.PrefixStore("g", store))   # (keys "g/...")
    core1.rec = record(1, BROADCAST_0)
    holding = threading.Thread(target=lambda: pytest.raises(Exception, store.wait, ["never"],
                                                            datetime.timedelta(seconds=1)))
    holding.start()
    time.sleep(0.2)
    w1._failed(core1.rec, EngineMismatch("broadcast failed: rank 0 sent a message of another collective"))
    assert host.check(["g/" + w1._key(1)])           # (read over another connection: the peer's view)
    assert host.get("g/" + w1._key(1)).decode().startswith("1 ")
    assert core1.broken.startswith("broadcast failed")
    holding.join()


def test_a_store_that_stops_answering_holds_one_thread_the_reports_say_so_at_once_and_it_recovers(monkeypatch):
    """torch's store client gives its reads no timeout: a query to a host that stopped answering (here
    stopped by SIGSTOP, as across a cut link its connection stays open) blocks its thread for good, and
    every later query on the connection queues behind it. The watch's reports wait for it a bounded
    time, then say so at once, from one blocked thread per connection, whatever the groups and reports."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from engine import watch as watch_module
    monkeypatch.setattr(watch_module, "STORE_QUERY_SECONDS", 1.0)
    host = subprocess.Popen([sys.executable, "-c", HOST_A_STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        # two groups' stores over the one connection, as torch's PrefixStores share their base's
        wa, core_a = watch(0, 2, dist.PrefixStore("a/", base), notes_id="a")
        wb, core_b = watch(0, 2, dist.PrefixStore("b/", base), notes_id="b")
        core_a.rec = core_b.rec = record(1, ALLREDUCE_SUM)
        assert wa.missing(core_a.rec) == [1]
        stop(host.pid)
        start = time.monotonic()
        assert wa.missing(core_a.rec) == "the store did not answer within 1 s (the rank hosting it, or the link to it, may be gone)"
        assert 0.9 < time.monotonic() - start < 3
        for w, rec in [(wa, core_a.rec), (wb, core_b.rec)] * 3:
            start = time.monotonic()
            missing = w.missing(rec)
            assert time.monotonic() - start < 0.5
            assert Watch.describe_missing(missing).startswith(
                "which ranks did not arrive is unknown: the store has not answered a query for "), missing
        assert [t.name for t in threading.enumerate()].count("engine-watch-store") == 1
        os.kill(host.pid, signal.SIGCONT)            # the host answers again: the line drains, the reports read
        deadline = time.monotonic() + 10
        while "engine-watch-store" in [t.name for t in threading.enumerate()] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert wb.missing(core_b.rec) == [1]
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()


def test_a_timeout_whose_store_host_is_stopped_reports_a_quarter_of_the_timeout_later_at_most(monkeypatch):
    """A group's timeout asks the store which ranks did not arrive; with the store's host stopped (SIGSTOP,
    or behind a cut link) the report waited the full 5 s for it: a 2 s timeout raised after 7 s. It
    now waits a quarter of the timeout (at least 1 s, at most 5 s), then says the store did not answer."""
    import datetime
    import time

    import torch.distributed as dist

    from engine import failure
    monkeypatch.setattr(failure, "_group_failure", [])   # (this process is no MPI job to end at exit)
    host = subprocess.Popen([sys.executable, "-c", HOST_A_STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        for limit, most in ((2.0, 1.0), (8.0, 2.0)):
            w, core = watch(0, 2, dist.PrefixStore(f"t{limit:g}/", base), notes_id=f"t{limit:g}")
            core.rec = record(1, ALLREDUCE_SUM)
            stop(host.pid)
            start = time.monotonic()
            err = w.timed_out(core.rec, limit, limit)
            took = time.monotonic() - start
            assert f"which ranks did not arrive is unknown: the store did not answer within {most:g} s" in str(err), err
            assert most - 0.1 < took < most + 2, took
            os.kill(host.pid, signal.SIGCONT)
            base.check(["x"])   # (the line drains before the next limit's query)
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()


def test_a_wait_whose_store_host_is_stopped_times_out_a_quarter_of_the_timeout_later_at_most(monkeypatch):
    """The same store, stopped, through a whole wait (the watch called as the core's waits call it): the
    arrival note at 0.5 s blocks the store's line, and the comparison of the notes at 1 s waited the
    full 5 s for it, holding the wait: a 2 s timeout raised after 6 s. The comparison now waits no later
    than the timeout, whose report then waits its own quarter (1 s)."""
    import datetime
    import time

    import torch.distributed as dist

    from engine import failure
    monkeypatch.setattr(failure, "_group_failure", [])   # (this process is no MPI job to end at exit)
    host = subprocess.Popen([sys.executable, "-c", HOST_A_STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        w, core = watch(0, 2, dist.PrefixStore("wait/", base), notes_id="wait")
        w.set_timeout(2.0)
        core.rec = record(1, ALLREDUCE_SUM)
        stop(host.pid)
        start = time.monotonic()
        with pytest.raises(EngineTimeout, match=r"the store did not answer within 1 s") as err:
            while True:
                w(time.monotonic() - start)
                time.sleep(0.01)
        took = time.monotonic() - start
        assert 2.9 < took < 4.5, (took, err.value)
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()


def stop(pid):
    """SIGSTOP pid and wait until every thread of it has stopped. kill() returns once one thread is told:
    that thread stops the others only when it next runs, and meanwhile the store's server thread may still
    answer a query (on a loaded machine, for milliseconds)."""
    import time
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rpartition(")")[2].split()[0])
            except FileNotFoundError:   # (a thread that ended meanwhile)
                pass
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} did not stop within 10 s of SIGSTOP (its threads: {states})")


HOST_A_STORE = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
print(store.port, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_a_monitored_barrier_whose_store_goes_away_says_so_as_its_other_errors(rank):
    """The store's host (rank 0's process, under torch's rendezvous) ends while a rank waits in the
    barrier: the rank raises the barrier's error, naming the store's, not the store's bare error."""
    import gc
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from engine.monitored_barrier import monitored_barrier
    hosts = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
    store = dist.TCPStore("127.0.0.1", hosts[0].port, is_master=False, timeout=timedelta(seconds=10))
    ends = threading.Timer(0.2, lambda: (hosts.clear(), gc.collect()))
    ends.start()
    try:
        with pytest.raises(RuntimeError) as raised:
            monitored_barrier(store, "mb/", rank, 2, 5, 5, False, "the test's barrier")
    finally:
        ends.join()
    opening = "[Rank 0]: " if rank == 0 else ("Rank 1 successfully reached monitoredBarrier, but received errors "
                                              "while waiting for send/recv from rank 0: ")
    assert str(raised.value).startswith(opening + "the store failed (DistNetworkError: "), raised.value
    assert str(raised.value).endswith("(the test's barrier)"), raised.value


@pytest.mark.parametrize("rank", [0, 1])
def test_a_monitored_barrier_ends_soon_after_its_group_is_aborted(rank):
    """abort() 0.3 s into a monitored barrier whose peer never comes (timeout 20 s): the barrier raises
    the group's EngineAborted within a slice of its wait, on rank 0 and on the others (it waited in the
    store until its timeout)."""
    import threading
    import time

    import torch.distributed as dist

    from engine._core import EngineAborted
    from engine.monitored_barrier import monitored_barrier
    aborted = []
    timer = threading.Timer(0.3, aborted.append, [EngineAborted("process group 'g' was aborted (abort())")])
    timer.start()
    start = time.monotonic()
    with pytest.raises(EngineAborted, match="was aborted"):
        monitored_barrier(dist.HashStore(), "mb/", rank, 2, 20, 20, False, "the test's barrier",
                          aborted=lambda: aborted[0] if aborted else None)
    assert time.monotonic() - start < 3
    timer.join()


_LATE_RANK_IN_A_MONITORED_BARRIER = """
import threading, time
from datetime import timedelta
import torch.distributed as dist
from engine.monitored_barrier import monitored_barrier
host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
stores = [dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10)) for _ in range(2)]
def rank(r):
    time.sleep(0.8 * r)   # (rank 1 comes late: rank 0 waits for it, then rank 1 for the verdict)
    monitored_barrier(stores[r], "mb/", r, 2, 10, 10, False, "the test's barrier", aborted=lambda: None)
threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print("through", flush=True)
"""


def test_a_monitored_barrier_waiting_for_a_late_rank_writes_nothing_to_stderr():
    """Its waits, sliced so an abort() ends them, looked in the store through torch's store.wait with a
    50 ms timeout each: torch's store client logged a warning for every one that expired, 20 lines a
    second per waiting rank ('waitForInput: poll ... returned 0, likely a timeout'). Gloo's writes none."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _LATE_RANK_IN_A_MONITORED_BARRIER], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "through", proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]


_CANCELLABLE_MAKING_WAITS_FOR_A_LATE_RANK = """
import threading, time
from datetime import timedelta
import torch.distributed as dist
from engine.bootstrap import read_keys
host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
store = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
threading.Timer(0.8, host.set, ["late", "1"]).start()
got = read_keys(store, ["late"], 10, "the test's making", stop=lambda: None)
assert got == ([b"1"], [], None), got
why = []
threading.Timer(0.5, why.append, ["the test cancelled it"]).start()
start = time.monotonic()
try:
    read_keys(store, ["never"], 10, "the test's making", stop=lambda: ConnectionError(why[0]) if why else None)
except ConnectionError as exc:
    ended = time.monotonic() - start
    assert str(exc) == "the test cancelled it" and ended < 0.65, (str(exc), ended)
else:
    raise AssertionError("the wait was not cancelled")
print("through", flush=True)
"""


def test_a_cancellable_making_waiting_for_a_late_rank_writes_nothing_to_stderr_and_a_cancel_ends_it_at_once():
    """A group's making that a reconfigure's abort() may cancel (torch's reconfigure, shrink_group) waited
    in the store in slices of 0.2 s, and torch's store client logged a warning for each that expired (5
    lines a second per waiting rank); a cancel took up to a slice to be seen. It now looks in the store
    and sleeps between looks, as a monitored barrier does (engine.bootstrap.keys_set_within)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _CANCELLABLE_MAKING_WAITS_FOR_A_LATE_RANK], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "through", proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]


def test_abort_ends_a_wait_for_the_notes_from_a_store_that_stopped_answering():
    """The store's host stopped (SIGSTOP): 2 s into a wait the watch asks it for the notes; abort() 0.3 s
    later ends that ask within a slice (the wait, which reads the abort between polls, ended up to
    5 s, STORE_QUERY_SECONDS, after the abort)."""
    import threading
    import time

    class Stopped(Store):
        def check(self, keys):
            time.sleep(30)

    w, core = watch(0, 2, Stopped())
    core.rec = record(1, ALLREDUCE_SUM)
    w.check(core.rec, 1.2)     # (noted: its reads come next)
    timer = threading.Timer(0.3, setattr, [core, "aborted", True])
    timer.start()
    start = time.monotonic()
    w.check(core.rec, 2.5)
    assert time.monotonic() - start < 1.5
    timer.join()


def test_a_making_whose_store_stops_answering_ends_after_its_timeout_naming_the_store(monkeypatch):
    """The store's host stopped answering (SIGSTOP: across a cut link the connection stays open, and
    torch's store client gives its reads no timeout): each step of a group's making that asks it (the
    count of its makings, the members' lists, the bootstrap's exchanges) and a monitored barrier
    blocked until the kernel gave the connection up, many minutes later. Each now ends its timeout and
    STORE_QUERY_SECONDS after it began, saying the store did not answer and where it is."""
    import datetime
    import time

    import torch.distributed as dist

    from engine import watch as watch_module
    from engine.bootstrap import StoreBootstrap, agree_on_members
    from engine.monitored_barrier import monitored_barrier
    from engine import monitored_barrier as barrier_module
    from torchbridge.creation import makings_of
    monkeypatch.setattr(watch_module, "STORE_QUERY_SECONDS", 1.0)
    monkeypatch.setattr(barrier_module, "GRACE_SECONDS", 1.0)
    host = subprocess.Popen([sys.executable, "-c", HOST_A_STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        stop(host.pid)
        steps = {"count": lambda: makings_of(base, 0, 1, "engine: group '1'"),
                 "members": lambda: agree_on_members(base, "m", 0, [0, 1], 1, "engine new_group '1'", "was given",
                                                     "ranks to new_group"),
                 "exchange": lambda: StoreBootstrap(base, 0, 2, "b", timeout=1).allgather("rank 0's"),
                 "barrier": lambda: monitored_barrier(base, "mb/", 1, 2, 0.5, 0.5, False, "the test's barrier")}
        for step, making in steps.items():
            start = time.monotonic()
            with pytest.raises((ConnectionError, RuntimeError), match=r"store (did not answer within|has not "
                                                                      rf"answered a query).*port {port}\)") as raised:
                making()
            assert time.monotonic() - start < 5, (step, time.monotonic() - start)   # (the barrier: 0.5 + 0.5 + 1 + 1)
            assert step == "barrier" or "group '1'" in str(raised.value) or "(b)" in str(raised.value), raised.value
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()


_RANK_OF_A_MONITORED_BARRIER = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
from engine.monitored_barrier import monitored_barrier
rank, port = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=20))
if rank == 0:   # (rank 1 reaches the barrier with rank 0, however long its start took: rank 2 is the late one)
    print(store.port, flush=True)
    store.wait(["ready"])
else:
    store.set("ready", "")
try:
    monitored_barrier(store, "mb/", rank, 3, 1, 20, False, "the test's barrier", aborted=lambda: None,
                      lost=lambda: None)
except RuntimeError as exc:
    print("RAISED", exc, flush=True)
os._exit(0)   # (rank 0's process ends at once, and the store it hosts with it)
"""


def test_a_rank_that_reached_a_failed_monitored_barrier_hears_the_verdict_of_rank_0_that_exits_next():
    """Rank 2 never comes; rank 0 (whose process hosts the store, as under torch's rendezvous) names it
    at its timeout and its process ends at once. Rank 1, which arrived, said only that the store failed
    (its look for the verdict came after the store was gone): rank 0 now waits for it to read the
    verdict, and rank 1 says what rank 0 said."""
    import subprocess
    import sys

    host = subprocess.Popen([sys.executable, "-c", _RANK_OF_A_MONITORED_BARRIER, "0"], stdout=subprocess.PIPE,
                            text=True)
    port = host.stdout.readline().strip()
    other = subprocess.run([sys.executable, "-c", _RANK_OF_A_MONITORED_BARRIER, "1", port], capture_output=True,
                           text=True, timeout=60)
    said = host.communicate(timeout=60)[0]
    assert "RAISED [Rank 0]: Rank 2 failed to pass monitoredBarrier in 1000 ms" in said, said
    verdict = "rank 0 reported: [Rank 0]: Rank 2 failed to pass monitoredBarrier in 1000 ms"
    assert verdict in other.stdout, other.stdout + other.stderr[-2000:]


def test_monitored_barriers_leave_no_keys_in_the_store():
    """Three ranks pass 20 monitored barriers through one store: none of their keys is left (each left
    size + 1, for good: a barrier each step grew torch's store without bound)."""
    import threading

    import torch.distributed as dist

    from engine.monitored_barrier import monitored_barrier
    store = dist.HashStore()
    errors = []

    def rank(r):
        try:
            for i in range(20):
                monitored_barrier(store, f"mb/{i}/", r, 3, 20, 20, False, "the test's barrier")
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and store.num_keys() == 0, (errors, store.num_keys())


def test_the_watchdogs_list_of_watches_survives_groups_made_meanwhile():
    """The watchdog thread read the live watches with list() of a WeakSet while the main thread's add()
    (a group made) changed it: 'Set changed size during iteration' killed the thread, add() never
    started another, and MPI's blocking calls lost their timeout (800 torch groups made at once showed
    it in 2 runs of 3). Its snapshot() reads again instead."""
    import threading
    from engine.watch import _Registry

    class Held:   # (a stand-in for a Watch: the set holds anything weakly referenced)
        pass

    registry, held, done, failed = _Registry(), [Held() for _ in range(2000)], threading.Event(), []
    registry.watches.update(held)

    def read():
        try:
            while not done.is_set():
                registry.snapshot()
        except RuntimeError as exc:
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(20000):
        with registry.lock:
            held.append(Held())
            registry.watches.add(held[-1])
    done.set()
    reader.join()
    assert not failed, failed


def test_a_watch_collected_while_the_watchdog_waits_deadlocks_nothing():
    """A finalizer on each watch woke the watchdog (gone.set()) when the collector took it. The collector
    ran it on the watchdog's own thread inside gone.wait(), which holds the lock set() takes: the thread
    hung there, and so did the main thread's next destroy_process_group (close(), its own gone.set()),
    for good (a 3-rank suite under mpiexec, CI). Collected under that lock now, a watch takes none."""
    import threading
    from engine.watch import _Registry

    class Held:   # (a stand-in for a Watch)
        pass

    registry, held = _Registry(), [Held()]
    registry.thread = threading.current_thread()   # (no watchdog of its own: add() starts none)
    registry.add(held[0])

    def drop():
        with registry.gone._cond:   # (where the watchdog holds it, inside gone.wait())
            held.clear()            # (the last reference: the watch goes now, on this thread)

    dropper = threading.Thread(target=drop, daemon=True)
    dropper.start()
    dropper.join(10)
    assert not dropper.is_alive(), "dropping a watch under the watchdog's wait lock hung"
    assert len(registry.watches) == 0


DUMP_ON_SIGNAL = """
import faulthandler, os, signal, sys
if sys.argv[1] == "theirs":   # (the program's own faulthandler on SIGUSR1, which Python's signal module can't see)
    faulthandler.register(signal.SIGUSR1, file=open(sys.argv[2], "w"), all_threads=False)
elif sys.argv[1] == "ignored":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
import engine
world = engine.world()   # (alone)
os.kill(os.getpid(), signal.SIGUSR1)
world.barrier()
print("done", flush=True)
world.free()
"""


@pytest.mark.parametrize("claimed", ["engine's", "theirs", "ignored"])
def test_sigusr1_prints_the_stacks_and_the_recorders_unless_the_program_claimed_it(tmp_path, claimed):
    """SIGUSR1 prints every thread's stack (the watchdog's too), then the flight recorders, to stderr
    (engine/watch.py: _install_dump_signal). A program that catches SIGUSR1 itself keeps it, even where
    Python's signal module does not know of its handler (faulthandler's own, here), and one that ignores
    it keeps that: the engine's dump stays out of its way."""
    theirs = tmp_path / "theirs.txt"
    proc = subprocess.run([sys.executable, "-c", DUMP_ON_SIGNAL, claimed, str(theirs)],
                          capture_output=True, text=True, timeout=60, env=clean_env(WORLD_SIZE=""))
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stdout + proc.stderr
    if claimed == "theirs":
        assert 'File "<string>", line 9 in <module>' in theirs.read_text() and not proc.stderr, proc.stderr
    elif claimed == "ignored":
        assert not proc.stderr, proc.stderr
    else:
        assert re.search(r'Current thread 0x[0-9a-f]+ \(most recent call first\):\n  File "<string>", line 9 in '
                         r"<module>", proc.stderr), proc.stderr
        assert re.search(r'File ".*engine/watch.py", line \d+ in _watchdog', proc.stderr), proc.stderr
        assert proc.stderr.index("Current thread") < proc.stderr.index("engine: flight recorder of group"), proc.stderr
