"""Making a group: the creator torch calls for backend "engine", through MPI under an MPI launcher and
through torch's store otherwise, and the part of the store that belongs to this attempt of the job."""

import os

import torch
import torch.distributed as dist

from engine import Communicator, forks
from engine.bootstrap import MissingRanks, agree_on_members
from engine.launcher import MPIRUN_HINT, launcher_of_world
from engine.watch import StoreWithin

from . import functional
from .fault import own_transport, reconfigured
from .process_group import EngineProcessGroup
from .work import in_seconds

_GROUP_TAG = 31337  # MPI_Comm_create_group tag for torch sub-groups


def create_process_group(opts, backend_options=None):
    """The creator torch calls (extended API) on each member of a new group. Under an MPI launcher the
    group is made through MPI; otherwise (torchrun, mp.spawn, plain python) through torch's store
    (shared memory inside a host, the engine's TCP transport between hosts). After a reconfigure the
    store is used under MPI too: MPI's world no longer says who the members are. A group made with
    enable_reconfigure=True (torch 2.14) gets its communicator from its first reconfigure. A world
    of another size than the MPI launcher's job (mp.spawn under `srun -n 1`, a world made by hand
    with its store inside an MPI job) is made through the store, and its groups too."""
    functional.install()
    seconds = in_seconds(opts.timeout)
    name = opts.group_id or "default"
    ranks = list(opts.global_ranks_in_group)
    store = attempt_store(opts.store)
    base, making = None, 0
    changed = reconfigured()
    world_size = dist.get_world_size() if ranks and dist.is_initialized() else opts.group_size
    over_mpi = launcher_of_world(world_size) is not None and not changed   # (after a reconfigure or a shrink: never)
    # (in a forked child: not through the store or the MPI it inherited, before anything reaches them)
    forks.check_can_make(f"group {name!r}", store, mpi=over_mpi)
    world = dist.distributed_c10d._world.default_pg if ranks and dist.is_initialized() else None
    if ranks and store is not None:
        # A group's keys go under its world's: torch names a new world's groups from 1 again, in a store
        # that may be the last world's (torchrun's agent's), and a shrunk world's from 0 again; where one
        # member joined the world through a reconfigure, the members' counts of worlds, makings and
        # shrinks differ, and the world's key follows its reconfigures and shrinks, which each names alike.
        agreed = getattr(world, "_store_shared", None)   # (None: the world was not reconfigured)
        if agreed not in (None, True):
            raise RuntimeError(f"engine new_group {name!r}: the world's reconfigure found that {agreed}")
        store = dist.PrefixStore(f"engine/world-{getattr(world, '_world_key', '0')}", store)
    if store is not None:
        # (counted by the rank in the world: ranks given different lists for one group would share
        # their positions' counts, land in different makings and wait there until the timeout)
        making = makings_of(store, ranks[opts.group_rank] if ranks else opts.group_rank, seconds,
                            f"engine: group {name!r}")
        base, store = store, dist.PrefixStore(f"engine/made-{making}", store)
    # (a world's groups' keys go under the worlds this rank made in this store, which its ranks count
    # alike, whatever other stores a rank made worlds in before)
    made = dict(base_store=base, world_key=None if ranks else str(making),
                world_rank=None if ranks else opts.group_rank)
    if getattr(opts, "enable_reconfigure", False):
        return EngineProcessGroup(None, opts.group_rank, opts.group_size, opts.timeout, store, name, listen=True,
                                  **made)
    parent = _world_comm() if ranks else None
    if ranks and store is not None:   # (a group of some of the world's ranks: do they agree on which?)
        agree_on_members(store, "engine/new-group", ranks[opts.group_rank], ranks, seconds,
                         f"engine new_group {name!r}", "was given", "ranks to new_group", parent=parent)
    if not over_mpi:
        # (a member the world loses once they agreed, inside the making: named at once, not at the timeout)
        lost = parent.lost_among(ranks) if parent is not None else None
        try:
            comm = Communicator.from_store(store, opts.group_rank, opts.group_size, prefix="engine/boot",
                                           timeout=seconds, name=name, transport=own_transport() if changed else None,
                                           lost=lost)
        except MissingRanks as exc:
            raise MissingRanks(f"{exc}{counted_apart(base, ranks, exc.missing, making)}", exc.missing) from None
    else:
        mpi_comm = _mpi_group(opts, ranks, name, seconds)
        comm = Communicator(mpi_comm, timeout=seconds, store=store, name=name, _owned=mpi_comm)
    return EngineProcessGroup(comm, opts.group_rank, opts.group_size, opts.timeout, store, name, **made)


