"""Groups that survive failures, for EngineProcessGroup: torch 2.14's reconfigure contract, an abort
that unblocks, and the error state torch reads (get_error). A group made with enable_reconfigure=True
has no communicator until its first reconfigure (torch's contract); its handle exists from the start.
torch reaches all of this from Python (dist._reconfigure, dist.get_backend_impl(...).abort(), ...), so
a Python ProcessGroup answers for itself as its own backend (see process_group.py)."""

import contextlib
import functools
import secrets
import sys
import threading
import time

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from engine import Communicator, failure
from engine.bootstrap import Cancel, StoreBootstrap, agree_on_members
from engine._core import BROKEN_AFTER, EngineAborted, EngineMismatch, EnginePeerLost, EngineTimeout
from engine.tcp import store_host
from engine.watch import StoreWithin, Watch
from engine import handles as _handles

from .work import CompletedWork, in_seconds


def reconfigured():
    """Whether this process's world now has other members than its launcher started (a reconfigure or
    a shrink of it): its new groups meet through the store, as MPI's world no longer says who is who.
    Read from the world group, so a world made anew (init_process_group again) starts afresh."""
    return getattr(dist.distributed_c10d._world.default_pg, "_members_changed", False)


class Unavailable:
    """What a group without a communicator calls: every collective, message and progress call raises
    the reason (no members before the first reconfigure, or aborted). It stands where the
    communicator, its progress engine and the CPU device stand, so the latency path needs no test of
    its own: each of their attributes is the stand-in again (`dev.comm.allreduce`), and calling it
    raises."""

    def __init__(self, error, rank, size):
        self.error, self.rank, self.size = error, rank, size

    def __call__(self, *args, **kwargs):
        raise self.error.with_traceback(None)   # (one object, raised again: its traceback would grow each time)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self


