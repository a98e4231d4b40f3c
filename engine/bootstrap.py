"""How the ranks of a new group meet before they can communicate: they exchange small Python objects
(host identities, the shared segment's descriptor, the TCP transport's addresses and token) over MPI,
or over torch's store when no MPI launcher started them. Then the group's transport is chosen and,
for shared memory, its segment made."""

import datetime
import io
import os
import pickle
import socket
import time

from . import failure, forks
from ._core import EngineAborted, EnginePeerLost
from .config import env_choice, env_int, finite_seconds
from .watch import StoreWithin

TRANSPORTS = ("auto", "shm", "mpi", "tcp")
# What carries bytes between hosts under an MPI launcher (ENGINE_INTERHOST): MPI, as before the TCP
# transport existed, until `python -m bench` with backends engine-interhost-tcp,engine-interhost-mpi
# across hosts shows TCP at least as fast at every size.
INTERHOST = ("mpi", "tcp")


# A wait that may be ended from another thread (a making's cancel, a group's abort) looks in the store
# and sleeps between looks, at most this long (keys_set_within).
LOOK_PAUSE_SECONDS = 0.05
# Where only a lost member would end it (no cancel to see soon), at most this long: each look is a
# round trip to the one store every waiting rank asks, and a member that comes late is seen this late.
LOST_LOOK_PAUSE_SECONDS = 0.2


class MissingRanks(RuntimeError):
    """Ranks never came to an exchange of the group's making, within its timeout: `missing`, the
    group's ranks."""

    def __init__(self, message, missing=()):
        super().__init__(message)
        self.missing = list(missing)


class Cancel:
    """Where a group's making can be ended from another thread (abort() of a shrink in flight): the
    making's waits register fn(why) with on_cancel, and cancel(why) runs each (one registered after
    it at once)."""

    def __init__(self):
        self.why, self._fns = None, []

    def on_cancel(self, fn):
        self._fns.append(fn)
        if self.why is not None:
            fn(self.why)

    def cancel(self, why):
        self.why = why
        for fn in list(self._fns):
            fn(why)


class MpiBootstrap:
    """The exchanges of a group's making over an MPI communicator: MPI's blocking collectives, which
    nothing interrupts; one that waits past `timeout` (seconds; None: for ever) aborts the job
    (engine.failure.blocked_in), since a rank that never makes the group would leave the others
    in it for ever."""
    group = None   # (every bootstrap) the name of the group made over it, for its errors: Communicator's
    on_cancel = None   # (every bootstrap) where set, on_cancel(fn): fn(why) ends a wait of the group's making

    def __init__(self, comm, timeout=None):
        self.comm, self.timeout = comm, timeout
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def _blocking(self, call):
        return failure.blocked_in("MPI", f"making group {self.group!r} over MPI ({call})", self.rank, self.timeout)

    MAX_BYTES = 1 << 24   # (a rank's part of a group's making: its host, ports, settings)

    def allgather(self, obj):
        """Every rank's obj, read as the store's values are (plain data, its length bounded): two
        MPI_Allgather(v)s of raw bytes, where mpi4py's pickling allgather would unpickle anything."""
        import numpy as np
        mine = np.frombuffer(pickle.dumps(obj), np.uint8)
        lengths = np.zeros(self.size, np.int64)
        with self._blocking("MPI_Allgather"):
            self.comm.Allgather(np.array([mine.size], np.int64), lengths)
        check_lengths(lengths, self.MAX_BYTES, "making the group over MPI")
        rows = np.empty(int(lengths.sum()), np.uint8)
        with self._blocking("MPI_Allgatherv"):
            self.comm.Allgatherv(mine, [rows, lengths])
        ends = np.cumsum(lengths)
        return [plain_loads(rows[e - n:e].tobytes()) for e, n in zip(ends, lengths)]

    tell = allgather   # (a collective: every rank takes part in it, this one too)

    def dup(self):
        """A communicator of the same ranks (collective)."""
        with self._blocking("MPI_Comm_dup"):
            return self.comm.Dup()

    def split(self, color, key, name):
        """The bootstrap of the ranks with the same color (None: not in any), ordered by key; collective."""
        from . import mpi
        MPI = mpi.load()
        with self._blocking(f"MPI_Comm_split for {name!r}"):
            sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else MpiBootstrap(sub, self.timeout)


