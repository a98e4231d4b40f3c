"""The failure policy of a process: which failures must end the whole job, and how it ends.

A rank that leaves after one of its groups failed (a timeout, a lost peer, a mismatch), after its
init_process_group failed, or through an exception nothing caught, would hang in MPI_Finalize, which
waits for every rank, while the others wait for it in their next collective (its process is alive, so
no peer sees it lost). Instead, after a short grace for the other ranks to report their own errors
(ENGINE_ABORT_GRACE_SECONDS, 2 s), it aborts the job: the launcher ends every rank, as it would have
had MPI not been up. A native MPI collective that passes the timeout aborts at once (engine.watch).

This module imports no MPI and nothing of the engine but its settings (engine.config) and engine.forks: engine.mpi
arms the policy (arm) when MPI starts, engine.watch reports group failures, torchbridge reports
failures at init.
"""

import contextlib
import math
import os
import signal
import sys
import threading
import time
import weakref

from . import forks
from .config import env_duration

_group_failure = []  # (weak reference to its source or None, why) of each failure of a group of this process
                     # (the first first; weak: a failed group's watch must still go with its group)
_retired = weakref.WeakSet()   # the sources replaced by a recovery (recovered)
_init_failure = []   # why init_process_group failed on this rank while MPI was up
_uncaught = []       # the exception that ended the script, noted by the interpreter's excepthook
_grace = [2.0]       # ENGINE_ABORT_GRACE_SECONDS (configure)
REPORT_FORWARD_SECONDS = 0.25   # abort's pause after its report, for the launcher to forward it
ABORT_STALL_SECONDS = 10        # an MPI_Abort still running this long is stalled: the process dies (_die_after)


def group_failed(why, source=None):
    """A group of this process failed (a timeout, a lost peer, a mismatch): the job ends at exit.
    source: what failed (the group's watch), unless a recovery replaced it: a call still running on
    a communicator a reconfigure took off its group fails that one, not the group."""
    if source is None or source not in _retired:
        _group_failure.append((None if source is None else weakref.ref(source), why))


def recovered(source=None):
    """source's group was replaced (a reconfigure or a shrink of it succeeded): its failures no longer
    end the job, nor do its later ones. None: the world was replaced: nothing is left to end the job
    for, whichever group failed before."""
    if source is None:
        _group_failure.clear()
        return
    _retired.add(source)
    _group_failure[:] = [(s, why) for s, why in _group_failure if s is None or s() is not source]


def failure():
    """The first group failure of this process, or None."""
    return _group_failure[0][1] if _group_failure else None


def init_failed(why):
    """init_process_group failed on this rank with MPI initialised (by the engine, or by the script or
    a library before it, as DeepSpeed's MPI discovery does): the other ranks may be waiting for this
    one, so at exit it aborts the job. A later init_process_group that succeeds withdraws it."""
    _init_failure[:] = [why]


def init_succeeded():
    _init_failure.clear()