class FaultTolerance:
    """The fault-tolerance half of EngineProcessGroup: the group's state is `_comm` (None: see
    `_refusal`), `_rank` and `_size`; `_attach(comm)` and `_detach(error)` swap what its calls run on."""

    def _init_fault_tolerance(self, listen, base_store, world_key, world_rank):
        """listen: listen for reconfigures from the start. base_store: the store under the count of the
        group's makings, where its reconfigures meet. world_key: a world's (else None) part of the store
        its groups' keys go under, which its reconfigures and shrinks change alike on every member.
        world_rank: a world's (else None) rank it was made with, under which base_store counts its
        makings (_world_makings)."""
        self._listener = self._new_listener() if listen else None
        self._uuids = set()
        self._abort_hooks = {}
        # what a failure that breaks the group calls (its watch, the CUDA watchdog): the hooks, not the group
        self._abort_hooks_on_failure = functools.partial(_run_abort_hooks, self._abort_hooks, self._name)
        # abort() may come from another thread (torchft's timers) while a reconfigure swaps the communicator:
        # the swap and abort's detach exclude each other, and a reconfigure that an abort overtook fails
        self._swapping = threading.RLock()   # (re-entrant: a signal handler's abort in the swapping thread)
        self._aborts = 0         # (abort() and shutdown() count here, _ended saying which came last)
        self._swap_thread = None  # (the thread swapping in a reconfigure's communicator)
        self._ended = None
        self._shrink_calls = 0
        self._making = None      # (a shrink or a split in flight: its kind and Cancel; abort() ends its waits)
        self._torch_knows_members = True   # (every member where torch's table of the group's ranks puts it)
        self._last_watch = None  # (the watch of the communicator attached last, kept past an abort: _attach sets it)
        self._membership = ""    # (the store's keys of the members since the last reconfigure: see reconfigure)
        self._monitored_seq = 0  # (monitored barriers since then)
        # (after a reconfigure: True where every member reaches the group's store under the keys the
        # others use, which the members' groups' makings numbered apart; else why not, in words. None:
        # never reconfigured, the group's own store holds)
        self._store_shared = None
        self._base_store, self._world_key, self._world_rank = base_store, world_key, world_rank

    # -- what torch asks --

    supports_reconfigure = True

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def _new_listener(self):
        """This process's end of reconfigure, listening where its group's TCP transport would (the route
        to MASTER_ADDR, else to its TCPStore's host)."""
        return _handles.Listener(store_host(self._store))

    def get_reconfigure_handle(self):
        """This process's handle: give it to every member of a reconfigure (engine.handles)."""
        if self._listener is None:
            self._listener = self._new_listener()
        return self._listener.handle

    def reconfigure(self, opts):
        """Makes the group the members named by opts.handles (a list: rank = position; a set: sorted),
        under the fresh opts.uuid, within opts.timeout (default: the group's). Returns a completed Work;
        raises what failed (a missing member is named)."""
        uuid = int(opts.uuid)
        if uuid in self._uuids:
            raise RuntimeError(f"reconfigure uuid {uuid} was already used by this group: pass a fresh uuid to every "
                               "reconfigure")
        seconds = _seconds_of(getattr(opts, "timeout", None)) or self._timeout_seconds()
        deadline, aborts = time.monotonic() + seconds, self._aborts
        what = f"engine reconfigure {uuid} of group {self._name!r}"
        listener = self._listener if self._listener is not None else self._new_listener()
        self._listener = listener
        try:
            store, index, n = _handles.meet(listener, uuid, opts.handles, seconds,
                                            lambda: self._reconfigure_aborted() if self._aborts != aborts else None)
        except (TimeoutError, ConnectionError, OSError) as exc:
            raise RuntimeError(f"{what}: {exc}") from None
        # The making waits as long as the reconfigure may, not the group's timeout its transport is given
        # (its TCP connecting would): at the deadline the meeting fails, which ends those waits.
        late = threading.Timer(max(0.0, deadline - time.monotonic()), store.meeting.lose,
                               [f"the reconfigure's timeout ({seconds:g} s) passed while the new group was made"])
        late.daemon = True
        late.start()
        comm = None
        membership = f"reconfigure-{uuid}-{store.meeting.digest.hex()[:16]}/"
        try:
            comm = Communicator.from_store(store, index, n, prefix=f"engine/reconfigure/{uuid}",
                                          transport=own_transport(), timeout=self._timeout_seconds(),
                                          name=self._name, on_cancel=store.meeting.on_cancel)
            # Whether torch's table of the group's ranks still holds (every member in its place): every
            # member learns it alike, so that a group made later through torch's store from that table
            # (shrink_group, split_group) is refused on all of them or none.
            boot = StoreBootstrap(store, index, n, f"engine/reconfigure/{uuid}/torch", timeout=seconds,
                                  on_cancel=store.meeting.on_cancel)
            # Whether the members share the group's store: member 0 leaves a word there, under keys of
            # this membership (not of the members' makings, which each process counts apart); every
            # member looks for it, and all learn who did not find it (refused alike, at once, later).
            probe, nonce = f"engine/{membership}store-probe", secrets.token_hex(16)
            wrote = index == 0 and self._store_probe(probe, nonce, deadline)
            parts = boot.allgather((dist.ProcessGroup.rank(self), dist.ProcessGroup.size(self),
                                    nonce if wrote else None))
            torch_ranks = [(r, s) for r, s, _ in parts]
            found = self._store_probe(probe, parts[0][2], deadline, read=True)
            seen = boot.allgather((found, self._world_makings(deadline, index) if found else None))
            store_shared = True if all(ok for ok, _ in seen) else (
                f"its members do not share one store: member(s) {[i for i, (ok, _) in enumerate(seen) if not ok]} "
                f"of reconfigure {uuid} did not find in their group's store what member 0 left in its own "
                "(their groups were made over other stores, as torchft's replicas' are, or a store did not answer)")
            if store_shared is True:   # (the world made again on this store meets in one making on every member)
                self._world_makings(deadline, index, up_to=max(made for _, made in seen))
        except BaseException as exc:
            if comm is not None:
                comm.free()
            store.close(deadline, made=False)
            if isinstance(exc, (ValueError, TypeError)) or not isinstance(exc, Exception):
                raise
            raise RuntimeError(f"{what}: {exc}") from None
        finally:
            late.cancel()
        try:
            # (the members' makings end about when this one's did: a second to say so, where it ended late)
            store.close(max(deadline, time.monotonic() + 1.0))
        except (TimeoutError, ConnectionError) as exc:
            comm.free()
            raise RuntimeError(f"{what}: {exc}") from None
        comm.drop_store()   # the rendezvous store is gone: timeouts can't ask it who is missing
        overtaken = f"{what}: {{}} while it was reconfigured; reconfigure it again with a fresh uuid, or make a new group"
        with self._swapping:
            if self._aborts != aborts:
                comm.free()
                raise RuntimeError(overtaken.format(self._ended))
            self._uuids.add(uuid)
            self._swap_thread = threading.get_ident()
            try:
                old = self._swap(comm, membership, index, n, torch_ranks, store_shared)
            finally:
                self._swap_thread = None
            aborted = self._aborts != aborts   # (abort() from a signal handler of this thread, in the swap)
            if aborted:
                new = self._detach(self._aborted_error())
        self._release(*old)
        if aborted:
            self._release(*new)
            raise RuntimeError(overtaken.format(self._ended))
        return CompletedWork.of()

    def _store_probe(self, key, nonce, deadline, read=False):
        """Sets (or, read, looks for) key = nonce in the group's base store, under the reconfigure's
        deadline: False where the store is gone, does not answer, or (read) holds another value."""
        if nonce is None or self._base_store is None:
            return False
        try:
            with self._base_store_within(deadline, "store probe") as store:
                if not read:
                    store.set(key, nonce)
                    return True
                return bool(store.check([key])) and store.get(key).decode() == nonce
        except Exception:
            return False

    def _world_makings(self, deadline, index, up_to=None):
        """A world's count of its makings in the base store, where they were counted, the larger under
        the rank the world was made with and under `index`, its rank in the reconfigure (a process that
        took a dead one's rank counts the dead one's makings too, ahead of the others); or, with up_to,
        counts it up to that under `index`, which no other member writes (every member of a reconfigure
        to the most among them: the world made again on the store, each member its rank from the
        reconfigure, meets in one making). 0 for another group, or where the store does not answer (the
        making then names the ranks that counted apart)."""
        if self._world_rank is None or self._base_store is None:
            return 0
        try:
            with self._base_store_within(deadline, "the world's makings") as counts:
                mine = counts.add(f"engine/makings-of-rank-{index}", 0)
                if up_to is not None:
                    return counts.add(f"engine/makings-of-rank-{index}", up_to - mine) if mine < up_to else mine
                return max(mine, counts.add(f"engine/makings-of-rank-{self._world_rank}", 0))
        except Exception:
            return 0

    def _base_store_within(self, deadline, what):
        """The base store, each call bounded by the reconfigure's deadline (5 s at most)."""
        return StoreWithin.bounded(self._base_store, max(0.0, min(deadline - time.monotonic(), 5.0)), what)

    def _meeting_store(self, what):
        """The store a group made from this one (shrink, split) and a monitored barrier meet in: the
        group's own until a reconfigure; after one, the base store under the membership's keys, which
        every member names alike; refused at once where the members don't share it."""
        if self._store is None:
            raise RuntimeError(f"{what}: the group was destroyed (its store is gone): use a live group")
        if self._store_shared is None:
            return self._store
        if self._store_shared is not True:
            raise RuntimeError(f"{what}: the group's last reconfigure found that {self._store_shared}, where this "
                               "meets: reconfigure the members you want instead (dist._reconfigure)")
        return dist.PrefixStore(f"engine/{self._membership}", self._base_store)

    def _swap(self, comm, membership, index, n, torch_ranks, store_shared=None):
        """Puts comm in the group's place (under the swap lock); returns what _release frees of the old.
        membership: the store's keys of the new members (uuid and their list's digest): members of an
        earlier membership, or of another made under the same uuid beside it, count their monitored
        barriers and shrinks apart."""
        self._membership = membership
        self._monitored_seq = self._shrink_calls = self._splits = self._shrinks = 0
        self._store_shared = store_shared
        if self._last_watch is not None:   # (its failures, and a call's still running on it, are not the group's)
            failure.recovered(self._last_watch)
        if self is dist.distributed_c10d._world.default_pg:
            self._members_changed, self._world_key = True, membership.rstrip("/")
            failure.recovered()
        old = self._detach(None)
        self._rank, self._size = index, n
        self._torch_knows_members = torch_ranks == [(i, n) for i in range(n)]
        self._attach(comm)
        return old

    @property
    def supports_shrinking(self):
        return _make_shrunk is not None

    def shrink(self, ranks_to_exclude, shrink_flags=0, opts_override=None):
        """dist.shrink_group: a new group of this group's other members, which torch puts in this one's
        place (through _shrunk_group). It is made through the group's store, not through this group,
        which the member left out may have broken by dying; the rank order is kept. SHRINK_ABORT (flag
        1) first ends this group's calls in flight, as abort(). Every remaining member passes the same
        ranks: where one doesn't, or doesn't call, the others fail at the group's timeout, naming it.
        opts_override (shrink_group's pg_options): a Backend.Options whose timeout the new group takes;
        none: the group's."""
        what = f"engine shrink of process group {self._name!r}"
        aborts = self._aborts   # (an abort() from another thread from here on ends this shrink)
        self._shrink_calls += 1   # (every call, as every member calls: where the arguments are wrong too)
        flags = int(shrink_flags)
        if flags & ~dist.distributed_c10d.SHRINK_ABORT:
            raise ValueError(f"{what}: shrink_flags {flags} has bits the engine does not know: pass SHRINK_DEFAULT (0) "
                             "or SHRINK_ABORT (1)")
        timeout = _shrink_timeout(what, opts_override, self._timeout)
        excluded = sorted({int(r) for r in ranks_to_exclude})
        if not excluded or excluded[0] < 0 or excluded[-1] >= self._size or self._rank in excluded:
            raise ValueError(f"{what}: ranks_to_exclude must name other ranks of the group, 0-{self._size - 1} "
                             f"but not this one ({self._rank}); got {list(ranks_to_exclude)}")
        self._check_torch_knows_members(what, "leave ranks out")
        meeting = self._meeting_store(what)
        replaced = self._last_watch   # (the communicator's in place, or taken off by an abort: SHRINK_ABORT's too)
        members = [r for r in range(self._size) if r not in excluded]
        # (a member lost while the others make the new group ends their wait: SHRINK_ABORT frees this group
        # only after the making)
        lost = self._comm.lost_among(members) if self._comm is not None else None
        aborted = None, [], None
        if flags & dist.distributed_c10d.SHRINK_ABORT:
            aborted = self._abort_unreleased()
            aborts += 1
        try:
            return self._shrunk(what, aborts, excluded, members, lost, replaced, meeting, timeout)
        finally:
            self._release(*aborted)

    def _shrunk(self, what, aborts, excluded, members, lost, replaced, meeting, timeout):
        """shrink()'s new group, made once the arguments are checked (and SHRINK_ABORT ended this one),
        within `timeout` (a timedelta), which it keeps."""
        count = getattr(self, "_shrinks", 0) + 1    # (the shrinks that worked: the new group's name)
        index, size = members.index(self._rank), len(members)
        world = self is dist.distributed_c10d._world.default_pg
        name = f"{self._name}:shrunk-{count}"
        # The members meet under their count of shrink calls, which a retry after a failed one advances on
        # every member alike: under the failed attempt's keys, a retry would read what that attempt left.
        store = dist.PrefixStore(f"engine/shrink/{self._name}/{self._membership}{self._shrink_calls}/without-" +
                                 "-".join(map(str, excluded)), meeting)
        with self._making_new_group("shrink", aborts, f"{what} without ranks {excluded}") as cancel:
            try:
                comm = Communicator.from_store(store, index, size, transport=own_transport(), name=name,
                                               timeout=Watch.timeout_of(_seconds_of(timeout)),
                                               on_cancel=cancel.on_cancel, lost=lost)
            except EnginePeerLost as exc:   # (it names the member lost, in this group's ranks too)
                raise EnginePeerLost(f"{what} without ranks {excluded}: {exc}") from exc
            except Exception as exc:
                raise RuntimeError(f"{what} without ranks {excluded}: {exc} (rank i of the new group is rank "
                                   f"{members}[i] of this one; every member that stays passes the same ranks)"
                                   ) from exc
        self._shrinks = count
        world_key = f"{self._world_key}/shrink-{count}" if world else None   # (torch names its groups from 0 again)
        # (its reconfigures meet where this group's do: in the store every member's world shares)
        group = type(self)(comm, index, size, timeout, store, name, base_store=self._base_store, world_key=world_key,
                           world_rank=self._world_rank if world else None)
        # torch's table of the new group's ranks in the world (_shrunk_group puts it in place of torch's,
        # which takes the left-out group ranks for world ranks): a shrunk world numbers its ranks anew
        group._world_ranks = list(range(size)) if world else [dist.get_process_group_ranks(self)[r] for r in members]
        if replaced is not None:   # (torch puts the new group in this one's place)
            failure.recovered(replaced)
        if world:
            group._members_changed = True
            failure.recovered()
        return group

    @contextlib.contextmanager
    def _making_new_group(self, kind, aborts, failed):
        """A shrink or a split (kind) making its new group: an abort() from another thread ends its waits
        on the members (through the Cancel this gives), and one that landed since the group's count of
        aborts read `aborts` (before there was a wait to end) ends it at once. failed: how its error
        begins."""
        with self._swapping:
            if self._aborts != aborts:
                raise RuntimeError(f"{failed}: {self._ended} as this {kind} began")
            self._making = (kind, Cancel())
        try:
            yield self._making[1]
        finally:
            with self._swapping:
                self._making = None

    def _check_torch_knows_members(self, what, instead):
        """A new group of some of this one's members is made through its store, from torch's table of
        its ranks: refused once the store is gone, or once a reconfigure gave the group members that
        table does not know."""
        if self._store is None:
            raise RuntimeError(f"{what}: the group was destroyed (its store is gone): use a live group")
        if not self._torch_knows_members:
            raise RuntimeError(f"{what}: it was reconfigured to other members, which torch's table of its ranks "
                               f"does not know: {instead} with dist._reconfigure(uuid, handles) instead")

    supports_splitting = True   # (torch 2.15 splits CPU groups; 2.13 and 2.14 split only on an accelerator)

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """dist.split_group (torch 2.15): a group of `ranks` (ranks of this group, in the new group's
        order), or None on a rank outside them (torch returns NON_GROUP_MEMBER there). Collective over
        the members only. Made as new_group makes one: through MPI where this group was made through
        MPI, else through this group's store (shared memory on one host, TCP across hosts). A member
        that split into other ranks than a member of its split is named at once (ValueError). It serves
        every device this group serves; opts and device_types are not read (the engine's settings are
        the environment's). An abort() of this group from another thread ends it where it waits for
        its members in the store (a split made through MPI waits inside MPI, bounded by the timeout)."""
        what = f"engine split of process group {self._name!r}"
        aborts = self._aborts   # (an abort() from another thread from here on ends this split)
        # The members meet under this group's count of splits, which every rank of it advances on each
        # call (torch's contract: they all call), not under torch's name for the split: torch counts
        # its names on every rank of the world, and a split of a subgroup advances only its members'.
        self._splits = count = getattr(self, "_splits", 0) + 1
        members = [int(r) for r in ranks]
        if not members or len(set(members)) != len(members) or not all(0 <= r < self._size for r in members):
            raise ValueError(f"{what}: ranks must be distinct ranks of the group, 0-{self._size - 1}; got {list(ranks)}")
        if self._rank not in members:
            return None
        self._check_torch_knows_members(what, "split it")
        meeting = self._meeting_store(what)
        comm = self._comm
        if comm is None:
            raise self._cpu.error   # (aborted, or no members before its first reconfigure)
        name = f"{self._name}:split-{count}"   # (the engine's, as its ranks agree on it; torch's is set below)
        seconds = in_seconds(timeout) if timeout is not None else self._timeout_seconds()
        store = dist.PrefixStore(f"engine/split-{count}/{'-'.join(map(str, members))}", meeting)
        index, size = members.index(self._rank), len(members)
        with self._making_new_group("split", aborts, f"{what} into ranks {members}") as cancel:
            try:
                agree_on_members(meeting, f"engine/split-{count}", self._rank, members, seconds, what,
                                 "split into", "split_ranks", cancelled=lambda: cancel.why, parent=comm)
            except ConnectionError as exc:   # (aborted, or the store is gone)
                raise RuntimeError(f"{what} into ranks {members}: {exc}") from exc
            try:
                if comm.mpi_comm is not None and not reconfigured():
                    new = comm.subgroup(members, name=name, store=store, timeout=seconds)
                else:
                    new = Communicator.from_store(store, index, size, name=name, transport=own_transport(),
                                                  timeout=seconds, on_cancel=cancel.on_cancel,
                                                  lost=comm.lost_among(members))
            except EnginePeerLost as exc:   # (it names the member lost: the ranks were right)
                raise EnginePeerLost(f"{what} into ranks {members}: {exc}") from exc
            except Exception as exc:
                raise RuntimeError(f"{what} into ranks {members}: {exc} (every member passes the same ranks)"
                                   ) from exc
        group = type(self)(new, index, size, timeout or self._timeout, store, name)
        group._set_group_name(group_name or name)
        if group_desc:
            group._set_group_desc(group_desc)
        return group

    def abort(self):
        """Ends every queued and running call of this group at once (EngineAborted), and a reconfigure
        or a shrink in flight where it waits on its members (the meet, the new group's making), after
        running the abort hooks; frees the group as soon as no call is inside it. Recover with
        reconfigure() and a fresh uuid, or make a new group."""
        self._release(*self._abort_unreleased())

    def _abort_unreleased(self):
        """abort() but the release: returns what _release frees (a shrink's SHRINK_ABORT frees it once
        the new group's making ends, which watches the members through it)."""
        _run_abort_hooks(self._abort_hooks, self._name, "abort() was called")   # (one that raises ends nothing)
        with self._swapping:
            self._end_remaking(f"process group {self._name!r} was aborted (abort())")
            if self._swap_thread == threading.get_ident():   # (a signal handler inside this thread's swap: the
                return None, [], None                         # swap ends the communicator it attached)
            return self._detach(self._aborted_error())

    def _aborted_error(self):
        return EngineAborted(f"process group {self._name!r} was aborted (abort()): its calls were ended; reconfigure "
                             "it with a fresh uuid (dist._reconfigure) or create a new group")

    def _reconfigure_aborted(self):
        return f"{self._ended} while this reconfigure waited for its members"

    def _end_remaking(self, why):
        """abort() or shutdown() (why: which, in words): a reconfigure or a shrink in flight ends where
        it waits on its members, and one past its waits fails before it attaches its communicator."""
        self._aborts += 1
        self._ended = why
        if self._listener is not None:
            self._listener.interrupt(self._reconfigure_aborted())
        if self._making is not None:
            kind, cancel = self._making
            cancel.cancel(f"{why} while this {kind} waited for its members")

    supports_abort_hooks = True        # torch 2.15 asks (they run on abort() and when a call fails)
    supports_completion_hooks = False

    def register_abort_hook(self, hook_id, hook):
        self._abort_hooks[int(hook_id)] = hook

    def unregister_abort_hook(self, hook_id):
        self._abort_hooks.pop(int(hook_id), None)

    def get_error(self):
        """torch's ErrorType of this group: TIMEOUT once a call timed out, REMOTE_ERROR once a peer
        failed or left (or called another collective), COMM_ERROR for a failure of the transport itself,
        else SUCCESS (an abort asked for by the caller is not an error, as for Gloo)."""
        try:
            from torch._C._distributed_c10d import ErrorType as kinds
        except ImportError:   # torch 2.13: no ErrorType
            kinds = None
        comm = self._comm
        broken = comm.watch.broken if comm is not None else None
        if kinds is None:
            return broken
        if not broken:
            return kinds.SUCCESS
        after = comm.watch.broken_after
        if after == BROKEN_AFTER[EngineTimeout]:
            return kinds.TIMEOUT
        if after in (BROKEN_AFTER[EnginePeerLost], BROKEN_AFTER[EngineMismatch]):
            return kinds.REMOTE_ERROR
        return kinds.COMM_ERROR

    def set_timeout(self, timeout):
        """dist.set_timeout (torch 2.14+): the group's timeout from now on, its hierarchy's stages and
        its CUDA watchdog included. torch 2.13's _set_pg_timeout reaches Gloo's and NCCL's only (README)."""
        self._timeout = timeout
        if self._comm is not None:
            self._comm.set_timeout(self._timeout_seconds())
            self._cpu.progress.stall_seconds = self._timeout_seconds()
        if getattr(self, "_watchdog", None) is not None:
            self._watchdog.timeout = self._timeout_seconds()

    # -- helpers --

    def _timeout_seconds(self):
        return Watch.timeout_of(_seconds_of(self._timeout))

    def _release(self, cpu, devices, watchdog):
        """Frees what _detach took off the group once nothing runs in it: now when idle, else from a
        short-lived thread (the caller may be the very thread still inside: a signal handler's)."""
        if cpu is None:
            return

        def free():
            for dev in devices:
                dev.shutdown()
            if watchdog is not None:
                watchdog.close()
            cpu.shutdown()   # (its comm's too)

        def idle():
            return cpu.comm.busy == 0 and cpu.progress.idle

        if idle():
            free()
            return

        def reap():
            nap = 0.001
            while not idle():   # (a call left running ends at its timeout at the latest)
                time.sleep(nap)
                nap = min(2 * nap, 0.05)
            free()

        threading.Thread(target=reap, name="engine-abort-release", daemon=True).start()

    def _close_listener(self):
        if getattr(self, "_listener", None) is not None:
            self._listener.close()
            self._listener = None


