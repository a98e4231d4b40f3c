"""Communicator: collectives and point-to-point on any CPU buffer, over one group of ranks.

Buffers are numpy arrays, torch CPU tensors, bytearrays or DLPack objects, read without copies.
Output arguments are written in place; a missing recvbuf means "in place on sendbuf" where that is
allowed. Every transfer and kernel runs without the GIL. Whatever the group's transport (engine/transports.py),
one compiled core parses buffers, checks arguments and records every operation for the group's Watch
(engine/watch.py). With ENGINE_DEBUG=1 each collective's signature is compared across ranks first.
"""

import contextlib
import operator
import os
import secrets
import weakref
import zlib

import numpy as np

from . import _core, failure, forks, fusion, hierarchy, registry
from .bootstrap import (MissingRanks, MpiBootstrap, SelfBootstrap, StoreBootstrap, agree_on_members, choose_transport,
                        gather, host_identity, interhost, local_cores, possible_transports, requested_transport)
from .config import cuda_transport, env_duration, env_flag
from .ops import ReduceOp, op_code
from .transports import TRANSPORTS
from .watch import StoreWithin, Watch

ANY_SOURCE = -1
ANY_TAG = -1
_OP_IDS = {name: i for i, name in enumerate(_core.OP_KIND_NAMES)}
_SIG_LEN = 12  # op, dtype, count, root, reduce op, seq, ndim, 5 dims
# Where a setting _agreed() names comes from when it is not the variable itself.
_HINTS = {"ENGINE_DEBUG": " (debug mode: ENGINE_DEBUG=1 or TORCH_DISTRIBUTED_DEBUG=DETAIL)",
          "ENGINE_RING_SEGMENT_BYTES": " (or Communicator(ring_segment_bytes=...))",
          "engine.__version__": " (install the same engine on every host)",
          "ENGINE_MPI_ANY_SOURCE": " (unset: probe under MPICH's UCX network module only, else post)",
          "the group's size": " (WORLD_SIZE, or the world_size given to init_process_group or from_store)"}


def _opening(transport, ring_segment_bytes, size):
    """What decides how a group opens: a rank opening shared memory while another opens sockets, or
    connecting every socket while another waits for the first message, would wait for ever. Ranks of
    another engine release may cut, tag or lay out the same call differently. A rank told a larger
    group than the others (its WORLD_SIZE) reads their parts as well as its own: it names the size."""
    from . import __version__
    from .tcp import connect_mode
    return {"engine.__version__": __version__, "the group's size": size,
            "ENGINE_TRANSPORT": requested_transport(transport), "ENGINE_INTERHOST": interhost(),
            "ENGINE_TCP_CONNECT": connect_mode(), "ENGINE_SOCKETS": hierarchy.forced_sockets(),
            "ENGINE_RING_SEGMENT_BYTES": registry.RING_SEGMENT.value() if ring_segment_bytes is None else
            registry.RING_SEGMENT.given(ring_segment_bytes, "ring_segment_bytes")}


def _root_word(root):
    """A root as debug mode's signature holds it: one that is no int or that no int64 holds gets -2, a
    word no root has (the call itself then refuses it by name, once every rank's check has paired)."""
    try:
        root = operator.index(root)
    except TypeError:
        return -2
    return root if -2 <= root < 1 << 62 else -2


def _digest(counts):
    """Debug mode's word for a call's counts, where the ranks compare them (of their text: counts no
    int64 holds, which the call itself then refuses by name, have one too)."""
    return zlib.crc32(",".join(map(str, counts)).encode())


def _splits_evenly(counts, total, size, role):
    """Whether a call's explicit per-rank counts are the ones it takes without them: `total` elements in
    `size` equal parts. A rank may pass either, so debug mode's signature words both alike."""
    counts = _core.whole_counts(counts, role)
    return len(counts) == size and counts[0] * size == total and counts.count(counts[0]) == size


def _agreed(name, everyone):
    """The settings every rank of group `name` read (everyone: each rank's, as sorted (variable, value)
    pairs), as a dict; else raises, on every rank, naming what differs between rank 0 and the first
    rank that differs from it."""
    differ = [r for r in range(len(everyone)) if everyone[r] != everyone[0]]
    if differ:
        first, other = dict(everyone[0]), dict(everyone[differ[0]])
        what = "; ".join(f"{k}={first.get(k, 'unset')} on rank 0, {other.get(k, 'unset')} on rank {differ[0]}"
                         f"{_HINTS.get(k, '')}" for k in sorted(set(first) | set(other))
                         if first.get(k) != other.get(k))
        raise RuntimeError(f"engine: the ranks of group {name!r} have different settings ({what}); every rank of a "
                           "group must open it, choose and cut its calls alike: set them the same on every rank")
    return dict(everyone[0])


