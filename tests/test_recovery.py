"""Recovery as launchers see it: torchrun restarting a job after a SIGKILLed rank, an abort that ends a
blocked call under torchrun (shared memory, TCP) and mpirun (shared memory, MPI's point-to-point), from
another thread or a signal handler, and a process that makes, reconfigures and destroys groups over and
over without keeping a descriptor, a thread or memory of any of them."""

import os
import re
import subprocess
import sys

import pytest

from mpirun import mpi_env, mpiexec_command, run_launcher
from ports import free_ports
from torchrun import clean_env, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
FAULTS = os.path.join(HERE, "faults")


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_torchrun_restart_after_a_killed_rank_trains_like_one_process(rendezvous):
    """`torchrun --max-restarts 1`: rank 1 SIGKILLs itself at step 2 of the first attempt; the second
    attempt meets through the same store (its agent's) and must not read the first one's keys."""
    before = set(os.listdir("/dev/shm"))
    port = free_port()
    where = (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"] if rendezvous == "c10d"
             else ["--master-addr", "127.0.0.1", "--master-port", str(port)])
    proc = run_launcher([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                         "1", *where, os.path.join(FAULTS, "restarted_ddp.py")], 240, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    found = re.findall(r"attempt (\d+): largest difference from one process (\S+) \(2 ranks", out)
    assert [a for a, _ in found] == ["1"], out[-6000:]
    assert float(found[0][1]) <= 1e-6, found
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("engine")], os.listdir("/dev/shm")


# One line a waiting rank (tests/faults/abort_blocked.py); two ranks' lines may come joined (print's
# newline is a write of its own), so a message ends where the next line starts.
_ABORT_LINE = re.compile(r"abort: rank (\d+) (\S+) over (\S+) ended (\S+) s after abort\(\) \((\w+)\): (\w+): "
                         r"(.*?)(?=abort: rank |$)", re.M)


def _abort_lines(out):
    return _ABORT_LINE.findall(out)


@pytest.mark.parametrize("launcher,transport,origin,op", [
    ("torchrun", "shm", "thread", "all_reduce"), ("torchrun", "shm", "signal", "all_reduce"),
    ("torchrun", "tcp", "thread", "all_reduce"), ("torchrun", "tcp", "thread", "recv"),
    ("mpirun", "shm", "thread", "all_reduce"), ("mpirun", "mpi", "thread", "recv"),
    ("mpirun", "mpi", "thread", "barrier"),  # MPI_Ibarrier: MPI's own collective, waited on by the engine
])
def test_abort_ends_a_call_blocked_on_a_rank_that_never_arrives(launcher, transport, origin, op):
    """3 ranks: the last never joins; 1 s in, abort() (from a thread, or a SIGUSR1 handler) must end the
    others' call within 1 s, naming the abort; then a reconfigure of all three recovers the group."""
    script = os.path.join(FAULTS, "abort_blocked.py")
    extra = {"ENGINE_TRANSPORT": transport, "ABORT_FROM": origin, "ABORT_OP": op}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), script]
        env = clean_env(**extra)
    else:
        cmd = mpiexec_command(3) + [sys.executable, script]
        env = {**mpi_env(), **extra}
    proc = run_launcher(cmd, 180, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    lines = _abort_lines(out)
    assert sorted(int(r) for r, *_ in lines) == [0, 1], out[-6000:]
    print(f"abort {launcher} {transport} {origin} {op}: seconds from abort() to the call's end",
          sorted(float(seconds) for _, _, _, seconds, *_ in lines))   # (shown by pytest -rA)
    for rank, what, over, seconds, how, error, text in lines:
        assert (what, over, how) == (op, transport, origin)
        # aborted, or told first that a peer aborting at the same moment gave the group up (TCP's goodbye,
        # shared memory's gave-up word; MPI has neither)
        assert error == "EngineAborted" or (transport != "mpi" and error == "EnginePeerLost"
                                            and "gave the group up" in text), \
            out[-3000:]
        assert float(seconds) < 1.0, lines
    assert out.count("reconfigured after abort") == 3, out[-3000:]


# A leak shows from the third cycle on (descriptors and threads exactly; memory past 4 MiB).
CYCLES = 10


@pytest.mark.parametrize("transport,hold", [("shm", False), ("tcp", False), ("shm", True), ("tcp", True)],
                         ids=["shm", "tcp", "shm-held", "tcp-held"])
def test_init_destroy_and_reconfigure_cycles_keep_nothing(transport, hold):
    """CYCLES cycles of init_process_group (a new TCPStore each) + all_reduce + new_group + destroy,
    then CYCLES reconfigures of one group, 2 ranks: descriptors and threads no fewer after any cycle from
    the second on than after the last (no growth; one cycle's end may still be closing a connection),
    resident memory within 4 MiB of the second's. hold: the collector off, CYCLES new_group
    + destroy cycles in one default group, each destroyed group still referenced (a segment or a TCP channel
    freed only at collection fails it), then the reconfigures."""
    ports = ",".join(map(str, free_ports(CYCLES + 1)))   # a TCPStore a cycle, and the reconfigures'
    script = os.path.join(FAULTS, "cycles.py")
    env = clean_env()
    env["CYCLES_HOLD"] = "1" if hold else "0"
    procs = [subprocess.Popen([sys.executable, script, str(r), "2", ports, str(CYCLES), transport], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-5000:]
        for kind in ("group" if hold else "init", "reconfigure"):
            rows = [tuple(map(int, m)) for m in
                    re.findall(rf"cycle {kind} \d+ fds (\d+) threads (\d+) tasks (\d+) rss_kib (\d+)", out)]
            assert len(rows) == CYCLES, out[-3000:]
            first, last = rows[1], rows[-1]   # (the first cycle may load what every later one reuses)
            for fds, threads, tasks, rss in rows[1:]:
                # what leaks grows from cycle to cycle, so the last cycle holds the most; a descriptor or
                # thread that a cycle's end had not closed yet (a connection closing, a helper leaving) is
                # counted in that cycle only, and the next ones hold less
                assert all(mine >= theirs for mine, theirs in zip((fds, threads, tasks), last[:3])), (kind, rows)
                assert abs(rss - first[3]) < 4096, (kind, rows)