_make_shrunk = getattr(dist.distributed_c10d, "_create_shrunk_process_group", None)


def _shrunk_group(new_backend, remaining_ranks, metadata, is_default_group):
    """torch's _create_shrunk_process_group, for what an engine group's shrink() returns: that group,
    named as torch names the group it makes. torch would make a ProcessGroup and register the shrunk
    backend on it, which needs a C++ Backend (torch 2.13 has no Backend a Python class can extend),
    and, on the CPU, registers it as Gloo's; torch's DDP logger then casts it to Gloo's class and
    crashes. The group itself is what the creator returns for every other engine group."""
    if not isinstance(new_backend, FaultTolerance):
        return _make_shrunk(new_backend, remaining_ranks, metadata, is_default_group)
    remaining_ranks[:] = new_backend._world_ranks   # (the list torch makes its table of next)
    new_backend._set_group_name(metadata["new_group_name"])
    new_backend._set_group_desc("default:shrunken" if is_default_group else
                                f"{metadata['original_group_name']}:shrunk")
    if metadata.get("bound_device_id") is not None:
        new_backend.bound_device_id = metadata["bound_device_id"]
    if metadata.get("backend_config") is not None:
        dist.distributed_c10d._world.pg_backend_config[new_backend] = metadata["backend_config"]
    return new_backend