class StoreBootstrap:
    """allgather over a key-value store (torch's Store API: set / get, where get waits for the key).
    timeout: seconds a round waits for the other ranks (the group's; None: the store's own).
    on_cancel: where the store's meeting can be cancelled (a reconfigure's: engine.handles.Meeting), its
    on_cancel, through which the group's making registers the waits the store's failing doesn't end.
    lost: where given, returns {rank of this group: how} of the members the group it is made from knows
    to be lost (Communicator.lost_among): a round waiting for one of them ends at once (EnginePeerLost)."""
    group = None

    def __init__(self, store, rank, size, prefix="engine", on_cancel=None, timeout=None, lost=None):
        self.store, self.rank, self.size, self.prefix = store, rank, size, prefix
        self.on_cancel, self.timeout, self.lost = on_cancel, timeout, lost
        self._round = 0
        self._cancelled = None   # (why the making was cancelled: its store waits end within LOOK_PAUSE_SECONDS)
        if on_cancel is not None:
            on_cancel(self._cancel)

    def _cancel(self, why):
        self._cancelled = why

    def _stop(self, keys, store):
        if self._cancelled is not None:
            return ConnectionError(self._cancelled)
        # (a loss this rank sees itself first: named so, not as the word of a member that saw it before)
        gone = lost_before_arriving(self.lost, store, keys.__getitem__)
        if gone:
            r = min(gone)
            return EnginePeerLost(f"engine: rank {r} of {self.size} is lost while group {self.group!r} is made "
                                  f"({gone[r]}): make it of the ranks still alive")
        given_up = _given_up(store, self.prefix)   # (a member that gave up never comes to this round)
        if given_up is not None:
            return MakingGivenUp(f"engine: group {self.group!r} ({self.prefix})", *given_up, came_late=False)
        return None

    def allgather(self, obj):
        key = f"{self.prefix}/boot/{self._round}/"
        store = StoreWithin.of(self.store, self.timeout, f"engine: {self._whose()} ({self.prefix})", line=self)
        if self._round == 0 and key_is_set(store, key + str(self.rank)):
            raise ValueError(f"engine: this rank ({self.rank}) made a group under the prefix {self.prefix!r} in this "
                             "store before, and the last making's keys would be read as this one's: give each making "
                             "a prefix of its own (Communicator.from_store's prefix=)")
        self._round += 1
        self._set_part(store, key, obj)
        keys = [key + str(r) for r in range(self.size)]
        looked = []   # (stop is asked only after a first look that found a part unset)

        def stop():
            looked.append(True)
            return self._stop(keys, store)
        watched = self.on_cancel is not None or self.lost is not None
        try:
            values, missing, why = read_keys(store, keys, self.timeout, f"the group's bootstrap ({self.prefix})",
                                             stop if watched else None,
                                             LOOK_PAUSE_SECONDS if self.on_cancel is not None else LOST_LOOK_PAUSE_SECONDS)
        except ConnectionError:   # (cancelled, as its group was aborted: said, as a timeout is)
            if self._cancelled is not None:
                self._give_up(store, key, f"its making was cancelled ({self._cancelled})")
            raise
        except EnginePeerLost as exc:   # (said: a member whose own transport does not see the loss fails too)
            self._give_up(store, key, str(exc).removeprefix("engine: "))
            raise
        if missing:
            self._give_up(store, key, f"it waited for ranks {missing} in exchange #{self._round} of the making")
            raise MissingRanks(f"engine: ranks {missing} of {self.size} never joined the bootstrap of {self._whose()} "
                               f"({self.prefix}): {why}", missing)
        if GAVE_UP.encode() in values:   # (a member that gave up stays named in its part, not missing)
            raise MakingGivenUp(f"engine: group {self.group!r} ({self.prefix})",
                                *(_given_up(store, self.prefix) or (values.index(GAVE_UP.encode()), "")),
                                came_late=watched and not looked)
        return [plain_loads(v) for v in values]

    def tell(self, obj):
        """This rank's part of the next exchange (a rank whose part of the making failed: it raises its
        own error next), set without waiting for the others', which it never reads: it waited for a
        member beyond a cut link its whole timeout once more (a failed connect already took one), or,
        cut off from the store itself, that timeout and 5 s more. The members waiting in that exchange
        read it; one that gave the making up first is named (MakingGivenUp), as where this rank waits."""
        key = f"{self.prefix}/boot/{self._round}/"
        self._round += 1
        store = StoreWithin.of(self.store, 0, f"engine: {self._whose()} ({self.prefix})", line=self)
        self._set_part(store, key, obj)
        given_up = _given_up(store, self.prefix)
        if given_up is not None:
            raise MakingGivenUp(f"engine: group {self.group!r} ({self.prefix})", *given_up, came_late=True)

    def _set_part(self, store, key, obj):
        """This rank's part of the exchange under key; a store gone says so."""
        try:
            store.set(key + str(self.rank), pickle.dumps(obj))
        except ConnectionError:   # (a store that says why it is gone: a reconfigure's hub)
            raise
        except Exception as exc:   # (torch's: "Broken pipe", where its server's process is gone)
            raise store_stopped(f"the group's bootstrap ({self.prefix})", exc) from None

    def _give_up(self, store, key, why):
        """A member that reads this exchange later, or waits in it still, reads why in this rank's part,
        and fails at once (MakingGivenUp) where it would wait for this rank until its timeout."""
        try:
            _say_given_up(store, self.prefix, self.rank, why)
            store.set(key + str(self.rank), GAVE_UP)
        except Exception:   # (the store gone: no one comes)
            pass

    def _whose(self):
        return "the group" if self.group is None else f"group {self.group!r}"

    def split(self, color, key, name):
        everyone = self.allgather((color, key))
        if color is None:
            return None
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(everyone) if c == color)]
        return StoreBootstrap(self.store, members.index(self.rank), len(members), f"{self.prefix}/{name}/{color}",
                              self.on_cancel, self.timeout)