def _world_comm():
    """The communicator of the world's CPU side where the engine runs it (its members' numbering is
    torch's global ranks, new_group's), else None."""
    try:
        backend = dist.distributed_c10d._world.default_pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):   # (no world yet; one without a CPU backend)
        return None
    return getattr(backend, "communicator", None)


def attempt_store(store):
    """The part of torch's store that belongs to this attempt of the job. torchrun hands every attempt
    of a restarted job the same store (its agent's: c10d and static rendezvous alike), and torch's own
    keys for a group are the same in each, so a restarted worker would read what the attempt before it
    wrote (a dead rank's segment, its addresses). Under torchrun the engine's keys go under the run and
    the attempt (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT); other launches make their store anew
    with the job (rank 0 hosts it)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if store is None or attempt is None:
        return store
    return dist.PrefixStore(f"engine/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt-{attempt}", store)


def makings_of(store, rank, seconds=None, what=None):
    """This making's count of the group in its store, whose part of the store is `engine/made-<count>`.
    A group of the same name made again on the same store (init_process_group after
    destroy_process_group under torchrun, whose agent's store outlives the worlds of one attempt;
    mp.spawn re-using its tcp:// port) would otherwise read the keys its earlier making left: the
    earlier segment's size, its addresses. Each rank counts its own makings of the group (the ranks of
    one making count alike); a rank started twice counts ahead of the others, and is named missing
    where they meet. The count, asked within seconds (the group's timeout) and a grace, ends in an
    error naming the store where the store is out of reach."""
    with StoreWithin.bounded(store, seconds, what) as counting:
        return counting.add(f"engine/makings-of-rank-{rank}", 1)


def counted_apart(store, ranks, missing, making):
    """What the missing ranks' counts of their makings of the group in its store say (a sentence to add
    to the error), where one differs from this rank's (`making`): a rank ahead met in a later making;
    one behind (not none) has not come to this one, or this rank counted ahead of it. A process that
    took a dead one's rank on the same store counts the dead one's makings too."""
    if store is None or not missing:
        return ""
    try:
        with StoreWithin.bounded(store, 5.0, "engine: the makings' counts") as counting:
            counts = {r: counting.add(f"engine/makings-of-rank-{ranks[r] if ranks else r}", 0) for r in missing}
    except Exception:   # (the store is gone: the error says enough)
        return ""
    ahead = {r: n for r, n in counts.items() if n > making}
    behind = {r: n for r, n in counts.items() if 0 < n < making}
    if not ahead and not behind:
        return ""
    apart, how = (ahead, "so they met in a later making") if ahead else (
        behind, "so they have not come to this making, or this rank counted ahead of them")
    times = " or ".join(map(str, sorted(set(apart.values()))))
    return (f"; ranks {sorted(apart)} made this group {times} times in this store, this rank {making} times, {how} (a "
            "process that took the place of a dead one on the same store counts the dead one's makings too; so does "
            "a rank that made the group once more after the others gave up): make the group on a fresh store, or "
            "join the others through dist._reconfigure")


def _mpi_group(opts, ranks, name, seconds):
    """An MPI communicator of the group's members (collective over them only; aborting the job past
    the group's timeout, `seconds`, as any call blocked inside MPI)."""
    from engine import failure, mpi
    MPI = mpi.load()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("backend 'engine' needs MPI_THREAD_MULTIPLE (its progress thread calls MPI); this MPI "
                           f"was initialised with level {MPI.Query_thread()}: leave mpi4py.rc.thread_level at "
                           "'multiple' and use an MPI built with thread support")
    world = MPI.COMM_WORLD
    if not ranks:  # the default group: everyone
        if world.Get_size() != opts.group_size or world.Get_rank() != opts.group_rank:
            raise RuntimeError(
                f"torch.distributed says rank {opts.group_rank} of {opts.group_size}, but MPI says rank "
                f"{world.Get_rank()} of {world.Get_size()}: the processes were not started by one MPI launcher; "
                f"{MPIRUN_HINT}")
        with failure.blocked_in("MPI", f"making group {name!r} over MPI (MPI_Comm_dup)", opts.group_rank, seconds):
            return world.Dup()
    if world.Get_rank() not in ranks or ranks.index(world.Get_rank()) != opts.group_rank:
        raise RuntimeError(f"rank {world.Get_rank()} asked to join group {ranks} as rank {opts.group_rank}")
    group = world.Get_group().Incl(ranks)
    try:
        with failure.blocked_in("MPI", f"making group {name!r} over MPI (MPI_Comm_create_group)", opts.group_rank,
                                seconds):
            return world.Create_group(group, tag=_GROUP_TAG)
    finally:
        group.Free()
