"""Fail loudly, never hang: each scenario of tests/faults/ under mpiexec, on both transports
(ENGINE_TRANSPORT=shm and mpi). A missing rank blocks on an event that never comes (a pipe nobody
writes), and a timeout is judged by the wait's length the engine reports; mpirun's own time is checked
only where the point is how soon the whole job ends (a killed rank)."""

import ast
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import torchrun
from mpirun import (launcher_output, mpi_env, mpiexec_command, run_job, run_launcher, run_pytest, running,
                    suite_report, under_open_mpi)

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")


TRANSPORTS = pytest.mark.parametrize("transport", ["shm", "mpi"])


def launch(script, nranks, timeout, **env):
    """The script under mpiexec: (the run, its output); a job still running at the timeout fails (run_job)."""
    proc = run_job(mpiexec_command(nranks) + [sys.executable, os.path.join(HERE, script)], timeout,
                   {**mpi_env(), **env}, script)
    return proc, launcher_output(proc.stdout + proc.stderr)


def spawned(script, *args, timeout):
    """The output of a fault script that starts its own ranks (tests/faults/spawned.py), run without the
    MPI launcher's variables this test may run under."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}
    proc = run_launcher([sys.executable, os.path.join(HERE, script), *map(str, args)], timeout, env=env)
    return proc.stdout + proc.stderr


def timed_out_after(text):
    """The wait's length as the engine reports it ("Timed out after 5.1 s"), not a wall clock around mpirun."""
    return float(re.search(r"Timed out after ([\d.]+) s", text).group(1))


def assert_rank_1_named_missing(out, calls):
    """Rank 0 or 2 timed out in one of `calls` (a regex) naming rank 1 as missing, after the group's 5 s
    timeout by the wait's length the engine reports."""
    found = re.search(rf"({calls}) of group '0' \(rank [02] of 3\): Timed out after [\d.]+ s \(timeout 5 s\): "
                      r"ranks? (\d, )*1(, \d)* did not arrive", out)
    assert found, out[-3000:]
    assert 5 <= timed_out_after(found.group(0)) < 10, found.group(0)


def shm_files():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