if _make_shrunk is not None:
    dist.distributed_c10d._create_shrunk_process_group = _shrunk_group


_torch_split_source = getattr(dist.distributed_c10d, "_get_split_source", None)


def _no_engine_split_source(*args, **kwargs):
    """torch's _get_split_source, which new_group asks once the world is bound to a device
    (init_process_group(..., device_id=...)): never an engine group. torch would hand it to the new
    group's backend options, whose split_from takes only a C++ Backend (torch 2.14 on: TypeError on
    every member), and ask the ranks outside the new group to join a split. The engine makes the new
    group among its members alone, as without device_id (through MPI under mpirun, else through the
    store); split_group still splits."""
    source = _torch_split_source(*args, **kwargs)
    return None if isinstance(source, FaultTolerance) else source


if _torch_split_source is not None:
    dist.distributed_c10d._get_split_source = _no_engine_split_source


def _run_abort_hooks(hooks, name, why):
    """The group's abort hooks, on abort() and when a failure (a timeout, a lost peer, a mismatch)
    leaves it unusable: torch's contract runs them "when a collective times out or fails", for a capture
    before the group is torn down. In the thread that saw the failure; a hook that raises is reported,
    and the abort, or the failure the call raises, goes on."""
    for hook_id, hook in list(hooks.items()):
        try:
            hook()
        except Exception as exc:
            print(f"engine: abort hook {hook_id} of process group {name!r} raised {type(exc).__name__}: {exc} "
                  f"(it ran because {why})", file=sys.stderr, flush=True)


