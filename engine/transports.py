"""The transports, one factory each, picked by name: a group's transport (bootstrap.choose_transport)
opens its compiled core here, and nothing in the communicator knows a transport by name. Each says
what an algorithm may count on (caps: single copy), whether its bytes cross the network (waits leave a
core to the kernel's network processing, and a group spanning hosts may run in two levels), and which
MPI communicators the group owns.

- shm: one shared-memory segment on one host (engine._core.ShmComm; the segment: engine.bootstrap);
- tcp: the engine's own sockets between hosts (engine._core.TcpComm; the mesh: engine.tcp);
- mpi: MPI under an MPI launcher (engine._mpi.MpiComm, over three duplicates of the group's communicator).
"""

import atexit
import os
import sys
import weakref
from collections import namedtuple

from . import _core, registry
from .bootstrap import MpiBootstrap, local_cores, make_segment, segment_settings
from .config import env_int
from .launcher import local_size


# A transport's core for one group: core, caps (set), mpi_comms (the group's, freed with it) and agreed:
# settings of its own, beyond the registry's, that shape its messages ({variable: value}), which the
# group's ranks must share (engine.communicator compares them).
Opened = namedtuple("Opened", "core caps mpi_comms agreed")


def forced_threads():
    """ENGINE_THREADS: the threads a rank's large blocking reductions split over (0: automatic)."""
    forced = env_int("ENGINE_THREADS", 0)
    if forced:
        _core.check_threads(forced, "ENGINE_THREADS", " (0 or unset: automatic)")
    return forced


def threads(everyone, rank, forced):
    """(threads this rank's large blocking reductions split over, whether the group has "threads"):
    ENGINE_THREADS where set; else the cores this host's ranks may use, shared out among the job's
    processes on the host (the launcher's local size where larger than the group's: a subgroup's
    ranks share the host with the rest of the job), at most torch's intra-op threads where torch is
    loaded. The second reads only what every rank of the group sees, so every rank walks the same
    rules; the count may differ between ranks (it only splits each rank's own kernel calls). forced:
    forced_threads()."""
    if forced:
        return forced, forced > 1
    local, cores = local_cores(everyone, rank)
    share = cores // len(local)
    mine = cores // max(len(local), local_size() or 0)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        mine = min(mine, torch.get_num_threads())
    return max(1, mine), share > 1


class _Transport:
    # settings(): the transport's settings, read before the group's first exchange (which carries a
    # rank's failure to read them to every rank), for open(..., cfg), whose exchanges then find every
    # rank there.
    mpi_comms = 1    # MPI communicators of the group's ranks it needs under MPI (the first: mpi_comm's)

    @classmethod
    def open(cls, boot, everyone, seg_bytes, timeout, owned, parent, cfg):
        """The transport's core for the group, as Opened. Under MPI its communicators come first: a
        Dup is a collective of MPI's own, which a rank that failed alone (what fails after this
        goes round in the group's next exchange) must not leave the others waiting in."""
        comms = []
        if isinstance(boot, MpiBootstrap):
            from . import mpi
            MPI = mpi.load()
            comms = [owned if owned is not None else boot.dup()]
            comms += [boot.dup() for _ in range(cls.mpi_comms - 1)]
            for c in comms:
                c.Set_errhandler(MPI.ERRORS_RETURN)
        elif owned is not None:
            comms = [owned]
        try:
            core, caps, agreed = cls._open(boot, everyone, seg_bytes, timeout, parent, cfg, comms)
        except BaseException:
            for c in comms:
                if c is not owned:
                    c.Free()
            raise
        return Opened(core, caps, comms, agreed)

    @staticmethod
    def configure(core, plan):
        """The plan's settings the transport itself reads, beyond the rules the core takes: none by default."""

    @staticmethod
    def lost(core):
        """{rank: how it was lost} of the group's peers this transport knows to be gone, looked at now;
        None where it can't tell (MPI: a dead process ends its job, or ULFM reports it to a call)."""
        return None


# Every live core whose peers tell a departure from a crash (shared memory's segment word, TCP's goodbye),
# told to leave its group when the process ends normally (an unhandled exception included): a rank that
# did its part and ended, while its peers still finish that collective, must not look like a crash to
# them. SIGKILL or os._exit skip this, and the peers see a crash. Only the process that made a core
# leaves through it (a fork's copy is the parent's: TCP's are inert there, shared memory's are not).
_leaving = weakref.WeakKeyDictionary()   # core: the pid of the process that made it