# The compiled core's calls, bound straight onto each instance (no Python frame per call); the methods
# of the same names below document them. Debug mode keeps the collectives' methods, which compare
# signatures first; point-to-point is never numbered or compared.
_POINT_TO_POINT = ("send", "recv", "isend", "irecv", "sendrecv")
_CORE_CALLS = ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
               "barrier") + _POINT_TO_POINT
_ALWAYS_BOUND = _POINT_TO_POINT + ("check_usable",)
_FREED_TOO = ("algorithm_for", "allreduce_parts", "subgroup", "check_even_split")   # refused after free() too


def _freed(what):
    """What a freed group's `what` is: a refusal saying why (not an AttributeError of its missing core)."""
    def refuse(*args, **kwargs):
        call = args[0] if what == "check_usable" and args else what   # (its argument names the call)
        raise _core.EngineAborted(f"{call} failed: the group was destroyed (destroy_process_group or "
                                  "Communicator.free()): create a new group")
    return refuse


class Communicator:
    """A group of ranks.

    Communicator(comm=None): over an mpi4py communicator (a Dup of MPI.COMM_WORLD by default; the
    engine's traffic never mixes with the caller's). Communicator.from_store(store, rank, size): over
    torch's store, without MPI. transport: 'auto' (default: ENGINE_TRANSPORT), 'shm', 'mpi' or 'tcp'. timeout: seconds an operation may take (default ENGINE_TIMEOUT, else 1800).
    store: a key-value store shared by the ranks (torch's Store API), used to name the ranks that did
    not arrive when an operation times out. name: the group's name in messages and traces.
    """

    def __init__(self, comm=None, *, transport=None, ring_segment_bytes=None, timeout=None, store=None,
                 name="world", _owned=None, _boot=None, _stage=False, _parent=None):
        forks.check_can_make(f"group {name!r}", store if getattr(_boot, "store", None) is None else _boot.store,
                             mpi=_boot is None or isinstance(_boot, MpiBootstrap))
        self._mpi_comms, self._ulfm = [], False   # (ULFM: its MPI communicators are revoked at a break)
        self._store_prefix = None
        self._subgroups_made = {}   # (name, members) -> how many such subgroups this rank has made (store keys)
        self.name = name
        self._hier, self._stages = None, ()
        if _boot is None:
            from . import mpi
            MPI = mpi.load()
            if comm is not None and not isinstance(comm, MPI.Intracomm):
                raise TypeError(f"comm must be an mpi4py intracommunicator (MPI.COMM_WORLD, or one split from it), "
                                f"not {comm!r}" + (" (MPI.COMM_NULL: this rank is in no communicator)"
                                                   if comm == MPI.COMM_NULL else ""))
            _boot = MpiBootstrap(comm if comm is not None else MPI.COMM_WORLD, Watch.timeout_of(timeout))
        _boot.group = name
        self._core = None
        # Every rank reads its settings before the first exchange, which carries a rank's failure to
        # read them to every rank (none waits for ever in an exchange that rank never reaches). What
        # decides how the group opens goes round in it and must agree before anything opens; with
        # rank 0's random id, under which its ranks leave their arrival notes.
        cfgs, mpi = {}, isinstance(_boot, MpiBootstrap)
        debug, fused = [], []

        def read_opening():
            debug.append(env_flag("ENGINE_DEBUG") or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")
            fused.extend(fusion.bucket_sizes())   # (each rank cuts its fused calls' buckets by them)
            cfgs.update((t, TRANSPORTS[t].settings()) for t in possible_transports(transport, mpi))
            opening = _opening(transport, ring_segment_bytes, _boot.size)
            return (host_identity(), secrets.token_hex(8), sorted(opening.items()), Watch.timeout_of(timeout),
                    None if _parent is None else _parent[0])
        everyone = gather(_boot, read_opening, "read its settings")
        if mpi and _parent is None and not _stage:   # (the job's MPI files, once every rank here maps them)
            from .mpi import release_segments
            release_segments(_boot)
        opening = _agreed(name, [o for _, _, o, _, _ in everyone])
        notes_id, timeout = everyone[0][1], everyone[_boot.rank][3]
        whole = [w for _, _, _, _, w in everyone]   # (a stage's: each rank's rank in the group it serves)
        everyone = [h for h, _, _, _, _ in everyone]
        seg_bytes = opening["ENGINE_RING_SEGMENT_BYTES"]
        self.transport = choose_transport(opening["ENGINE_TRANSPORT"], [h for h, _, _ in everyone], mpi)
        self._transport = TRANSPORTS[self.transport]
        self._debug = debug[0]
        # The transport's own exchanges carry a failure to every rank; what fails here after them (the
        # watch's settings, a rank's trace file) goes round in the next exchange.
        failed = None
        try:
            opened = self._transport.open(_boot, everyone, seg_bytes, timeout, _owned, _parent, cfgs[self.transport])
            self._core, self._mpi_comms, caps = opened.core, opened.mpi_comms, opened.caps
            if _parent is not None:   # (its errors name its own ranks: say which they are, and a lost rank)
                self._core.serve(whole, _parent[2], _parent[1])
            _polite_waits(self._core, self._transport.network, everyone, _boot.rank)
            self.rank = self._core.rank
            self.size = self._core.size
            self.watch = Watch(name, self.rank, self.size, timeout, store, self._core, notes_id)
            if self._mpi_comms:
                from .mpi import fault_tolerant
                self._ulfm = fault_tolerant()
        except Exception as exc:
            failed = exc

        def read_plan():
            # What the plan and the messages are made of, and the plan, go round before anything is
            # built on them (a stage of another group's hierarchy is one level of it: never two levels
            # itself). The hierarchy's stages are made next, each of its exchanges carrying a failure
            # to every rank.
            if failed is not None:
                raise failed
            layouts.append(None if _stage else hierarchy.layout(self, everyone))
            self.plan = registry.Plan(self.transport, caps | (registry.hierarchy_caps(registry.hier_mode())
                                                              if layouts[0] is not None else set()), stage=_stage,
                                      alone=self.size == 1)
            agreed = sorted({**registry.settings(self.transport), "ENGINE_DEBUG": int(self._debug),
                             "ENGINE_CUDA_TRANSPORT": cuda_transport(),
                             "ENGINE_HIER": registry.hier_mode(), "ENGINE_BUCKET_BYTES": fused[0],
                             "ENGINE_FUSION_DIRECT_BYTES": fused[1], **opened.agreed}.items())
            return agreed, self.plan.digest()[0]
        layouts = []   # (this rank's: hierarchy.layout())
        try:
            if isinstance(failed, MissingRanks):   # (the next exchange would wait for them as long again)
                raise failed
            plans = gather(_boot, read_plan, "open its end of the group" if failed else "choose its algorithms")
            _agreed(name, [agreed for agreed, _ in plans])
            self._check_plans(_boot, [digest for _, digest in plans])
            shape = layouts[0]
            if shape is not None:
                self._hier, self._stages = hierarchy.build(self, _boot, shape,
                                                           self._stage_maker(everyone, seg_bytes, timeout, store))
            for stage in self._stages:
                stage.watch.whole = self.watch
            if self._stages or self._ulfm:
                self.watch.break_parts = weakref.WeakMethod(self._break_parts)
            self._configure()
        except BaseException:
            self.free()      # (the segment, sockets and MPI communicators it opened)
            raise
        for name in set(_ALWAYS_BOUND + (() if self._debug else _CORE_CALLS)):
            setattr(self, name, getattr(self._core, name))
        forks.track(self)

    def _check_plans(self, boot, everyone):
        """Raises, on every rank, unless every rank walks the same rules (everyone: each rank's plan
        digest); the rules that differ go round only then."""
        if len(set(everyone)) > 1:
            texts, threads = zip(*boot.allgather((self.plan.digest()[1], os.environ.get("ENGINE_THREADS"))))
            q = next(r for r in range(boot.size) if everyone[r] != everyone[0])
            why = (f"ENGINE_THREADS={threads[0] or 'unset'} on rank 0, {threads[q] or 'unset'} on rank {q}: set it "
                   "alike on every rank, or on none" if threads[0] != threads[q] else
                   "their settings agree, so what their hosts have differs (the cores each rank may use)")
            raise RuntimeError(f"engine: the ranks of group {self.name!r} would choose algorithms differently ("
                               f"{registry.plan_difference(texts, 0, q)}): {why}")

    def _configure(self):
        """Hands the plan and the hierarchy to the core and the transport."""
        self.plan.configure(self._core)
        self._core.set_hierarchy(self._hier)
        self._transport.configure(self._core, self.plan)

    def _stage_maker(self, everyone, seg_bytes, timeout, store):
        """make_stage for engine.hierarchy.build: a stage Communicator over a split of this group's
        bootstrap (MPI, or torch's store)."""
        def make(sub, transport, name):
            part = Communicator(transport=transport, name=name, ring_segment_bytes=seg_bytes, timeout=timeout,
                                store=store, _boot=sub, _owned=getattr(sub, "comm", None), _stage=True,
                                _parent=(self.rank, self.name, self.size))
            # Every stage waits as the whole group would: a cross stage holds one rank per host, but all of
            # this host's ranks carry their slices between hosts at once, and the local stages wait while
            # that traffic needs the kernel's network processing (measured: docs/tuning.md).
            _polite_waits(part._core, self._transport.network, everyone, self.rank)
            return part
        return make

    @classmethod
    def from_store(cls, store, rank, size, *, prefix=None, transport=None, timeout=None, name="world",
                   ring_segment_bytes=None, on_cancel=None, lost=None):
        """A group bootstrapped through a key-value store (torch's Store API) instead of MPI (which is
        never imported): shared memory inside a host, the engine's TCP transport between hosts.
        prefix: where its keys go in the store (default "engine/<name>": groups of other names share a
        store; one made again under the same name on the same store needs a prefix of its own, or it
        reads the keys the last one left). on_cancel: where the making may be cancelled from another
        thread (a reconfigure's abort()), on_cancel(fn) registers fn(why), which ends the waits that
        don't wait on the store. lost: the members known lost (Communicator.lost_among of the group it
        is made from) end its store waits at once."""
        try:
            rank, size = operator.index(rank), operator.index(size)
        except TypeError:
            raise TypeError(f"from_store: rank {rank!r} and size {size!r} must be integers") from None
        if not 0 <= rank < size:
            raise ValueError(f"from_store: rank {rank} of size {size}: size is the number of ranks (1 or more) and "
                             "rank this process's place among them, 0 to size - 1")
        prefix = f"engine/{name}" if prefix is None else prefix
        if transport == "mpi":
            raise ValueError("a group made through a store runs on shared memory and TCP; transport 'mpi' needs an "
                             "MPI launch (mpirun)")
        if transport not in (None, "auto", "shm", "tcp"):
            raise ValueError(f"from_store: unknown transport {transport!r}: expected one of auto, shm, tcp (or None: "
                             "ENGINE_TRANSPORT's)")
        requested_transport(transport)   # (a misspelt ENGINE_TRANSPORT is refused at one rank too, which runs on shm)
        boot = SelfBootstrap() if size == 1 else StoreBootstrap(store, rank, size, prefix, on_cancel,
                                                                     Watch.timeout_of(timeout), lost)
        try:
            self = cls(transport="shm" if size == 1 else transport, timeout=timeout, store=store, name=name,
                       ring_segment_bytes=ring_segment_bytes, _boot=boot)
        finally:
            StoreWithin.release(boot)   # (its exchanges' store queries are done)
        self._store_prefix = prefix
        return self

    @classmethod
    def single(cls, *, name="world", timeout=None):
        """A group of one rank, without MPI (plain `python script.py`), on shared memory whatever
        ENGINE_TRANSPORT asks (a misspelt one is refused)."""
        requested_transport()
        return cls(transport="shm", timeout=timeout, name=name, _boot=SelfBootstrap())

    @property
    def mpi_comm(self):
        """An MPI communicator of the group's ranks (None when the group was made without MPI)."""
        return self._mpi_comms[0] if self._mpi_comms else None

    @property
    def core(self):
        """The compiled core (engine._core.ShmComm, engine._core.TcpComm or engine._mpi.MpiComm)."""
        return self._core

    def __repr__(self):
        return f"<engine.Communicator {self.name!r} rank {self.rank} of {self.size} over {self.transport}>"

    # -- groups --

    def subgroup(self, ranks, *, name=None, store=None, transport=None, timeout=None):
        """A Communicator over `ranks` (ranks of this group, in the new group's order, the same on every
        member: made through a store, members given them in other orders are refused at once; members
        given other sets wait for their own until the timeout, naming those that did not come).
        Collective over the members only: ranks outside must not call it. timeout: this group's unless
        given (seconds)."""
        ranks = list(ranks)
        try:
            ranks = [operator.index(r) for r in ranks]   # (int() would take "1" and truncate 1.5)
        except TypeError:
            raise TypeError(f"subgroup ranks must be ints, got {ranks}") from None
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"subgroup ranks must be a non-empty list without duplicates, got {ranks}")
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ValueError(f"subgroup ranks {bad} are out of range for a group of size {self.size}")
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in subgroup {ranks}; only members call subgroup()")
        keyed = name or self.name   # (a name of its own, or its members' under this group's)
        name = name or f"{self.name}/{'-'.join(map(str, ranks))}"
        kwargs = dict(ring_segment_bytes=self._core.ring_segment_bytes, name=name,
                      timeout=self.watch.timeout if timeout is None else Watch.timeout_of(timeout))
        if self.mpi_comm is None:
            # Made through a store: the members meet under a key of their own, counted per name and
            # members, since a subgroup made again (each epoch, after free()) must not read the keys the
            # last one left, and two of one name but other members (made by hand) must not meet. Their
            # orders must agree, or two would take one position.
            members = "-".join(map(str, sorted(ranks)))
            made = self._subgroups_made[keyed, members] = self._subgroups_made.get((keyed, members), 0) + 1
            prefix = f"{self._store_prefix}/sub/{keyed}/{members}/{made}"
            store = self.watch.store if store is None else store
            if store is not None:   # (none: a group of one, Communicator.single()'s)
                agree_on_members(store, prefix, self.rank, ranks, kwargs["timeout"], f"engine subgroup {name!r}",
                                 "was given", "ranks to subgroup()", parent=self)
            # (a member lost once they agreed, inside the making: named at once, not at the timeout)
            return Communicator.from_store(store, ranks.index(self.rank), len(ranks), prefix=prefix, transport=transport,
                                           lost=self.lost_among(ranks), **kwargs)
        coll = self.mpi_comm
        group = coll.Get_group().Incl(ranks)
        try:
            with failure.blocked_in("MPI", f"making group {name!r} over MPI (MPI_Comm_create_group)", self.rank,
                                    kwargs["timeout"]):
                sub = coll.Create_group(group, tag=0)
        finally:
            group.Free()
        return Communicator(sub, transport=transport, store=store, _owned=sub, **kwargs)

    def abort(self):
        """Ends every wait of this group, in any thread, within one round of its back-off (at most 50 ms
        asleep), with EngineAborted, and refuses every later call the same way. Frees nothing: call
        free() once `busy` is 0 (a wait may still be reading the group's memory until it returns).
        MPI's blocking collectives (its reductions and allgather, over ENGINE_TRANSPORT=mpi) can't be
        interrupted: they end at the group's timeout (docs/fault-tolerance.md)."""
        for core in self._cores():
            core.abort()

    def lost_ranks(self):
        """{rank: how it was lost} of this group's ranks its transport knows to be gone (a process that
        exited; over TCP, a connection that ended without a goodbye), looked at now, the group busy or
        idle; None where the transport can't tell (MPI) or the group was freed. For the waits outside the
        group's collectives: the members a group made from this one waits for, a monitored barrier."""
        core = self._core   # (once: another thread's free() may take it meanwhile)
        return None if core is None else self._transport.lost(core)

    def lost_among(self, ranks):
        """lost_ranks() of `ranks` (ranks of this group), as a callable numbering them by their place
        in `ranks` and saying which they are here: a group made of them watches for their loss while
        it is made (from_store's lost); None where the transport can't tell."""
        if self.lost_ranks() is None:
            return None
        return lambda: {ranks.index(r): f"rank {r} of group {self.name!r}: {how}"
                        for r, how in (self.lost_ranks() or {}).items() if r in ranks}

    def check_usable(self, what):
        """Raises what the group's next operation would, once a failure (a timeout, a lost peer, a
        mismatch, in the group or in a stage of its hierarchy: engine.watch marks the group too) left
        it unusable."""
        if self._core is not None:
            self._core.check_usable(what)

    @property
    def driver(self):
        """What moves the user's messages left in flight while nothing waits on them: a progress thread
        calls it while idle (engine._progress, Progress.drive)."""
        return self._core.driver

    @property
    def busy(self):
        """Calls of this group (its hierarchy's stages included) inside the engine now."""
        return sum(core.busy for core in self._cores())

    def set_timeout(self, seconds):
        """The group's timeout (its hierarchy's stages' too), for its calls from now on, those waiting
        included; None: ENGINE_TIMEOUT's, else torch's default."""
        for part in (self, *getattr(self, "_stages", ())):
            part.watch.set_timeout(seconds)

    @contextlib.contextmanager
    def call_timeout(self, seconds):
        """The collectives run inside wait `seconds` (None: the group's timeout), not the group's timeout
        (c10d's per-call options: dist.barrier(timeout=...)); point-to-point waits keep the group's."""
        with contextlib.ExitStack() as stack:
            for part in (self, *getattr(self, "_stages", ())) if seconds is not None else ():
                stack.enter_context(part.watch.call_timeout(seconds))
            yield

    def drop_store(self):
        """The group's store is gone (a reconfigure's rendezvous): no watch of it, or of its stages,
        asks it any more (who is missing, what a peer called)."""
        for part in (self, *self._stages):
            part.watch.store = None

    def _cores(self):
        return ([self._core] if self._core is not None else []) + [
            c for s in getattr(self, "_stages", ()) for c in s._cores()]

    def _break_parts(self):
        """Once a failure broke the group: each stage of its hierarchy is broken too, so its transport
        tells that stage's peers at once (as the group's own told the group's): a peer waiting in another
        stage for this rank fails then, not at its timeout. Under an MPI whose job outlives a rank (ULFM:
        `mpiexec --with-ft ulfm`; engine.mpi.fault_tolerant), its MPI communicators (its stages' too)
        are revoked, so the ranks still waiting inside MPI on a live peer (a blocking reduction, a stage
        across hosts) end at once with a lost peer, where they waited until the timeout."""
        for c in self._mpi_comms if self._ulfm else ():
            try:
                c.Revoke()
            except Exception:   # (an MPI without it)
                pass
        for part in self._stages:
            if part._core is not None and part._core.broken is None and self._core is not None:
                part._core.set_broken(self._core.broken, self._core.broken_after, self._core.broke_over)
            part._break_parts()

    def orphan(self, why):
        """In a child forked from this process (engine/forks.py): every call is refused, naming the fork,
        and free() frees nothing (the group and its MPI communicators are the parent's)."""
        if self._core is not None:
            self._core.orphan(f"{why}, and group {self.name!r} (rank {self.rank}) came with the fork; {forks.ADVICE}")

    def free(self):
        """Releases the group's resources now (its segment, sockets, threads), unless a call is still
        inside it (then when it is collected); the object is unusable afterwards, and its core refuses
        every call (EngineAborted)."""
        # (a forked child's copy frees nothing: its MPI communicators are the parent's, engine/forks.py)
        orphan = self._core is not None and self._core.orphaned is not None
        if self._core is not None:
            self._core.set_hierarchy(None)
        for part in getattr(self, "_stages", ()):
            part.free()
        self._hier, self._stages = None, ()
        comms, self._mpi_comms = ([] if orphan else self._mpi_comms), []
        if comms and hasattr(self._core, "free_communicators"):
            # (MPI's core frees them with its transports: a call still inside, another thread's blocking
            # MPI collective, may be using them)
            self._core.free_communicators(comms)
            comms = []
        # (leaves the group; frees it now, not at collection: a caller may hold it; a call still inside
        # it, another thread's, frees it as it leaves, and keeps the watchdog meanwhile)
        if self._core is not None and self._core.release() and getattr(self, "watch", None) is not None:
            self.watch.close()
        self._core = None
        for name in _CORE_CALLS + _ALWAYS_BOUND + _FREED_TOO:   # (the core's bound methods go with it)
            setattr(self, name, _freed(name))
        if comms:
            from . import mpi
            MPI = mpi.load()
            for c in comms:
                if c != MPI.COMM_NULL:
                    c.Free()

    # -- collectives (see _CORE_CALLS) --

    def allreduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM, *, algorithm=None):
        """recvbuf = op(sendbuf of all ranks); in place on sendbuf when recvbuf is None.

        algorithm: None (ENGINE_ALLREDUCE_ALGO, else the rules), or the name of one of this group's
        allreduce entries (engine.registry; self.core.algorithms lists them)."""
        self._check_signature("allreduce", sendbuf, redop=op_code(op), out=recvbuf)
        return self._core.allreduce(sendbuf, recvbuf, op, algorithm)

    def broadcast(self, buf, root=0):
        self._check_signature("broadcast", buf, root=root)
        return self._core.broadcast(buf, root)

    def reduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM, root=0):
        """On root: recvbuf (or sendbuf, in place) = op(sendbuf of all ranks)."""
        self._check_signature("reduce", sendbuf, root=root, redop=op_code(op))
        return self._core.reduce(sendbuf, recvbuf, op, root)

    def allgather(self, sendbuf, recvbuf, counts=None):
        """recvbuf = concat(sendbuf of ranks 0..n-1); counts: elements per rank when they differ."""
        self._check_signature("allgather", sendbuf, counts=counts, out=recvbuf)
        return self._core.allgather(sendbuf, recvbuf, counts)

    def gather(self, sendbuf, recvbuf=None, root=0, counts=None):
        self._check_signature("gather", sendbuf, root=root, counts=counts, rooted=True)
        return self._core.gather(sendbuf, recvbuf, root, counts)

    def scatter(self, sendbuf, recvbuf, root=0, counts=None):
        self._check_signature("scatter", recvbuf, root=root, counts=counts, rooted=True)
        return self._core.scatter(sendbuf, recvbuf, root, counts)

    def reduce_scatter(self, sendbuf, recvbuf, op=ReduceOp.SUM, counts=None):
        """recvbuf = this rank's block of op(sendbuf of all ranks); counts: block sizes when uneven."""
        self._check_signature("reduce_scatter", sendbuf, redop=op_code(op), counts=counts, out=recvbuf)
        return self._core.reduce_scatter(sendbuf, recvbuf, op, counts)

    def alltoall(self, sendbuf, recvbuf, send_counts=None, recv_counts=None):
        self._check_signature("alltoall", sendbuf, counts=send_counts, out=recvbuf, out_counts=recv_counts)
        return self._core.alltoall(sendbuf, recvbuf, send_counts, recv_counts)

    def check_even_split(self, count, side):
        """Raises NotDivisibleError where an alltoall without side's counts can't split count evenly."""
        self._core.check_even_split(count, side)

    def barrier(self):
        """(A timeout of its own, as dist.barrier(timeout=...): `with group.call_timeout(seconds):`.)"""
        self._check_signature("barrier", None)
        self._core.barrier()

    def algorithm_for(self, nbytes, collective="allreduce", dtype="float32"):
        """The registry entry this group's rules pick for a call of nbytes (benchmarks and tests)."""
        return self._core.algorithm_for(nbytes, collective, dtype)

    def allreduce_parts(self, parts, op=ReduceOp.SUM, wire=None, before=1.0, after=1.0):
        """Fused allreduce of same-dtype parts, packed straight into the shared segment (shm only).
        Parts that share memory (one tensor twice, overlapping views) are refused: each part's result
        is written as its pack goes, so a later part would read an earlier one's result (engine.fusion
        runs such a list on copies). What engine._core.parse_parts made is taken as its maker checked it."""
        if not self.packs_in_segment:
            raise NotImplementedError(f"allreduce_parts packs into shared memory; this group runs over {self.transport}: "
                                      "use engine.fusion.FusedAllreduce, which packs where the transport has no segment")
        if isinstance(parts, (list, tuple)) and _core.parts_overlap(parts):
            raise ValueError("allreduce_parts: two parts share memory (the same buffer twice, or overlapping views); "
                             "pass distinct buffers (engine.fusion.FusedAllreduce takes such a list, on copies)")
        return self._core.allreduce_parts(parts, op, wire, before, after)

    @property
    def packs_in_segment(self):
        """Whether fused allreduces pack straight into the transport's memory (shared memory)."""
        return hasattr(self._core, "allreduce_parts")

    def _check_signature(self, op, buf, root=-1, redop=-1, counts=None, rooted=False, out=None, out_counts=None):
        """Debug mode: every rank's (op, dtype, count, shape, root, reduce op, seq) compared before the op.
        counts: a call split by counts, whose buffers differ in size between the ranks by design: the
        counts are compared instead of each rank's own (every rank passes the same); counts that split
        evenly are the call without counts. An alltoall's are each rank's own (torch's DETAIL checks
        leave them): only where every rank's split evenly are their parts compared. rooted: a gather's
        or scatter's, given on the root only: each rank's own count must be what the root's counts give
        it (all equal without counts). out: the output, refused here as the call would refuse it (not
        contiguous: the adapter then calls again with a copy), before this rank's check pairs with its
        peers'. out_counts: an alltoall's receive counts."""
        if not self._debug:
            return
        info = _core.message_shape(buf) if buf is not None else (0, 0, None)
        out_elements = _core.message_shape(out)[0] if out is not None else 0
        part = -1   # (an alltoall split evenly: the elements it sends each rank)
        if op == "alltoall":
            if all(c is None or _splits_evenly(c, n, self.size, "alltoall counts")
                   for c, n in ((counts, info[0]), (out_counts, out_elements))) and info[0] % self.size == 0:
                part = info[0] // self.size
            counts = ()
        elif counts is not None and not rooted:
            if _splits_evenly(counts, info[0] * self.size if op == "allgather" else info[0], self.size, f"{op} counts"):
                counts = None
        split = counts is not None or rooted
        shape = () if split else tuple(getattr(buf, "shape", ()) or ())[:5]
        sig = np.full(_SIG_LEN, -1, np.int64)
        dtype_code = _core.DTYPE_NAMES.index(info[2]) if info[2] else -1
        root = _root_word(root)
        sig[:7] = (_OP_IDS.get(op, 99), dtype_code, info[0], root,
                   redop if isinstance(redop, int) else 100 + getattr(redop, "fingerprint", 0),
                   self._core.seq + 1, -1 if split else len(shape))
        sig[7:7 + len(shape)] = shape
        if counts is not None and len(counts):
            sig[7] = _digest(_core.whole_counts(counts, f"{op} counts"))
        if op == "alltoall":
            sig[7] = part
        everyone = np.empty(_SIG_LEN * self.size, np.int64)
        with self.watch.traced(f"{op} signature check", _SIG_LEN, "int64"):
            try:
                _core.allgather_watched(self._core, sig, everyone)
            except _core.EngineError as exc:
                if isinstance(exc, (_core.EngineTimeout, _core.EngineMismatch)):   # (the watch's: they name the check)
                    raise
                # (the transport's words name an allgather: it failed in the user's call, not in one of theirs)
                raise type(exc)(f"{op} #{self._core.seq + 1} of group {self.name!r}, in debug mode's check of the "
                                f"ranks' calls: {exc}") from None
        rows = everyone.reshape(self.size, _SIG_LEN)
        # (a split call's own counts differ by design; a rooted one's digest is the root's alone)
        compared = [i for i in range(_SIG_LEN) if not (split and i == 2 or (rooted or op == "alltoall") and i == 7)]
        if (rows[:, compared] == rows[0, compared]).all():
            parts = rows[:, 7]
            if op == "alltoall" and (parts >= 0).all() and (parts != parts[0]).any():
                raise self.watch.mismatch(
                    f"collective mismatch in group {self.name!r}: alltoall #{int(rows[0, 5])}: the ranks split evenly "
                    f"into parts of other sizes ({', '.join(f'rank {r}: {int(n)}' for r, n in enumerate(parts))} "
                    "elements to each rank)", between=True)
            if not rooted or not 0 <= root < self.size:   # (the call itself names a root out of range)
                return
            own, theirs = rows[:, 2], int(rows[root, 7])
            if (own == own[0]).all() if theirs < 0 else _digest(own.tolist()) == theirs:
                return
            raise self.watch.mismatch(
                f"collective mismatch in group {self.name!r}: {op} #{int(rows[0, 5])} root {root}: the ranks' "
                f"elements ({', '.join(f'rank {r}: {int(n)}' for r, n in enumerate(own))}) are not "
                + ("all the same" if theirs < 0 else f"the root's counts (digest {theirs:08x})"), between=True)
        names = {v: k for k, v in _OP_IDS.items()}

        def describe(row):
            nd = int(row[6])
            return (f"{names.get(int(row[0]), 'op ' + str(row[0]))} #{int(row[5])} with {int(row[2])} "
                    f"{_core.DTYPE_NAMES[int(row[1])] if 0 <= row[1] < len(_core.DTYPE_NAMES) else '-'} elements"
                    + ("" if nd >= 0 or row[7] < 0 else f" in parts of {int(row[7])}" if row[0] == _OP_IDS["alltoall"]
                       else f" split by counts (digest {int(row[7]):08x})")
                    + (f" shape {tuple(int(x) for x in row[7:7 + nd])}" if nd > 0 else "")
                    + (f" root {int(row[3])}" if row[3] >= 0 else "")
                    + (f" op {ReduceOp(int(row[4])).name}" if 0 <= row[4] < len(ReduceOp) else
                       f" user op (fingerprint {int(row[4]) - 100:08x})" if row[4] >= 100 else ""))

        groups = {}
        for r in range(self.size):
            groups.setdefault(describe(rows[r]), []).append(r)
        detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d}" for d, rs in groups.items())
        raise self.watch.mismatch(f"collective mismatch in group {self.name!r}: {detail}", between=True)

    # -- point to point (not numbered: they need not match across all ranks) --

    def send(self, buf, dest, tag=0):
        self._core.send(buf, dest, tag)

    def recv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        """Returns (source, tag, count) of the message received; source/tag None or -1 mean any."""
        return self._core.recv(buf, source, tag)

    def isend(self, buf, dest, tag=0):
        """Returns a Request: .wait(), .test()."""
        return self._core.isend(buf, dest, tag)

    def irecv(self, buf, source=ANY_SOURCE, tag=ANY_TAG, whole=False):
        """Returns a Request whose .wait() gives (source, tag, count); whole: a message shorter than buf
        fails it."""
        return self._core.irecv(buf, source, tag, whole)

    def sendrecv(self, sendbuf, dest, recvbuf, source=ANY_SOURCE, sendtag=0, recvtag=ANY_TAG):
        """Sends to dest and receives from source at once (MPI_Sendrecv); returns (source, tag, count)."""
        return self._core.sendrecv(sendbuf, dest, recvbuf, source, sendtag, recvtag)


def _polite_waits(core, network, everyone, rank):
    """A group's waits spin (the lowest latency) only where that costs no peer its core. With more
    ranks on this host than the cores they may use between them, spinning would take the core a peer
    needs: waits yield at once. So too where they fill the cores exactly, from 3 ranks up: the launcher,
    the kernel and each rank's helper threads then have no core but a spinner's (measured: 16 ranks on
    16 cores, 4-256 KB allreduce 3-5x slower spinning than yielding), and between hosts (MPI or TCP)
    at any count, since the kernel's network processing needs a core too (4 ms per message otherwise). Two
    ranks on two cores over shared memory keep spinning: yielding there was 10-20% slower up to 64 KB,
    and a yield in mid-step has run whole sizes 4x slower (docs/tuning.md). ENGINE_SPIN_US sets the
    budget for every group instead, for its waits and its helper threads alike (at most 1 s)."""
    spin = env_duration("ENGINE_SPIN_US", None, unit="microseconds", maximum=1e6)
    if spin is not None:
        core.set_spin(spin)
        return
    local, cores = local_cores(everyone, rank)
    if len(local) > cores or (len(local) == cores and (network or len(local) > 2)):
        core.set_spin(0)