def key_is_set(store, key):
    """Whether key is set in the store; False where the store can't say (it has no check, it fails, or
    it does not answer: what waits next says so)."""
    try:
        return store.check([key])
    except Exception:
        return False


class _PlainUnpickler(pickle.Unpickler):
    """Reads what the ranks exchange (numbers, strings, bytes, tuples, lists, dicts, sets) and nothing
    that names a class or a function: whoever can write to the store can't run code in the ranks."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"engine: a value of the group's bootstrap names {module}.{name}: only plain "
                                     "data is exchanged there, so the store holds a value no rank of this engine wrote")


def plain_loads(data):
    return _PlainUnpickler(io.BytesIO(data)).load()


def read_keys(store, keys, seconds, what, stop=None, pause=LOOK_PAUSE_SECONDS):
    """(the values of keys, [], None) once every one is set; else (None, the positions of those never
    set, what the store said). The wait is bounded by seconds, a group's own timeout, where the store
    can wait so long (torch's store.wait; its gets wait the store's own timeout, the world's: 30
    minutes by default); a store without wait (a reconfigure's) bounds its reads by its deadline.
    The values come in one round trip where the store has multi_get (torch's stores; a Python
    subclass of torch's Store that defines get only inherits one that calls its get; the
    reconfigure's members' stores), else a get a key. A store cancelled or gone (ConnectionError: it
    says which) passes its error on. stop: where given, returns the exception that ends the wait (a
    making cancelled, a member known lost), else None: asked between looks, `pause` at most apart
    (keys_set_within)."""
    multi_get = getattr(store, "multi_get", None)

    def values():
        return multi_get(keys) if multi_get is not None else [store.get(k) for k in keys]

    try:
        if seconds is None or not hasattr(store, "wait") or keys_set_within(store, keys, seconds, stop, pause):
            return values(), [], None
        why = f"wait timeout after {finite_seconds(seconds) * 1e3:.0f}ms"   # (the store's words for it)
    except (ConnectionError, EnginePeerLost, EngineAborted, MakingGivenUp):   # (the store gone; stop's)
        raise
    except Exception as exc:   # (the store's own words, without its list of keys)
        why = str(exc).split(", keys:")[0]
    try:   # who never came?
        missing = [i for i, k in enumerate(keys) if not store.check([k])]
    except ConnectionError as gone:   # (a store that says why it is gone: a reconfigure's hub)
        raise ConnectionError(f"{what}: {why}; then {gone}") from None
    except Exception:
        raise store_stopped(what, why) from None
    if not missing:   # (all there now: they came just late)
        return values(), [], None
    return None, missing, why


def store_stopped(what, why):
    """The error of a store that stopped answering (its own words: why) while a group was made."""
    return RuntimeError(f"engine: the store stopped answering in {what}: {why}; its server may have run in a process "
                        "that has exited (rank 0's, where the job was started with MASTER_ADDR and MASTER_PORT; "
                        "torchrun's agent keeps its store past its workers)")


def agree_on_members(store, key, me, members, seconds, what, verb, argument, cancelled=None, parent=None):
    """Each member of a new group (me: its rank in the group it is made from) says which ranks it was
    given, and reads its members': ranks given different lists fail at once naming the rank and both
    lists, where they would wait for each other in the store until its timeout, or meet with positions
    that disagree. Members that never come are named at the new group's timeout (seconds), not the
    store's, and a member the group it is made from (parent: an engine Communicator) knows to be lost
    at once (EnginePeerLost). A member whose making failed says why (in place of its list, and under a
    key of the making's own), and one that comes later fails at once saying so, while it waits for
    another member too (its next making meets the others' next). cancelled: where
    given, returns why the making was cancelled from another thread (else None): the wait ends in a
    ConnectionError saying why."""
    forks.check_can_make(what, store)   # (split_group from a forked child's copy: not in its parent's store)
    with StoreWithin.bounded(store, seconds, what) as store:
        _agree(store, key, me, members, seconds, what, verb, argument, cancelled, parent)


def _agree(store, key, me, members, seconds, what, verb, argument, cancelled, parent):
    mine = "-".join(map(str, members))
    store.set(f"{key}/members-of/{me}", mine)
    keys = [f"{key}/members-of/{r}" for r in members]
    watched = parent is not None and parent.lost_ranks() is not None
    looked = []

    def stop():
        why = None if cancelled is None else cancelled()
        if why is not None:
            return ConnectionError(why)
        core = None if parent is None else parent._core
        if parent is not None and (core is None or core.aborted):   # (the group it is made from: its abort())
            return EngineAborted(f"{what}: group {parent.name!r}, the group this one is made from, was aborted "
                                 "(or destroyed) while this rank waited for the new group's members: make the "
                                 "group from a world made again")
        # (a member that came is not waited for: lost since, it fails the new group's own making)
        gone = lost_before_arriving(parent.lost_ranks if watched else None, store,
                                    lambda r: keys[members.index(r)] if r in members else None)
        if gone:
            one = len(gone) == 1
            how = "; ".join(how if one else f"rank {r}: {how}" for r, how in sorted(gone.items()))
            return EnginePeerLost(f"{what}: {'rank' if one else 'ranks'} {', '.join(map(str, sorted(gone)))} of "
                                  f"{members} {'is' if one else 'are'} lost to group {parent.name!r}, the group this "
                                  f"one is made from ({how}): make the group of the ranks still alive")
        came_late = not looked   # (given up before its first look: before this rank came)
        looked.append(True)
        given_up = _given_up(store, key)   # (where a member that never came keeps this one waiting)
        return None if given_up is None else MakingGivenUp(what, *given_up, came_late)
    try:
        values, missing, why = read_keys(store, keys, seconds, what, stop,
                                         LOOK_PAUSE_SECONDS if cancelled is not None else LOST_LOOK_PAUSE_SECONDS)
    except (EnginePeerLost, EngineAborted) as lost:
        _give_up(store, key, me, f"{lost}".removeprefix(f"{what}: "))
        raise
    except MakingGivenUp as given_up:
        _give_up(store, key, me, f"rank {given_up.rank} gave it up first")
        raise
    except ConnectionError:   # (cancelled: said, as above; the store gone: nothing is)
        why = None if cancelled is None else cancelled()
        if why is not None:
            _give_up(store, key, me, f"its making was cancelled ({why})")
        raise
    if missing:
        absent = [members[i] for i in missing]
        _give_up(store, key, me, f"it waited {seconds:g} s for ranks {absent}")
        raise RuntimeError(f"{what}: ranks {absent} of {members} did not come within the group's timeout "
                           f"({seconds:g} s): every rank must make the group, passing the same {argument}, in the "
                           f"same order as the others ({why})")
    for r, value in zip(members, values):
        theirs = value.decode()
        if theirs.startswith(GAVE_UP):
            raise MakingGivenUp(what, r, theirs[len(GAVE_UP):], came_late=True)
        if theirs != mine:
            raise ValueError(f"{what}: rank {r} {verb} ranks [{theirs.replace('-', ', ')}] where this rank ({me}) "
                             f"{verb} {members}: every rank must pass the same {argument}")


GAVE_UP = "gave up: "   # a member's word in place of its list, where its making failed


class MakingGivenUp(RuntimeError):
    """A member of a group's making gave it up before this rank came, or while it waited."""

    def __init__(self, what, rank, why, came_late):
        super().__init__(f"{what}: rank {rank} gave this making up before this rank came ({why}); a rank that comes "
                         "after the others gave up, or that skipped a making they made, is out of step with them: "
                         "every rank must make the group (its next making too)" if came_late else
                         f"{what}: rank {rank} gave this making up while this rank waited ({why}): every rank must "
                         "make the group within the others' timeouts")
        self.rank = rank


def _give_up(store, key, me, why):
    """Leaves why this rank's making failed where its list was, and under the making's own key (where
    no member left its reason there first), so that a member coming later fails at once, saying so,
    where it would find every list and wait for the others in the group's bootstrap, or one list
    unset and wait for it."""
    try:
        store.set(f"{key}/members-of/{me}", GAVE_UP + why)
        _say_given_up(store, key, me, why)
    except Exception:   # (the store gone: no one comes later)
        pass


def _say_given_up(store, key, rank, why):
    """Leaves under the making's key that `rank` gave it up, and why (where no member did first)."""
    if not store.check([f"{key}/given-up"]):
        store.set(f"{key}/given-up", f"{rank} {why}")


def _given_up(store, key):
    """(rank, why) of the member of the making under key that gave it up first, else None."""
    if not store.check([f"{key}/given-up"]):
        return None
    said = store.get(f"{key}/given-up").decode(errors="replace")
    r, _, why = said.partition(" ")
    if not r.isdigit():   # (no rank of this engine wrote it: said whole, with no rank named)
        return -1, f"(the store's word, unread: {said[:200]!r})"
    return int(r), why


def lost_before_arriving(lost, store, key_of):
    """{rank: how} of the ranks lost() (a {rank: how} or None; lost itself may be None) names as lost
    whose key in the store, key_of(rank) (None: a rank not waited for), is not set: what a wait on
    those keys stops for. A rank lost after it arrived did its part there."""
    known = lost() if lost is not None else None
    return {r: how for r, how in (known or {}).items() if key_of(r) is not None and not store.check([key_of(r)])}


def keys_set_within(store, keys, seconds, stop=None, most_pause=LOOK_PAUSE_SECONDS):
    """Whether every key is set in the store within seconds (looked at once where seconds <= 0). Without
    stop, one store.wait. With it, the wait can be ended from another thread: it looks (check) and
    sleeps between looks, 1 ms doubling to most_pause, and stop(), asked after each sleep, ends it by
    returning the exception to raise (else None; keys set meanwhile end it well). store.wait can't be
    interrupted, and waiting in slices of it would do: but torch's store client logs a warning for
    each slice that expires. A store that fails passes its error on."""
    end = time.monotonic() + finite_seconds(seconds)
    pause = 0.001
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return store.check(keys)
        if stop is None:
            try:
                store.wait(keys, datetime.timedelta(seconds=max(left, 0.001)))   # (0 ms: no limit, to a store)
                return True
            except RuntimeError:   # the store's timeout (its own type and words); a lost store fails the check
                return store.check(keys)
        if store.check(keys):
            return True
        time.sleep(min(left, pause))
        pause = min(2 * pause, most_pause)
        if time.monotonic() >= end:   # (its own timeout first: what a wait without stop would say)
            continue
        exc = stop()
        if exc is not None:
            if store.check(keys):   # (they came while it slept: what ended after does not undo that)
                return True
            raise exc


def gather(boot, make, what):
    """Every rank's make(), gathered. Where make() raises on some ranks, every rank raises (those ranks
    their own error, the others naming the first of them and the group, boot.group) instead of waiting
    for ever in an exchange a rank that gave up never reaches. what: what a rank whose make() raised
    could not do ("read its settings"), as that rank says it."""
    try:
        mine, error = make(), None
    except Exception as exc:
        mine, error = None, exc
    if error is not None:   # (its part tells the others; theirs would tell it nothing its own error does not)
        try:
            boot.tell((None, f"could not {what} ({type(error).__name__}: {error})"))
        except MakingGivenUp:   # (a member gave the making up before: what this rank could not do, a
            raise               # segment's attach, may be why)
        except Exception:   # (this rank's own error says more than the exchange that could not carry it)
            pass
        raise error
    everyone = boot.allgather((mine, None))
    bad = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
    if bad:
        raise RuntimeError(f"engine: {'the group' if boot.group is None else f'group {boot.group!r}'} was not made: "
                           f"rank {bad[0][0]} {bad[0][1]}")
    return [v for v, _ in everyone]


def check_lengths(lengths, most, where):
    """Refuses a rank's pickle length outside 1..most (every rank sees the same lengths: all raise, none
    waits in the exchange of the pickles)."""
    bad = [r for r in range(len(lengths)) if not 0 < lengths[r] <= most]
    if bad:
        raise RuntimeError(f"engine: rank {bad[0]} sent a length of {int(lengths[bad[0]])} bytes in {where} (1 to "
                           f"{most} are read): a value too large for it, a rank of another engine, or corrupt data")


class CommBootstrap:
    """allgather over a group's own communicator (an engine.Communicator, made already): for what its
    members agree on afterwards (its CUDA side's setup) among whoever they are now, store or none.
    Two of the group's collectives a round: the pickles' lengths, then the pickles. What a peer sends
    is read as the store's values are (plain data, its length bounded), not trusted."""
    on_cancel = None
    MAX_BYTES = 1 << 16   # (what the members agree on here is a few ids and names)

    def __init__(self, comm, group=None):
        self.comm, self.group, self.rank, self.size = comm, group, comm.rank, comm.size

    def allgather(self, obj):
        import numpy as np
        mine = np.frombuffer(pickle.dumps(obj), np.uint8)
        lengths = np.zeros(self.size, np.int64)
        self.comm.allgather(np.array([mine.size], np.int64), lengths)
        check_lengths(lengths, self.MAX_BYTES, "the group's setup exchange")
        rows = np.zeros((self.size, int(lengths.max())), np.uint8)
        row = np.zeros(rows.shape[1], np.uint8)
        row[:mine.size] = mine
        self.comm.allgather(row, rows.reshape(-1))
        return [plain_loads(rows[r, :lengths[r]].tobytes()) for r in range(self.size)]

    tell = allgather   # (the group's collectives: every rank takes part in them, this one too)


class SelfBootstrap:
    """A group of one."""
    rank, size, group, on_cancel = 0, 1, None, None

    def allgather(self, obj):
        return [obj]

    tell = allgather


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace():
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def host_identity():
    """(host, pid, cores this process may use): ranks with the same host share memory (same kernel, UTS
    name and PID namespace: a segment is attached, and a peer watched, through its process id; containers
    that share a host name, as Kubernetes' hostNetwork pods do, meet as separate hosts)."""
    from .launcher import usable_cores
    return (f"{socket.gethostname()}/{_boot_id()}/{_pid_namespace()}", os.getpid(), usable_cores())


def local_cores(everyone, rank):
    """(the usable cores of each rank on rank's host, how many cores those are together); everyone:
    each rank's host_identity()."""
    host = everyone[rank][0]
    local = [cores for h, _, cores in everyone if h == host]
    return local, len(set().union(*local))


def choose_transport(requested, hosts, mpi=True):
    """'shm', 'mpi' or 'tcp' for a group whose ranks run on `hosts` (one entry per rank); mpi: whether
    the group was made through MPI (an MPI launch). On one host: shared memory. Across hosts: TCP
    without MPI, and under MPI what ENGINE_INTERHOST says."""
    want = requested_transport(requested)
    if want not in TRANSPORTS:
        raise ValueError(f"transport {want!r}: expected one of {', '.join(TRANSPORTS)}")
    one_host = len(set(hosts)) == 1
    if want == "shm" and not one_host:
        names = sorted({h.split('/')[0] for h in hosts})
        raise ValueError(f"ENGINE_TRANSPORT=shm needs every rank of the group on one host, but it spans "
                         f"{', '.join(names)}: use ENGINE_TRANSPORT=auto, tcp or mpi")
    if want == "mpi" and not mpi:
        raise ValueError("ENGINE_TRANSPORT=mpi needs an MPI launch (mpirun); this group was made without one "
                         "(torchrun, mp.spawn): use ENGINE_TRANSPORT=auto (TCP between hosts) or tcp")
    if want == "auto":
        return "shm" if one_host else _between_hosts(mpi)
    return want


def possible_transports(requested, mpi=True):
    """The transports choose_transport() may pick for a group asking for `requested`, whatever hosts
    its ranks are on: the settings a group reads before it knows them."""
    want = requested_transport(requested)
    if want != "auto":
        return [want] if want in TRANSPORTS else []
    return ["shm", _between_hosts(mpi)]


def _between_hosts(mpi):
    """What `auto` takes across hosts: ENGINE_INTERHOST under an MPI launch, else TCP."""
    return interhost() if mpi else "tcp"


def requested_transport(requested=None):
    """The transport a group asks for: the one given, else ENGINE_TRANSPORT, else auto."""
    return requested or env_choice("ENGINE_TRANSPORT", TRANSPORTS, "auto")


def interhost():
    """What carries bytes between hosts under an MPI launch: ENGINE_INTERHOST=mpi|tcp."""
    return env_choice("ENGINE_INTERHOST", INTERHOST, "mpi")


def segment_settings():
    """What the shared segment is made of (ENGINE_SHM_SLOT_BYTES, ENGINE_SHM_QUEUE_BYTES: None for the
    default, which depends on the group's size) and single copy's mode (ENGINE_SHM_CMA)."""
    return dict(slot=env_int("ENGINE_SHM_SLOT_BYTES", 1 << 20, minimum=0),   # (the segment checks the least it needs)
                queue=env_int("ENGINE_SHM_QUEUE_BYTES", None, minimum=0),
                cma=env_choice("ENGINE_SHM_CMA", ("auto", "1", "0"), "auto"))


def make_segment(boot, everyone, cfg):
    """The group's shared segment in two exchanges: rank 0 creates it while every rank gives the
    address of its single-copy probe word; the others attach, every rank faults in its own slots and
    probes its peers, and every rank learns whether all succeeded (so none is left waiting) and
    whether single copy works between every pair; then rank 0 drops its descriptor. cfg:
    segment_settings()."""
    from . import _core
    size, rank = boot.size, boot.rank
    # Point-to-point rings: 256 KiB a pair for small groups, less for large ones (2 channels x P^2 rings;
    # the pages are touched only by pairs that talk).
    queue = cfg["queue"] if cfg["queue"] is not None else max(16 << 10, min(256 << 10, (64 << 20) // (2 * size * size)))
    pids = [pid for _, pid, _ in everyone]
    made = []

    def create():
        if rank == 0:
            made.append(_core.ShmSegment.create(size, cfg["slot"], queue))
        return made[0].descriptor() if made else None, _core.cma_probe_address()[0]

    def attach():
        if rank != 0:
            made.append(_core.ShmSegment.attach(rank, size, desc))
        made[0].populate()
        # (single copy: one process_vm_readv from the owner's buffer instead of two copies through the
        # segment, where this rank may read each peer's probe word and ENGINE_SHM_CMA allows it)
        works = cfg["cma"] != "0" and made[0].cma_probe(pids, addrs)
        return works, cfg["cma"] == "1"

    firsts = gather(boot, create, "create the group's shared segment")
    desc, addrs = firsts[0][0], [a for _, a in firsts]
    try:
        probes = gather(boot, attach, "attach the group's shared segment")
    finally:
        if rank == 0:
            made[0].close_fd()
    seg = made[0]
    seg.watch_peers(pids)
    seg.set_cma(agree_on_single_copy(probes))
    return seg


def agree_on_single_copy(everyone):
    """Whether the group moves pieces by single copy, a capability of the group: every rank must be able
    to read every other's memory, and every rank must know that all can, so all choose alike
    (everyone: each rank's (probe succeeded, ENGINE_SHM_CMA=1)). Which pieces use it is the registry's
    rules' business (engine.registry: the single_copy entries and their thresholds). Where a rank
    insists and some probe failed, every rank refuses the group, not that rank alone; a group of one
    has nothing to copy between ranks."""
    if len(everyone) < 2:
        return False
    ok = all(works for works, _ in everyone)
    if any(insists for _, insists in everyone) and not ok:
        raise RuntimeError("ENGINE_SHM_CMA=1, but process_vm_readv between the ranks is not allowed here "
                           "(another user, a ptrace policy such as Yama, or a seccomp filter); use ENGINE_SHM_CMA=auto")
    return ok