def own_transport():
    """The transport of a reconfigured group: ENGINE_TRANSPORT's, except MPI (a reconfigure may take in
    processes MPI's launcher did not start), which becomes the engine's own choice."""
    from engine.bootstrap import requested_transport
    wanted = requested_transport()
    return "auto" if wanted == "mpi" else wanted


def _shrink_timeout(what, opts, timeout):
    """The timeout of a group shrink_group makes: its pg_options' where given (torch's Backend.Options,
    whose only field the engine has a use for; another backend's options, NCCL's, are refused by name),
    else the group's (`timeout`)."""
    if opts is None:
        return timeout
    if type(opts) is not _C10dBackend.Options:
        raise ValueError(f"{what}: pg_options is a {type(opts).__qualname__}, another backend's options, of which "
                         "the engine reads nothing: pass torch._C._distributed_c10d.Backend.Options('engine') with its "
                         "_timeout set, or none")
    return opts._timeout


def _seconds_of(timeout):
    seconds = in_seconds(timeout, 0.0)
    return seconds if seconds > 0 else None


def no_members_error(name):
    return RuntimeError(f"process group {name!r} was made with enable_reconfigure=True and has no members until "
                        "its first reconfigure: call dist._reconfigure(uuid, handles) with every member's "
                        "dist._get_reconfigure_handle()")