KILLED_LAUNCHER = """
import os, sys, time
import torch, torch.distributed as dist
from engine import failure
dist.init_process_group("engine")
t = torch.ones(1 << 20)
for _ in range(5):
    dist.all_reduce(t)
ready = os.path.join(sys.argv[1], f"ready.{dist.get_rank()}")
with open(ready + ".part", "w") as f:   # (what it mapped: a file, as the killed launcher may lose what it printed)
    f.write(repr(failure._mpi_segments()))
os.rename(ready + ".part", ready)
time.sleep(3)   # (the launcher is killed meanwhile: the ranks go on, and end alone)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("case", ["shm", "mpi", "shm-kept"])
def test_a_launcher_killed_leaves_no_mpi_segment_in_dev_shm(tmp_path, case):
    """mpiexec killed with SIGKILL (a harness's timeout) while its ranks run: Open MPI's shared-memory
    files (16 MiB each) stayed in /dev/shm, as the launcher unlinks them at the job's end. The first
    group made over the whole job unlinks them once every rank of the host maps them all; with
    ENGINE_MPI_KEEP_SEGMENTS=1 they stay until the launcher unlinks them (here, the job's end)."""
    transport, kept = case.split("-")[0], case.endswith("kept")
    script = tmp_path / "job.py"
    script.write_text(KILLED_LAUNCHER)
    before = shm_files()
    proc = subprocess.Popen(mpiexec_command(2) + [sys.executable, str(script), str(tmp_path)],
                            env={**mpi_env(), "ENGINE_TRANSPORT": transport,
                                 "ENGINE_MPI_KEEP_SEGMENTS": str(int(kept))},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready.{r}").exists() for r in range(2)) and proc.poll() is None:
        assert time.monotonic() < deadline, "the job never got ready"
        time.sleep(0.1)
    if not kept:
        os.killpg(proc.pid, signal.SIGKILL)
    out = proc.communicate(timeout=60)[0]
    deadline = time.monotonic() + 60   # (the ranks, orphaned, end after their sleep)
    while subprocess.run(["pgrep", "-f", str(script)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the ranks did not end"
        time.sleep(0.2)
    ready = [tmp_path / f"ready.{r}" for r in range(2)]
    mapped = [ast.literal_eval(path.read_text()) for path in ready if path.exists()]
    assert len(mapped) == 2 and all(len(m) == 2 and all(path.endswith(" (deleted)") != kept for path in m)
                                    for m in mapped), f"{mapped}\n{out[-3000:]}"
    assert shm_files() <= before


@TRANSPORTS
def test_skipped_all_reduce_warns_then_raises_within_timeout_naming_the_missing_rank(transport):
    proc, out = launch("skip_allreduce.py", 3, 90, SKIP_RANK="1", ENGINE_STALL_WARNING_SECONDS="1",
                          ENGINE_TRANSPORT=transport)
    # the stall warning first, 1 s in (a rank itself late to the call, on a loaded machine, is named too:
    # "ranks 1, 2 did not arrive"; the watch, looking every 0.5 s, may see the stall half a second late)
    assert re.search(r"WARNING rank [02] has waited [12] s in allreduce #2 of group '0'; ranks? (\d, )*1(, \d)* did "
                     r"not arrive \(timeout in [34] s\)", out), out[-3000:]
    raised = re.findall(r"rank (\d): raised after [\d.]+ s: EngineTimeout: (.*)", out)
    assert sorted(r for r, _ in raised) == ["0", "2"], out[-3000:]
    for _, msg in raised:
        assert 5 <= timed_out_after(msg) < 10, msg  # as the engine reports it; group timeout 5 s
        assert msg.startswith("allreduce #2 of group '0' (rank ") and ": Timed out after " in msg \
            and "(timeout 5 s): rank 1 did not arrive" in msg, msg
        if transport == "shm":   # (the segment's step flags say whom the wait waits on)
            assert msg.endswith("did not arrive; this rank waits on rank 1 (pid " + msg.split("(pid ")[-1]), msg
        else:   # (the message its wait is on: said where the store that names the late ranks is out of reach)
            assert msg.endswith("did not arrive; this rank waits on rank 1: its receive from that rank, posted to "
                                "MPI, has not completed"), msg
    assert "engine: flight recorder of group '0'" in out  # dumped on the timeout
    assert proc.returncode != 0


def test_a_skipped_allreduce_in_a_group_without_a_store_names_the_rank_it_waits_on():
    """engine.world() under mpirun has no store to ask which ranks did not arrive: its timeout says so,
    and names the rank whose step its own wait is on."""
    proc, out = launch("skip_allreduce.py", 3, 90, SKIP_RANK="1", SKIP_API="engine", ENGINE_TIMEOUT="5",
                       ENGINE_TRANSPORT="shm")
    raised = re.findall(r"rank (\d): raised after [\d.]+ s: EngineTimeout: (.*)", out)
    assert sorted(r for r, _ in raised) == ["0", "2"], out[-3000:]
    for _, msg in raised:
        assert 5 <= timed_out_after(msg) < 10, msg
        assert re.search(r"^allreduce #2 of group '.*' \(rank [02] of 3\): Timed out after [\d.]+ s \(timeout 5 s\): "
                         r"which ranks did not arrive is unknown \(this communicator has no store to compare notes\); "
                         r"this rank waits on rank 1 \(pid \d+\)", msg), msg
    assert proc.returncode != 0


@pytest.mark.parametrize("transport", ["shm", "mpi", "tcp"])
def test_debug_mode_mismatch_raises_on_every_rank(transport):
    """The signatures go round first (the point-to-point ring, on every transport): EngineMismatch, not
    the group's timeout. Before it (tests/faults/mismatch.py): calls uneven by design pass the check,
    and a rank that never calls ends the check's wait at the group's timeout."""
    proc, out = launch("mismatch.py", 2, 60, ENGINE_DEBUG="1", ENGINE_TRANSPORT=transport)
    assert out.count(": uneven calls ok") == 2, out[-3000:]
    assert len(re.findall(r"rank \d: counts: EngineMismatch: collective mismatch in group '\d+': gather #1 root 0: the "
                          r"ranks' elements \(rank 0: 1, rank 1: 3\) are not the root's counts", out)) == 2, out[-3000:]
    alone = re.search(r"rank 0: alone, raised after [\d.]+ s: EngineTimeout: (allreduce signature check #1 of group "
                      r"'\d+' \(rank 0 of 2\): Timed out after [\d.]+ s \(timeout 1 s\): some rank never reached)", out)
    assert alone and 1 <= timed_out_after(alone.group(1)) < 5, out[-3000:]
    lines = re.findall(r"rank (\d): raised after ([\d.]+) s: EngineMismatch: (.*)", out)
    assert sorted(r for r, _, _ in lines) == ["0", "1"], out[-3000:]
    for _, _, msg in lines:
        assert "rank 0: allreduce #1 with 100 float32 elements" in msg
        assert "rank 1: allreduce #1 with 200 float32 elements" in msg


@pytest.mark.parametrize("transport,setting", [("tcp", "ENGINE_DEBUG=1"), ("shm", "TORCH_DISTRIBUTED_DEBUG=DETAIL")])
def test_debug_mode_mismatch_at_4_ranks_raises_the_mismatch_on_every_rank_every_time(transport, setting):
    """tests/faults/debug_mismatch_rounds.py: 8 rounds of a mismatched allreduce at 4 ranks, in debug mode
    by the engine's variable or by torch's (DETAIL). Every rank raises EngineMismatch in every round.
    Before, over TCP, a rank whose ring of signatures ended first gave the group up, and a rank still
    waiting on the ring's last step failed at once with EnginePeerLost naming it (most rounds)."""
    proc, out = launch("debug_mismatch_rounds.py", 4, 120, ENGINE_TRANSPORT=transport, DEBUG_SETTING=setting)
    said = re.findall(r"rank (\d): round (\d): (\w+): (.*)", out)
    assert len(said) == 4 * 8 and out.count(": done") == 4, out[-3000:]
    wrong = [line for line in said   # (the debug check's words: shared memory's own check names no rank group)
             if line[2] != "EngineMismatch" or not line[3].startswith("collective mismatch in group '")
             or "ranks 0, 1, 2: allreduce #1 with 2 float32" not in line[3]]
    assert not wrong, wrong[:4]
    assert proc.returncode == 0, out[-3000:]


# Point-to-point algorithms forced over the segment's queues (its own step protocol checks signatures).
SHM_P2P = dict(ENGINE_ALLREDUCE_ALGO="rdouble", ENGINE_BROADCAST_ALGO="tree", ENGINE_ALLGATHER_ALGO="ring",
               ENGINE_REDUCE_SCATTER_ALGO="ring", ENGINE_BARRIER_ALGO="dissemination")


@pytest.mark.parametrize("transport", ["shm", "shm-p2p", "tcp", "mpi"])
def test_mismatched_calls_raise_without_debug_mode(transport):
    """The last of 3 ranks calls another collective, or the same one with another reduce op, AVG for
    SUM, a dtype of the same bytes (an allreduce's float32 and float64; a reduce_scatter's BOR of int16 and
    int64, whose tags a hash had made alike), another broadcast root, another count, or alltoall splits that
    disagree with its peers', or every rank names itself the root of a reduce
    (tests/faults/mismatched_calls.py):
    without ENGINE_DEBUG, no rank returns anything but what its own call asks for, some rank raises
    EngineMismatch naming another, and the rest raise that or EnginePeerLost naming a rank that left
    the group or gave it up: never the group's timeout (60 s).

    Over MPI, with its defaults (MPI's own collectives but for allreduce), every rank raises
    EngineMismatch: the ranks that wait on the sender of another call's message see it (MPI_Iprobe),
    the others find the mismatch in the arrival notes of the group's store, after 2 s of waiting (a
    rank waiting on one whose call failed in a mismatch reads that in its note). An
    allgather against a reduce-scatter, both blocking inside MPI, ends the job (the watchdog) naming
    both calls. A broadcast whose ranks name different roots, by MPI's own, is not run: nothing
    tells it."""
    env = dict(ENGINE_TRANSPORT=transport.split("-")[0], **(SHM_P2P if transport == "shm-p2p" else {}))
    cases = ["kind", "reduce_op", "avg", "dtype", "bitwise_dtype", "broadcast_root", "broadcast_root_large",
             "every_rank_root", "allgather_vs_reduce_scatter", "count", "alltoall_splits"]
    if transport == "mpi":   # (MPI's reduce blocks inside MPI: the watchdog would end the job there; its own
        # reduce_scatter checks nothing: docs/robustness.md)
        env.update(MISMATCH_CASES=" ".join(c for c in cases if not c.startswith(("broadcast_root", "every_rank_root",
                                                                                 "bitwise"))))
    # (the job ends in an abort at exit, the failure policy's: groups failed on every rank)
    proc, out = launch("mismatched_calls.py", 3, 240, ENGINE_ABORT_GRACE_SECONDS="0.5", **env)
    got = {}
    for case, rank, what in re.findall(r"CASE (\w+) rank (\d): (.*)", out):
        got.setdefault(case, {})[int(rank)] = what
    if transport == "mpi":
        cases = ["kind", "reduce_op", "avg", "dtype", "count", "alltoall_splits"]
        assert re.search(r"collective mismatch: rank \d called (allgather|reduce_scatter) of \d+ float32.*; rank \d "
                         r"called (allgather|reduce_scatter) .*the call is blocked inside MPI and cannot be "
                         r"interrupted: aborting the job", out), out[-3000:]
        assert all(re.match(r"raised EngineMismatch: .*collective mismatch: rank \d called .*; rank \d called", w)
                   for w in got["kind"].values()), got["kind"]
        assert any("sent a message of another collective" in w for case in cases for w in got[case].values()), got
    assert sorted(got) == sorted(cases), out[-3000:]
    for case, ranks in got.items():
        assert sorted(ranks) == [0, 1, 2], (case, ranks)
        for rank, what in ranks.items():
            if what.startswith("returned"):   # only a broadcast from the root this rank named, whole
                whole = "[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]" + ("]" if case == "broadcast_root" else
                                                                       ", [1048575.0, 1048576.0]]")
                assert case.startswith("broadcast_root") and rank < 2 and what == f"returned {whole}", (case, rank, what)
            else:   # (a single copy from a root that left the call names it)
                assert re.match(r"raised (EngineMismatch: .*rank \d|EnginePeerLost: .*rank \d .*(left the group|exited|"
                                r"closed its connection.* without leaving the group|gave the group up)|"
                                r"EnginePeerLost: .*single copy from or to rank \d's memory .* rank \d left this call)",
                                what), (case, rank, what)
        if transport == "mpi":
            assert all(w.startswith("raised EngineMismatch") for w in ranks.values()), (case, ranks)
        assert any(w.startswith("raised EngineMismatch") for w in ranks.values()), (case, ranks)
        # each mismatch says what differed, in its finder's words: the segment's (both calls, the one that
        # differs among them), a point-to-point message's, or the store's notes (both calls)
        for what in (w for w in ranks.values() if w.startswith("raised EngineMismatch")):
            said = MISMATCH_WORDS.search(what)
            assert said, (case, what)
            assert said.group("p2p") or re.search(MISMATCH_DETAIL[case], what), (case, what)
    if transport != "shm":   # (over point-to-point, its messages' words were seen: over MPI, where the store's
        # notes may find a count first, another collective's)
        seen = " ".join(w for ranks in got.values() for w in ranks.values())
        assert P2P_OTHER_COLLECTIVE in seen and (transport == "mpi" or P2P_OTHER_SIZE in seen), got


P2P_OTHER_SIZE = ("sent a message of another size than this rank expects: the ranks are in different collectives, or "
                  "passed different counts")
P2P_OTHER_COLLECTIVE = ("sent a message of another collective while this rank waited for its part of this one: the "
                        "ranks called different collectives, or the same one with another dtype, reduce op or root")
MISMATCH_WORDS = re.compile(r"collective mismatch in this group: rank \d: \w+ #1 .*; rank \d: \w+ #1 |"
                            r"collective mismatch: rank \d called \w+ of .*; rank \d called \w+ of |"
                            rf"(?P<p2p>rank \d .*({re.escape(P2P_OTHER_SIZE)}|{re.escape(P2P_OTHER_COLLECTIVE)}))")
MISMATCH_DETAIL = {"kind": "broadcast", "reduce_op": "MAX", "avg": "AVG", "dtype": "float64", "bitwise_dtype": "int64",
                   "broadcast_root": "root 2",
                   "broadcast_root_large": "root 2", "count": "16 float32", "alltoall_splits": r"elements (from|to) rank",
                   "allgather_vs_reduce_scatter": "reduce_scatter", "every_rank_root": r"root [12]"}


@pytest.mark.parametrize("skip", ["broadcast", "reduce"])
def test_native_collective_that_never_completes_ends_the_job(skip):
    """MPI's own collectives: a broadcast is waited on by the engine (EngineTimeout, then the failure
    policy ends the job), whose message says that MPI does not show which ranks are past it (ranks
    naming different roots pass at once, and have no arrival note); the root of a reduce blocks inside
    MPI (the watchdog ends the job)."""
    before = shm_files()
    proc, out = launch("skip_broadcast.py", 3, 90, ENGINE_TRANSPORT="mpi", SKIP_OP=skip)
    assert proc.returncode != 0, out[-3000:]
    # rank 2 waits in the collective or, where MPI gave it the data straight from the root or took its
    # part at once, in the barrier (on a loaded machine rank 2 may itself still be on its way: "ranks 1,
    # 2 did not arrive")
    assert_rank_1_named_missing(out, rf"{skip} #2|barrier #3")
    assert "aborting the job" in out
    if skip == "reduce":
        assert "reduce #2 of group '0' (rank 0 of 3)" in out and "blocked inside MPI" in out, out[-3000:]
    else:   # (a wait inside MPI's own collective can't tell a late rank from one past it: it says so)
        assert "EngineTimeout" in out, out[-3000:]
        assert re.search(r"Timed out after .*did not arrive; this rank waits inside MPI's own (broadcast|barrier), "
                         "which does not say which ranks are past it", out), out[-3000:]
    assert shm_files() <= before  # no shared-memory segment left behind


STALLED_ABORT = """
import sys, time, types
from engine import failure
never = types.SimpleNamespace(Abort=lambda code: time.sleep(3600))   # an MPI_Abort that never returns
sys.modules["mpi4py.MPI"] = types.SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False,
                                                  COMM_WORLD=never)
failure.ABORT_STALL_SECONDS = 1
failure.abort(3, "engine: the report")
"""


def test_an_abort_that_mpi_never_completes_still_ends_the_process():
    """Open MPI's MPI_Abort waits for the launcher (PMIx_Abort), which has deadlocked: a rank left in
    it would keep its job alive with nothing to say why. Past ABORT_STALL_SECONDS the process dies
    by SIGALRM (here an MPI stand-in whose Abort sleeps an hour; the timer is the kernel's, which no
    lock of the process holds up), after the report."""
    proc = subprocess.run([sys.executable, "-c", STALLED_ABORT], capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGALRM, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.startswith("engine: the report"), proc.stderr[-3000:]


@pytest.mark.parametrize("making, waits_in", [("world", r"'world' over MPI \(MPI_Allgather\)"),
                                              ("subgroup", r"'world/0-1' over MPI \(MPI_Comm_create_group\)")])
def test_a_rank_that_never_makes_a_group_over_mpi_ends_the_job_at_the_timeout(making, waits_in):
    """The making's MPI collectives can't be interrupted: at the group's timeout the job is aborted,
    naming the making and the call MPI is blocked in."""
    before = shm_files()
    proc, out = launch("mpi_making.py", 3, 90, MAKING=making)
    assert proc.returncode != 0, out[-3000:]
    assert re.search(rf"engine: rank [02]: making group {waits_in}: Timed out after 5 s \(timeout 5 s\): a rank "
                     r"of the group never joined it .* aborting the job", out), out[-3000:]
    assert "returned (unexpected)" not in out
    assert shm_files() <= before


def test_shm_rank_that_never_arrives_ends_the_job():
    """Over shared memory every wait is watched: the broadcast's root returns at once (its data is in the
    segment), rank 2 gets it too; both then time out in the barrier rank 1 never reaches, name it, and
    abort the job after a short grace (a rank that raised must not wait in MPI_Finalize for rank 1)."""
    before = shm_files()
    proc, out = launch("skip_broadcast.py", 3, 90, ENGINE_TRANSPORT="shm", ENGINE_ABORT_GRACE_SECONDS="0.5")
    assert proc.returncode != 0, out[-3000:]
    assert_rank_1_named_missing(out, r"barrier #3")
    assert "aborting the job, after 0.5 s of grace" in out
    assert "returned (unexpected)" not in out
    assert shm_files() <= before


@pytest.mark.parametrize("transport,then", [("shm", "exit"), ("shm", "kill"), ("shm", "stay"), ("tcp", "exit")])
def test_a_rank_that_did_its_part_and_went_is_not_named_for_the_one_that_never_came(transport, then):
    """tests/faults/done_then_gone.py: rank 2 never comes to a reduce whose root (rank 0) waits; rank 1
    did its part, then exits normally, is gone at once (os._exit) or waits outside the engine. Rank 0's
    error names rank 2, and not rank 1 as not arrived (it has no arrival note: it never stalled) nor
    as the rank the call waited for (shared memory named its exit so, and over both transports a
    normal exit looked like a crash, where TCP's goodbye at exit now has shared memory's leave)."""
    proc, out = launch("done_then_gone.py", 3, 90, ENGINE_TRANSPORT=transport, DONE_THEN=then)
    assert proc.returncode != 0 and "rank 1: did its part" in out, out[-3000:]
    raised = re.findall(r"rank 0: raised after [\d.]+ s: (\w+): (.*)", out)
    assert len(raised) == 1, out[-3000:]
    kind, msg = raised[0]
    if then == "kill":
        assert kind == "EnginePeerLost" and re.match(
            r"reduce failed: rank 1 \(pid \d+\) exited without leaving the group \(killed, crashed, os._exit\) while "
            r"rank 0 was in reduce #2, after it had done its part there; rank 0 was waiting for rank 2$", msg), msg
    else:
        assert kind == "EngineTimeout" and re.match(
            r"reduce #2 of group '0' \(rank 0 of 3\): Timed out after [\d.]+ s \(timeout 5 s\): rank 2 did not "
            r"arrive; this rank waits on rank 2 \(", msg), msg


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_peer_lost_in_debug_modes_check_names_the_users_call(transport):
    """tests/faults/debug_lost.py: in debug mode a rank dies before an all_reduce, and the survivors see
    it in the check of the ranks' calls (an allgather). Their error said `allgather failed: ...`, a call
    they never made; it now names their all_reduce and the check, then why."""
    out = spawned("debug_lost.py", transport, timeout=300)
    assert "exit codes [0, 0, -9]" in out, out[-5000:]
    for rank in (0, 1):
        said = re.findall(rf"rank {rank}: (.*)", out)
        assert len(said) == 1 and re.match(r"EnginePeerLost: allreduce #\d+ of group '0', in debug mode's check of the "
                                           r"ranks' calls: allgather failed: rank 2 ", said[0]), out[-5000:]


@TRANSPORTS
def test_sigkilled_rank_ends_the_job_quickly_and_leaves_nothing(transport):
    before = shm_files()
    # a group timeout past the launch's: only the loss of rank 1 can end the job in time
    proc, out = launch("killed_rank.py", 3, 120, KILL_RANK="1", ENGINE_TRANSPORT=transport, ENGINE_TIMEOUT="600")
    assert proc.returncode != 0, out[-3000:]
    assert "SIGKILL at step 5" in out
    # the survivors end in an error naming the lost rank, never a crash of their own
    assert not re.search(r"signal (11|6)\b|Segmentation fault|Aborted", out), out[-3000:]
    leftover = subprocess.run(["pgrep", "-f", "faults/killed_rank.py"], capture_output=True, text=True).stdout
    assert leftover.strip() == "", leftover
    assert shm_files() <= before


@TRANSPORTS
def test_point_to_point_recv_times_out_naming_the_peer(transport):
    # Rank 1 waits in the barrier while rank 0's receive times out: it gets a longer timeout.
    code = ("import engine, numpy as np\n"
            "from engine.launcher import detect_launcher\n"
            "c = engine.Communicator(timeout=2 if detect_launcher()[1] == 0 else 30)\n"
            "if c.rank == 0:\n"
            "    try:\n"
            "        c.recv(np.zeros(4, np.float32), source=1, tag=9)\n"
            "    except engine.EngineError as e:\n"
            "        print('RAISED', e, flush=True)\n"
            "c.barrier()\n")
    script = os.path.join(HERE, f"_recv_timeout_{transport}.py")
    with open(script, "w") as f:
        f.write(code)
    try:
        proc, out = launch(os.path.basename(script), 2, 60, ENGINE_TRANSPORT=transport)
    finally:
        os.remove(script)
    raised = re.search(r"RAISED recv from rank 1 \(tag 9\) in group '\w+' \(rank 0 of 2\): Timed out after [\d.]+ s "
                       r"\(timeout 2 s\): nothing came from rank 1 for it \(it did not send it, or the link "
                       r"to it is cut\)", out)
    assert raised, out[-2000:]
    assert 2 <= timed_out_after(raised.group(0)) < 5, raised.group(0)
    assert proc.returncode == 0


@TRANSPORTS
def test_bad_inputs_get_clear_errors(tmp_path, transport):
    trace = tmp_path / "t.json"
    proc, out = launch("bad_input.py", 2, 90, ENGINE_DEBUG="1", ENGINE_TRACE=str(trace), ENGINE_TRANSPORT=transport)
    cases = dict(re.findall(r"CASE ([^:]+): (.*)", out))
    assert "EngineMismatch" in cases["dtype mismatch"] and "float32" in cases["dtype mismatch"] \
        and "float64" in cases["dtype mismatch"], cases
    assert "shape (2, 4)" in cases["shape mismatch"] and "shape (4, 2)" in cases["shape mismatch"]
    assert "root 0" in cases["root mismatch"] and "root 1" in cases["root mismatch"]
    assert "op SUM" in cases["op mismatch"] and "op MAX" in cases["op mismatch"]
    assert "is a meta tensor, which holds no data" in cases["wrong device"] and "to_empty" in cases["wrong device"]
    assert "out of range" in cases["invalid rank"] or "Invalid" in cases["invalid rank"], cases["invalid rank"]
    assert cases["outside group"] == "no error" and cases["outside group result"] == "[1.0, 1.0, 1.0, 1.0] in_group=-1"
    assert "BAND is not supported for dtype float32" in cases["unsupported op"]
    assert "twice" in cases["second init"]
    assert "initialized" in cases["use after destroy"] or "init_process_group" in cases["use after destroy"]
    assert cases["default group still works"] == "[2.0, 2.0, 2.0, 2.0]"
    # Options the engine can't honour are refused (they were read as the ones it can); a call's own
    # timeout is kept by allreduce_coalesced too; complex tensors handed to the group's own allreduce
    # and its coalesced form are summed (refused, as torch had not made them real).
    for what, n in (("reduce", 1), ("broadcast", 3)):
        assert f"engine {what}: rootTensor is {n}, but the engine takes one tensor" in cases[f"{what} root tensor"]
    for what, kind in (("gather", "output"), ("scatter", "input")):
        assert f"the root takes one list of {kind} tensors (one per rank), in a list of one; got 2 lists" \
            in cases[f"{what} lists rank 0"], cases
        assert f"only the root (rank 0) passes {kind} tensors; this rank (1) passed 2" in cases[f"{what} lists rank 1"]
    for seconds in (0, -2):
        for what, case in (("allreduce", "timeout"), ("barrier", "barrier timeout"),
                           ("allreduce_coalesced", "coalesced timeout")):
            assert (f"ValueError: engine {what}: a call's own timeout must be above 0, got {seconds} s"
                    in cases[f"{case} {seconds}"]), cases
    assert re.match(r"EngineTimeout: .*Timed out after [\d.]+ s \(timeout 0.5 s\): (rank 1 did not arrive|some rank "
                    r"never reached this call)",
                    cases["coalesced own timeout"]), cases["coalesced own timeout"]
    assert cases["complex sums"] == "[(3+6j), (9-3j)] [[(3+6j), (9-3j)], [(3+6j)]]", cases
    assert "does not support RedOpType.MAX on complex tensors" in cases["complex max"]
    assert "flight recorder of group '0', rank 0 of 2: SIGUSR1" in out
    # (and, before it, the stacks of every thread of the rank that got the signal: the engine's watchdog's too)
    assert "Current thread 0x" in out and re.search(r'  File ".*bad_input.py", line \d+ in <module>', out), out
    assert re.search(r'File ".*engine/watch.py", line \d+ in _watchdog', out), out
    for r in (0, 1):
        events = json.load(open(tmp_path / f"t.rank{r}.json"))["traceEvents"]
        names = {e["name"] for e in events if e.get("ph") == "X"}
        assert "allreduce" in names and "broadcast signature check" in names


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ddp_bucket_failing_in_flight_raises_naming_the_rank_instead_of_crashing(transport):
    """A failed Work's future must fail in C++ too: torch.futures.Future.set_exception alone completed it
    with the exception as its value, which DDP's reducer read as the bucket's tensors (SIGSEGV)."""
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    proc = run_launcher([sys.executable, os.path.join(HERE, "ddp_dead_peer.py")],
                        180, env={**env, "ENGINE_TRANSPORT": transport})
    out = proc.stdout + proc.stderr
    assert "exit codes [0, 0]" in out, out[-3000:]
    assert re.search(r"rank 0 raised: \w+: .*allreduce failed: rank 1\b", out), out[-3000:]


def test_script_ending_with_collectives_in_flight_exits_cleanly_under_mpirun():
    """tests/faults/exit_in_flight.py (see tests/test_launchers.py for torchrun) over MPI's transport:
    the engine's exit hook must run what is queued before mpi4py's MPI_Finalize, on every rank."""
    proc, out = launch("exit_in_flight.py", 3, 300, ENGINE_TRANSPORT="mpi")
    assert proc.returncode == 0 and "terminate called" not in out, out[-5000:]
    assert len(re.findall(r"rank \d: leaving with \d+ of 16 collectives in flight", out)) == 3, out[-5000:]


def test_a_rank_that_leaves_after_an_interrupted_call_ends_the_mpi_job():
    """tests/faults/interrupted_exit.py: rank 0 catches a ^C inside its allreduce, destroys the group
    and leaves; over MPI nothing tells rank 1, which waited its whole timeout (60 s, past this test's
    bound) while rank 0 hung in MPI_Finalize. The call that ended midway is the group's failure:
    rank 0's exit aborts the job, naming it."""
    proc, out = launch("interrupted_exit.py", 2, 45,
                       ENGINE_TRANSPORT="mpi", ENGINE_ABORT_GRACE_SECONDS="0.5")
    assert proc.returncode != 0 and "rank 0: destroyed its group, leaving" in out, out[-5000:]
    assert re.search(r"rank 0 exits after a group failed \(allreduce #2 of group .* ended midway: KeyboardInterrupt\)",
                     out), out[-5000:]
    assert "Timed out" not in out, out[-5000:]


@pytest.mark.parametrize("launch_with", ["spawn-shm", "spawn-tcp", "mpiexec-mpi"])
def test_processes_forked_from_a_rank_leave_its_groups_alone(launch_with):
    """tests/faults/forked_child.py: DDP fed by forked DataLoader workers trains like one process; a
    forked child's (and its own child's) every call is refused naming the fork (collectives, messages,
    asynchronous calls, the parent's work in flight, new_group, monitored_barrier), and its destroy and
    exit leave the rank's groups working; spawned, a rank that dies while its forked child lives is lost
    to rank 0 at once, as exited, not as left (the child's copy used to leave the group for it) nor when
    the child ends."""
    how, transport = launch_with.split("-")
    script = os.path.join(HERE, "forked_child.py")
    if how == "mpiexec":
        proc, out = launch("forked_child.py", 2, 120, ENGINE_TRANSPORT=transport)
        assert proc.returncode == 0, out[-5000:]
    else:
        env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
        proc = run_launcher([sys.executable, script], 180, env={**env, "ENGINE_TRANSPORT": transport})
        out = proc.stdout + proc.stderr
        assert "exit codes [0, -9]" in out, out[-5000:]
        lost = re.search(r"rank 0 raised after ([\d.]+) s: EnginePeerLost: allreduce failed: rank 1 \((.*)", out)
        assert lost and float(lost.group(1)) < 10 and "left the group" not in lost.group(2), out[-5000:]
    assert "CLIENT DDP with forked DataLoader workers: 2 ranks" in out, out[-5000:]
    for rank in (0, 1):
        assert f"rank {rank}'s child: every call refused, naming the fork" in out, out[-5000:]
        assert f"rank {rank}'s grandchild: every call refused, naming the fork" in out, out[-5000:]
        assert f"rank {rank}: its groups work after its child's calls and exit" in out, out[-5000:]


HUB_FORKS_DURING_A_RECONFIGURE = """
import os, sys, time
from engine import handles
listener = handles.Listener()
print(listener.handle, flush=True)
store, index, n = handles.meet(listener, 7, [listener.handle, sys.stdin.readline().strip()], 60)
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(index, n, child, flush=True)
time.sleep(60)
"""


def test_a_fork_during_a_reconfigure_leaves_its_connections_to_the_parent():
    """A process forked while its reconfigure is in flight (torchft reconfigures on a thread of its own
    while the training loop forks DataLoader workers) closes its copies of the meeting's connections:
    the hub dies (SIGKILL) and the member waiting on it fails at once, not when the child ends or at
    the reconfigure's timeout. Here the test process is the member."""
    import time

    from engine import handles
    listener = handles.Listener()
    hub = subprocess.Popen([sys.executable, "-c", HUB_FORKS_DURING_A_RECONFIGURE], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    child = None
    try:
        hub_handle = hub.stdout.readline().strip()
        hub.stdin.write(listener.handle + "\n")
        hub.stdin.flush()
        store, index, n = handles.meet(listener, 7, [hub_handle, listener.handle], 20)
        assert (index, n) == (1, 2)
        hub_index, _, child = map(int, hub.stdout.readline().split())
        assert hub_index == 0
        hub.kill()
        hub.wait()
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="closed the connection"):
            store.get("never set")
        assert time.monotonic() - start < 10   # (the child sleeps 60 s; the store's deadline is 20 s)
        store.close(made=False)
    finally:
        hub.kill()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        listener.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("when", ["before", "making"])
def test_a_member_that_dies_in_a_reconfigure_is_named_at_once(when, transport):
    """tests/faults/reconfigure_member_dies.py: rank 2 of 3 dies (SIGKILL) before it reconfigures (its
    handle then refuses connections: the hub's probe finds it) or inside the new group's making (its
    connection to the hub closes before it said it was done). The hub and the other member fail within
    seconds, not at the reconfigure's 40 s, naming member 2; then the two reconfigure alone and sum.
    (Here, not in test_fault_tolerance.py: the meeting is the engine's own, the same on every torch.)"""
    out = spawned("reconfigure_member_dies.py", when, transport, timeout=150)
    assert "exit codes [0, 0, -9]" in out, out[-5000:]
    failed = dict(re.findall(r"rank (\d): failed after ([\d.]+) s: RuntimeError: engine reconfigure 1 of group "
                             r"'0': .*member 2 \(", out))
    assert sorted(failed) == ["0", "1"], out[-5000:]
    assert all(float(s) < 10 for s in failed.values()), out[-5000:]
    expected = "is gone: its handle refuses connections" if when == "before" else \
        "closed its connection before the group was made"
    assert expected in out, out[-5000:]
    for rank in (0, 1):
        assert f"rank {rank}: the two reconfigured and summed" in out, out[-5000:]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("dead,when", [(2, "before"), (0, "before"), (2, "broken")])
def test_a_group_made_with_a_member_known_lost_fails_at_once_naming_it(dead, when, transport):
    """tests/faults/lost_member.py: rank `dead` of 3 dies (SIGKILL) once the world is made; then the
    other two wait in turn for members that include it: a monitored barrier (rank 0 waiting for the
    others' arrival, or they for rank 0's; with rank 2 dead, rank 1 comes only once rank 0 is through,
    so rank 0 names rank 2 while it waits for rank 1), one with wait_all_ranks, new_group, split_group
    and an engine subgroup, each with a timeout of 40 s. Each waited its whole timeout, then named the dead
    rank as one that did not come; the world's transport knows it is lost (its process is gone; over
    TCP, its connection ended without a goodbye), and each now fails at once naming it. The message
    says so (at the timeout it says "did not come" or "Timed out"); then the two make a group of their
    own and sum on it. "broken": rank 2 dies only once the world broke (a mismatch), where over TCP the
    world's collectives' channel had said its goodbye to every peer and saw no loss after it: its
    user's channel, connected with the group's mesh and going on, sees it (split_group left out:
    torch splits no broken group)."""
    out = spawned("lost_member.py", transport, dead, when, timeout=400)
    assert f"exit codes {[-9 if r == dead else 0 for r in range(3)]}" in out, out[-5000:]
    how = re.escape("(its process exited)" if transport == "shm" else
                    "(its connection to this rank ended without a goodbye: its process exited, or the link to it is "
                    "cut)")
    if dead == 0:   # (the others wait for rank 0)
        barrier = barrier_all = rf"RuntimeError: Rank [12] successfully reached monitoredBarrier, .*: rank 0 is " \
                                rf"lost {how}"
    else:           # (rank 0 waits for it, and tells the other)
        opening = r"RuntimeError: .*\[Rank 0\]: "
        barrier = opening + rf"Rank 2 failed to pass monitoredBarrier in 40000 ms: it is lost {how}"
        barrier_all = opening + rf"Ranks 2 failed to pass monitoredBarrier in 40000 ms: rank 2 is lost {how}"
    made = rf"EnginePeerLost: .*: rank {dead} of \[0, 1, 2\] is lost to group '0', the group this one is made " \
           rf"from {how}"
    for rank in set(range(3)) - {dead}:
        said = dict(re.findall(rf"rank {rank}: (\w+) after [\d.]+ s: (.*)", out))
        steps = dict(barrier=barrier, barrier_all=barrier_all, new_group=made, split=made, subgroup=made)
        if when == "broken":
            assert f"rank {rank}: the world broke" in out, out[-5000:]
            del steps["split"]
        assert sorted(said) == sorted(steps), out[-5000:]
        for what, expected in steps.items():
            assert re.match(expected, said[what]), (what, said[what])
        assert f"rank {rank}: the two made a group and summed" in out, out[-5000:]


@pytest.mark.parametrize("dead", [0, 2])
def test_a_rank_that_dies_while_the_ranks_connect_over_tcp_ends_the_others_at_once(dead):
    """tests/faults/lost_member.py connect: a rank of a TCP world dies (SIGKILL) once its end is made,
    before it connects. The others fail within seconds, not at the world's 40 s: a rank that waited on
    it names it, its connection closed or refused (or its end not made); a rank that waited on one of
    those names that one, which left (the connecting's first failure closes its sockets)."""
    out = spawned("lost_member.py", "tcp", dead, "connect", timeout=400)
    assert f"exit codes {[-9 if r == dead else 0 for r in range(3)]}" in out, out[-5000:]
    said = dict((int(r), (float(s), msg)) for r, s, msg in re.findall(r"rank (\d): connect after ([\d.]+) s: (.*)", out))
    assert sorted(said) == sorted(set(range(3)) - {dead}), out[-5000:]
    assert all(s < 10 and re.match(r"RuntimeError: engine: connecting the group's ranks over TCP failed: (could not "
                                   r"connect to )?rank \d \(", msg) for s, msg in said.values()), said
    assert any(re.search(rf"rank {dead} \(.*\) .*\(or it failed to make its end of the group, "
                         r"and closed its sockets: its own error says why\)", msg) for _, msg in said.values()), said


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("first", ["new_group", "subgroup"])
def test_a_member_lost_while_a_new_group_or_subgroup_is_made_fails_the_others_at_once_naming_it(first, transport):
    """tests/faults/lost_member.py making_new_group|making_subgroup: rank 2 dies (SIGKILL) inside the
    making of new_group([0, 1, 2]) or of the world's engine subgroup of the three, once the members
    agreed on them. The others waited for it in the new group's first exchange until the group's
    timeout (40 s; a new_group's default is torch's 30 minutes); they now end at once naming it, as a
    split's making does. The other making then fails at once too: the world knew it lost the rank."""
    out = spawned("lost_member.py", transport, 2, f"making_{first}", timeout=400)
    assert "exit codes [0, 0, -9]" in out, out[-5000:]
    group = {"new_group": "'1'", "subgroup": "'all-three'"}
    made = {"new_group": r"engine new_group '1'", "subgroup": r"engine subgroup 'all-three'"}
    second = "subgroup" if first == "new_group" else "new_group"
    for rank in (0, 1):
        said = {what: (float(after), msg) for what, after, msg in re.findall(rf"rank {rank}: (\w+) after ([\d.]+) s: (.*)", out)}
        assert sorted(said) == sorted([first, second]), out[-5000:]
        # (its own transport's word, or, where it had not seen the loss yet, that of the member that saw it)
        assert said[first][0] < 10 and re.match(rf"(EnginePeerLost: engine: |\w+: .*rank [01] gave this making up while "
                                                rf"this rank waited \()rank 2 of 3 is lost while group {group[first]} is "
                                                r"made \(rank 2 of group '0': its ", said[first][1]), said
        assert re.match(rf"EnginePeerLost: {made[second]}: rank 2 of \[0, 1, 2\] is lost to group '0', the group this "
                        r"one is made from \(its ", said[second][1]), said
        assert f"rank {rank}: the two made a group and summed" in out, out[-5000:]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("when", ["making", "shrink", "shrink_abort"])
def test_a_member_lost_while_a_split_or_shrink_is_made_fails_the_others_at_once_naming_it(when, transport):
    """tests/faults/lost_member.py making|shrink|shrink_abort: a member dies (SIGKILL) inside the making
    of the world's split_group([0, 1, 2]) (rank 2, after the members agreed on them) or of its shrink([2])
    (rank 1; rank 2, left out, stays alive), with SHRINK_ABORT too. The others waited for it in the new
    group's first exchange until the timeout (40 s) and said it never joined; the world's transport
    knows it lost the rank, and the making, which looks between its waits in the store, now ends at
    once naming it. SHRINK_ABORT freed the world before the making, which then waited the timeout."""
    dead = 2 if when == "making" else 1
    out = spawned("lost_member.py", transport, dead, when, timeout=400)
    assert f"exit codes {[-9 if r == dead else 0 for r in range(3)]}" in out, out[-5000:]
    # (its own transport's word, or, where it had not seen the loss yet, that of the member that saw it)
    told = r"(engine: |.*rank [01] gave this making up while this rank waited \()"
    expected = (r"\w+: engine split of process group '0' into ranks \[0, 1, 2\]: " + told + "rank 2 of 3 is "
                r"lost while group '0:split-1' is made \(rank 2 of group '0': its " if when == "making" else
                r"EnginePeerLost: engine shrink of process group '0' without ranks \[2\]: engine: rank 1 of 2 is lost "
                r"while group '0:shrunk-1' is made \(rank 1 of group '0': its ")
    for rank in (0, 1) if when == "making" else (0,):
        said = re.findall(rf"rank {rank}: (\w+) after [\d.]+ s: (.*)", out)
        assert [what for what, _ in said] == ["split" if when == "making" else "shrink"], out[-5000:]
        assert re.match(expected, said[0][1]), said
    for rank in set(range(3)) - {dead}:
        assert f"rank {rank}: the two made a group and summed" in out, out[-5000:]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_member_that_comes_after_the_others_gave_the_making_up_fails_at_once_and_the_next_making_meets(transport):
    """tests/faults/late_member.py: ranks 0 and 1 give up making a group of four (timeout 1 s); rank 2
    makes it only then, and rank 3 after rank 2 failed. Rank 3 found their lists in the store and
    waited for them in the group's bootstrap until its own timeout (40 s), saying they never joined;
    rank 2 waited for rank 3's list until its timeout, saying it never came. Both fail at once, saying
    the others gave the making up. Then all four make the group again, and it meets: for an engine
    subgroup and for torch's new_group. Ranks that came in time but wait longer than a member that
    gave up (timeout 40 s against rank 0's 1 s) fail once it gave up, saying so ("waited")."""
    out = spawned("late_member.py", transport, timeout=300)
    assert "exit codes [0, 0, 0, 0]" in out, out[-5000:]
    subgroup, new_group = "engine subgroup 'late'", r"engine new_group '\d+'"
    # (the making, the rank, its group's name, when the others gave up, which rank gave up, for which ranks)
    told = [("subgroup", 2, subgroup, "before this rank came", "[01]", "2, 3"), ("subgroup", 3, subgroup,
             "before this rank came", "[01]", "2, 3"), ("new_group", 2, new_group, "before this rank came", "[01]",
             "2, 3"), ("new_group", 3, new_group, "before this rank came", "[01]", "2, 3"),
            ("waited", 1, subgroup, "while this rank waited", "0", "3"), ("waited", 2, subgroup,
             "while this rank waited", "0", "3"), ("waited", 3, subgroup, "before this rank came", "0", "3")]
    for what, rank, named, when, giver, absent in told:
        said = re.findall(rf"rank {rank}: {what} after [\d.]+ s: (.*)", out)
        assert len(said) == 1 and re.match(rf"MakingGivenUp: {named}: rank {giver} gave this making up {when} \(it "
                                           rf"waited 1 s for ranks \[{absent}\]\)", said[0]), (rank, what, out[-5000:])
    for what in ("subgroup", "new_group", "waited"):
        assert sorted(re.findall(rf"rank (\d): {what} made again and summed", out)) == ["0", "1", "2", "3"], out[-5000:]


@pytest.mark.parametrize("transport, recover, nranks", [("shm", "shrink", 3), ("mpi", "shrink", 3), ("shm", "world", 3),
                                                      ("mpi", "world", 3), ("shm", "abort", 3), ("shm", "shrink", 4)],
                         ids=["shm-shrink", "mpi-shrink", "shm-world", "mpi-world", "shm-abort-then-shrink",
                              "shm-shrink-of-a-hierarchy"])
def test_a_failed_subgroup_replaced_by_a_shrink_lets_the_job_end_normally(transport, recover, nranks):
    """Under MPI a rank whose group failed aborts the job at exit, unless the group was replaced: a
    subgroup's shrink replaces it, as a reconfigure of the world does, and so does a world of every rank
    made again after the old one was destroyed (tests/faults/recovered_subgroup.py); a shrink after the
    subgroup's abort() too, and one of a subgroup whose timeout was a stage's of its hierarchy (4 ranks
    on two forced sockets): each failure was still counted, and the job was aborted at exit."""
    proc, out = launch("recovered_subgroup.py", nranks, 120, ENGINE_TRANSPORT=transport, RECOVER=recover,
                       **({"ENGINE_SOCKETS": "2"} if nranks == 4 else {}))
    assert proc.returncode == 0 and "aborting the job" not in out, out[-3000:]
    assert sorted(re.findall(r"rank (\d): recovered", out)) == [str(r) for r in range(nranks)], out[-3000:]


def test_a_rank_that_fails_to_make_its_tcp_end_ends_the_others_at_once():
    """tests/faults/tcp_end_fails.py at 3 ranks: rank 1's TCP transport can't be made after the
    addresses went round (injected). Ranks 0 and 2 fail within seconds, not at the group's 60 s,
    naming rank 1 and that it could not make its end (told through the bootstrap: from its closed
    sockets alone, the rank that saw them first failed and left, and under load the last rank named
    that one instead)."""
    proc, out = launch("tcp_end_fails.py", 3, 90)
    assert proc.returncode == 0, out[-5000:]
    said = {int(r): (float(s), rest) for r, s, rest in
            re.findall(r"rank (\d): ([\d.]+) (\w+ [-\w]+ [-\w]+)", proc.stdout)}
    assert sorted(said) == [0, 1, 2], out[-5000:]
    assert said[1][1] == "MemoryError - -", out[-5000:]
    for r in (0, 2):
        seconds, what = said[r]
        assert seconds < 5 and what == "RuntimeError rank-1 its-end", out[-5000:]


def test_ranks_with_different_settings_refuse_the_group_naming_the_setting():
    """tests/faults/mismatched_settings.py at 4 ranks, two forced sockets: rank 0 alone sets a variable
    the group's transport, plan or messages are made of (a two-shot step size once returned a wrong
    sum; a ring segment, MPI's tags or pieces, debug mode, the levels, the transport or TCP's
    connections hung or failed inside the call). Every rank refuses the group when it is made, naming
    the variable and both values; ranks whose plans differ (one rank's threads) refuse it before any
    stage is made (tests/test_shm_without_mpi.py: a stage one rank can't make fails the group on every
    rank); a rank that can't read its settings is named by the others; a rank's own thread slices
    may differ. A value one rank can't use fails every rank, naming it. Then groups every rank agrees
    on sum right, and nothing is left in /dev/shm."""
    from faults.mismatched_settings import check
    before = shm_files()
    proc, out = launch("mismatched_settings.py", 4, 120, ENGINE_SOCKETS="2")
    assert proc.returncode == 0, out[-5000:]
    check(out, mpi=True)
    assert shm_files() <= before


def gone_soon(pid, seconds=5.0):
    """Whether process `pid` is gone (or a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


def test_a_launcher_left_without_ranks_is_ended_with_what_they_wrote(monkeypatch, tmp_path):
    """tests/mpirun.run_launcher against Open MPI's deadlock after MPI_Abort (prterun staying once its
    ranks are gone): a stand-in launcher whose one child wrote and exited, while it stays, is killed
    LAUNCHER_ORPHANED_S later, its child's output kept; one whose child still runs meets the timeout,
    unless a rank's MPI_Abort was seen LAUNCHER_ABORT_STALL_S before (the deadlock before the ranks went).
    The timeout, or the test ending by an exception, kills the launcher's "ranks" too, in a session of
    their own or not."""
    import mpirun
    monkeypatch.setattr(mpirun, "LAUNCHER_ORPHANED_S", 1.0)
    proc = run_launcher(["bash", "-c", "sh -c 'echo rank output; sleep 2'; exec sleep 60"], timeout=30, mpi=True)
    assert proc.returncode == -signal.SIGKILL and proc.stdout == "rank output\n", proc
    assert "the launcher was killed 1 s after its last rank exited" in proc.stderr, proc.stderr
    assert 1.0 < proc.ranks_gone_s < 2.0, proc.ranks_gone_s   # (half-second polls)
    # Not so another launcher (torchrun), which may have no child for a while: a restart's next attempt.
    proc = run_launcher(["bash", "-c", "sh -c 'echo attempt 1'; sleep 2; echo attempt 2"], timeout=30)
    assert proc.returncode == 0 and proc.stdout == "attempt 1\nattempt 2\n", proc
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_launcher(["bash", "-c", "echo so far; sleep 60 & echo $!; setsid sleep 60 & echo $!; wait"], timeout=3)
    said, *ranks = timed_out.value.output.splitlines()
    assert said == "so far" and len(ranks) == 2, timed_out.value.output
    for rank in ranks:   # (the second in a session of its own, as torchrun starts its workers)
        assert gone_soon(int(rank)), f"the launcher's child {rank} outlived the timeout"
    # An interrupted test (Ctrl-C, SIGTERM: tests/conftest.py) ends the job whole too.
    pid_file = tmp_path / "rank.pid"

    def interrupted(pid):
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text().strip():
                raise KeyboardInterrupt
            time.sleep(0.05)
        raise AssertionError("the stand-in launcher never started its child")
    with monkeypatch.context() as patched:
        patched.setattr(mpirun, "_children", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_launcher(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=30, mpi=True)
    rank = int(pid_file.read_text())
    assert gone_soon(rank), f"the launcher's child {rank} outlived the interrupted test"
    # The deadlock before the ranks were ended: a job in its own session still running
    # LAUNCHER_ABORT_STALL_S after a rank's MPI_Abort banner is killed whole, its output kept.
    monkeypatch.setattr(mpirun, "LAUNCHER_ABORT_STALL_S", 1.0)
    proc = run_launcher(["bash", "-c", "sleep 60 & echo $!; echo 'MPI_ABORT was invoked on rank 0 in' >&2; wait"],
                        timeout=30, mpi=True)
    rank = int(proc.stdout)
    assert proc.returncode == -signal.SIGKILL and "killed, ranks included, 1 s after a rank's MPI_Abort" in proc.stderr
    assert re.search(rf"still running: .*\b{rank} S \w+: sleep 60", proc.abort_stalled), proc.abort_stalled
    assert gone_soon(rank), f"the launcher's child {rank} outlived the stalled abort"


def _failure_of(launch):
    """The text a launch expected to fail its test (pytest.fail) fails it with."""
    try:
        done = launch()
    except pytest.fail.Exception as failed:
        return launcher_output(str(failed))
    done = done[0] if isinstance(done, tuple) else done
    pytest.fail(f"the launch ended by itself (exit {done.returncode}):\n{suite_report(done.stdout, done.stderr)}")


LATE = 20


def test_a_launch_past_its_timeout_shows_where_each_rank_waited():
    """A suite's launch past its timeout (tests/mpirun.py: run_pytest; under torchrun too), and a fault
    script's (run_job), fail with every rank's threads' stacks, each rank's once: only the ranks are
    asked for them, not Open MPI's launcher and daemons, which would pass the signal on to the ranks
    again, nor torchrun's agent. A suite's ranks print them by faulthandler (tests/mpi/conftest.py, to
    the stderr pytest captures around its tests); a script's by the engine's own SIGUSR1 dump, its
    flight recorders after them. Then no rank is left. (The three launches run side by side: they only
    wait, once their 7 processes have started and caught the signal, within LATE s on a busy machine.)"""
    suite = os.path.join(os.path.dirname(HERE), "mpi", "hang_suite.py")
    in_suite, in_script = r'hang_suite.py", line \d+ in test_waits_for_ever', r'stalled.py", line \d+ in <module>'
    mpi_tag = "[1,{rank}]<stderr>: " if under_open_mpi() else ""
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        launches = [(pool.submit(_failure_of, lambda: run_pytest(2, suite, timeout=LATE)), in_suite, mpi_tag),
                    (pool.submit(_failure_of, lambda: torchrun.run_pytest(2, suite, timeout=LATE)), in_suite,
                     "[default{rank}]:"),
                    (pool.submit(_failure_of, lambda: launch("stalled.py", 2, LATE, ENGINE_TIMEOUT="600")),
                     in_script, mpi_tag)]
        for failed, frame, tag in launches:
            said = failed.result()
            assert f"the job still ran after {LATE} s (killed)" in said and "2 of its processes were asked" in said, said
            stacks = said.split("--- the ranks' threads' stacks at the timeout:")[1]
            assert len(re.findall(r"Current thread 0x", stacks)) == 2, stacks
            assert len(re.findall(frame, stacks)) == 2, stacks
            assert len(re.findall(r'threading.py", line \d+ in wait', stacks)) >= 2, stacks
            for rank in (0, 1):
                assert tag.format(rank=rank) + "Current thread" in stacks, stacks
    said = launches[2][0].result()
    assert "rank 0: made" in said and "rank 1: made" in said, said
    assert re.search(r"flight recorder of group '[^']*', rank 0 of 2: SIGUSR1", said), said
    assert re.search(r"engine:   #1 +allreduce +4 float32 .* running$", said, re.M), said
    for path in (suite, os.path.join(HERE, "stalled.py")):
        assert not subprocess.run(["pgrep", "-f", path], capture_output=True).stdout, "a rank outlived the timeout"