def describe(exc):
    """An exception in one line: its type and its message's first line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def configure():
    """Reads ENGINE_ABORT_GRACE_SECONDS; engine.mpi calls it before MPI starts, so that a bad value is
    refused then, not at exit, where the error would skip the abort and leave the job waiting."""
    _grace[0] = env_duration("ENGINE_ABORT_GRACE_SECONDS", 2.0, maximum=3600.0)


def arm(MPI):
    """Called once MPI is up: the exit hook (registered after mpi4py's MPI_Finalize, so it runs
    first) and the note of an uncaught exception."""
    forks.at_exit(_at_exit, MPI)
    sys.excepthook = _noting_uncaught(sys.excepthook)


def _noting_uncaught(hook):
    """sys.excepthook, noting the exception first. The interpreter calls it only for an exception that
    nothing caught (sys.last_value would do, but pytest sets it for every failed test)."""
    def excepthook(kind, value, traceback):
        _uncaught[:] = [describe(value)]
        hook(kind, value, traceback)
    return excepthook


def _at_exit(MPI):
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    why, what = failure(), "a group failed"
    if why is None and MPI.COMM_WORLD.Get_size() > 1:  # a singleton has no one to wait for
        if _init_failure:
            why, what = _init_failure[0], "init_process_group failed"
        elif _uncaught:
            why, what = _uncaught[0], "an uncaught exception"
    if why is None:
        return
    time.sleep(_grace[0])
    abort(1, f"engine: rank {MPI.COMM_WORLD.Get_rank()} exits after {what} ({why}): aborting the job, after "
             f"{_grace[0]:g} s of grace (ENGINE_ABORT_GRACE_SECONDS), so that no rank waits for it forever")


@contextlib.contextmanager
def blocked_in(library, what, rank, seconds):
    """Around a call of `library`'s (MPI, NCCL) that nothing can interrupt, where a rank that never
    joins would leave the others in it for ever: the blocking collectives that make a group over MPI
    (a rank that skipped the making, or waits somewhere else), NCCL's communicator setup. Past
    `seconds` (None or inf: never) the job is aborted, as the watchdog aborts a collective blocked
    inside MPI (engine.watch). what: the call, for the report."""
    if seconds is None or not math.isfinite(seconds):
        yield
        return
    timer = threading.Timer(seconds, _blocked_too_long, (library, what, rank, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _blocked_too_long(library, what, rank, seconds):
    abort(3, f"engine: rank {rank}: {what}: Timed out after {seconds:g} s (timeout {seconds:g} s): a rank of the "
             "group never joined it (every member must make the group; one skipped it, or waits elsewhere); the "
             f"call is blocked inside {library} and cannot be interrupted: aborting the job")


def abort(code, report=None):
    """MPI_Abort, first unlinking the MPI's shared-memory segments: the launcher kills the ranks, and
    the segment of the rank that would have unlinked it at MPI_Finalize would stay in /dev/shm. Every
    process mapping them is part of this job, which is ending. Without MPI up: the process exits.
    report: the line saying why, written to stderr first; the launcher reads it from a pipe and may end
    the job before it has forwarded the line (MPICH's did), so the abort waits a moment after it."""
    if report is not None:
        print(report, file=sys.stderr, flush=True)
        sys.stdout.flush()
        time.sleep(REPORT_FORWARD_SECONDS)
    for path in _mpi_segments():
        try:
            os.unlink(path)
        except OSError:
            pass
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        sys.stderr.flush()
        os._exit(code)
    _die_after(ABORT_STALL_SECONDS)
    MPI.COMM_WORLD.Abort(code)


def _die_after(seconds):
    """SIGALRM, at its default action (the process ends), in `seconds`: the kernel's timer, which no
    lock of this process holds up. MPI_Abort asks the launcher to end the job and waits for it (Open
    MPI's PMIx_Abort, which has deadlocked before: open-mpi/ompi#3225); where that never returns, the
    process dies instead, and the launcher ends the job for a rank killed by a signal."""
    import ctypes   # (here: the abort path only)
    libc = ctypes.CDLL(None)
    libc.signal.argtypes, libc.signal.restype = (ctypes.c_int, ctypes.c_void_p), ctypes.c_void_p
    libc.signal(signal.SIGALRM, None)   # SIG_DFL, from any thread (a handler set in Python would wait
    libc.alarm(max(1, math.ceil(seconds)))   # for the main thread, which may be stuck; alarm(0) sets none)


def _mpi_segments():
    """The files of the MPI's shared memory this process maps (its own and its local peers'): Open
    MPI's shared-memory BTL, MPICH's ch4 shared memory."""
    try:
        with open("/proc/self/maps") as maps:
            fields = (line.split(None, 5) for line in maps)  # address perms offset dev inode [path]
            paths = {f[5].strip() for f in fields if len(f) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(("sm_segment.", "mpich_shm_")) and
                  p.startswith("/"))


def again(error):
    """error, a stored one (a task's, a Work's) about to be raised once more, with the traceback it had
    when first raised again: each raise adds the raising frames to its traceback, and a shared one (an
    abort's, the CUDA watchdog's, a failed Work waited on in a loop) would grow with every wait,
    keeping every waiter's frames, and their tensors, alive."""
    first = error.__dict__.setdefault("_engine_first_traceback", error.__traceback__)
    return error.with_traceback(first)