def leaves_at_exit(core):
    _leaving[core] = os.getpid()


def _leave_at_exit():
    for core, pid in list(_leaving.items()):
        if pid == os.getpid():
            core.leave()


atexit.register(_leave_at_exit)   # (in a fork too: its own groups leave, its copies of the parent's not)


class Shm(_Transport):
    network = False

    @staticmethod
    def settings():
        return dict(segment_settings(), chunk=registry.SHM_CHUNK.value(), pull_piece=registry.SHM_PULL_PIECE.value(),
                    thread_slice=registry.SHM_THREAD_SLICE.value(), threads=forced_threads())

    @staticmethod
    def _open(boot, everyone, seg_bytes, timeout, parent, cfg, comms):
        seg = make_segment(boot, everyone, cfg)
        core = _core.ShmComm(seg, seg_bytes, cfg["chunk"])
        leaves_at_exit(core)
        core.pull_piece = cfg["pull_piece"]
        count, has = threads(everyone, boot.rank, cfg["threads"])
        core.set_threads(count)
        core.thread_slice = cfg["thread_slice"]
        caps = ({"single_copy"} if seg.cma else set()) | ({"threads"} if has else set())
        return core, caps, {}

    @staticmethod
    def configure(core, plan):
        """Point-to-point's single-copy range, which the transport reads per message: the sizes whose
        first sendrecv rule is single copy (a rule ahead of it, forced or tuned, takes its sizes)."""
        ranges = plan.sizes_running("sendrecv", _core.Impl.SINGLE_COPY, core.size)
        if len(ranges) > 1:
            raise ValueError(f"the sendrecv rules give single copy {len(ranges)} ranges of sizes ({ranges}); the "
                             "shared-memory transport moves one range by single copy: make the tuning file's "
                             "sendrecv rules leave it one")
        core.seg.set_cma(core.seg.cma, *(ranges[0] if ranges else (registry.EVERY, 0)))

    @staticmethod
    def lost(core):
        return {q: "its process exited" for q in core.seg.lost()}


class Tcp(_Transport):
    network = True

    @staticmethod
    def settings():
        from . import tcp
        return tcp.settings()

    @staticmethod
    def _open(boot, everyone, seg_bytes, timeout, parent, cfg, comms):
        from . import tcp
        return tcp.make_core(boot, seg_bytes, timeout, parent, cfg, [h for h, _, _ in everyone]), set(), {}

    @staticmethod
    def lost(core):
        # (either channel's: the collectives' says its goodbye where the group broke, the user's goes on;
        # ENGINE_TCP_CONNECT=lazy: once one connected)
        return {q: "its connection to this rank ended without a goodbye: its process exited, or the link to it "
                   "is cut" for q in {*core.algo_transport.lost(), *core.user_transport.lost()}}


class Mpi(_Transport):
    network = True
    mpi_comms = 3    # the collectives', the user's point-to-point and the algorithms' own messages never mix

    @staticmethod
    def settings():
        # ENGINE_MPI_TAG_UB below MPI's own: run as over an MPI whose tags have fewer bits (the tests do)
        from . import mpi
        return dict(tag_ub=min(env_int("ENGINE_MPI_TAG_UB", 0, minimum=0), 2**31 - 1), chunk=registry.MPI_CHUNK.value(),
                    any_source_by_probe=mpi.any_source_by_probe(mpi.load().Get_library_version()))

    @staticmethod
    def _open(boot, everyone, seg_bytes, timeout, parent, cfg, comms):
        from . import mpi
        core = mpi.core().MpiComm(*comms, seg_bytes, cfg["tag_ub"])
        core.set_chunk(cfg["chunk"])
        core.set_any_source_by_probe(cfg["any_source_by_probe"])
        # (named as the variable's values are, where ranks differ: _agreed prints them)
        return core, set(), {"ENGINE_MPI_TAG_UB": cfg["tag_ub"] or "unset",
                             "ENGINE_MPI_ANY_SOURCE": "probe" if cfg["any_source_by_probe"] else "post"}


TRANSPORTS = {"shm": Shm, "tcp": Tcp, "mpi": Mpi}
