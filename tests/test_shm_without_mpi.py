"""Shared-memory groups made through torch's store, without MPI (processes started by multiprocessing,
as torchrun and mp.spawn start them): collectives are checked against local references, MPI is never
imported, a dead peer is named at once (well before the timeout), and nothing is left in /dev/shm."""

import multiprocessing as mp
import os
import re
import signal
import sys

import numpy as np
import pytest

from ports import free_port


def _group(rank, size, port, timeout=60):
    import torch.distributed as dist
    import engine
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=__import__("datetime").timedelta(seconds=30))
    return engine.Communicator.from_store(store, rank, size, timeout=timeout), store


def _collectives(rank, size, port, out):
    try:
        comm, _store = _group(rank, size, port)
        for n in (0, 1, 1031, 300_000):
            x = np.arange(n, dtype=np.float32) + rank
            comm.allreduce(x)
            assert np.array_equal(x, sum(np.arange(n, dtype=np.float32) + r for r in range(size)))
        b = np.arange(50_000, dtype=np.int64) if rank == size - 1 else np.zeros(50_000, np.int64)
        comm.broadcast(b, root=size - 1)
        assert np.array_equal(b, np.arange(50_000))
        whole = np.zeros(3 * size, np.int32)
        comm.allgather(np.full(3, rank, np.int32), whole)
        assert np.array_equal(whole, np.repeat(np.arange(size, dtype=np.int32), 3))
        got = np.zeros(4, np.float64)
        comm.sendrecv(np.full(4, rank, np.float64), (rank + 1) % size, got, (rank - 1) % size)
        assert np.all(got == (rank - 1) % size)
        comm.barrier()
        out.put((rank, "ok", comm.transport, "mpi4py" in sys.modules))
    except BaseException as exc:  # reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}", None, None))


def _dies(rank, size, port, out, transport="shm"):
    os.environ["ENGINE_TRANSPORT"] = transport
    comm, _store = _group(rank, size, port, timeout=60)
    x = np.ones(4, np.float32)
    comm.allreduce(x)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        __import__("time").sleep(1.0)   # (rank 0 has seen the loss and given the group up by now)
    try:
        comm.allreduce(x)
        out.put((rank, "returned"))
    except Exception as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def _run(target, size, *args):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, size, port, out, *args)) for r in range(size)]
    for p in procs:
        p.start()
    return procs, out


def _all_ok(target, size):
    """target's reports from size ranks, by rank, each checked to say "ok"."""
    procs, out = _run(target, size)
    results = sorted(out.get(timeout=120) for _ in range(size))
    for p in procs:
        p.join(30)
    assert [r[1] for r in results] == ["ok"] * size, results
    return results


def _shm_files():
    """/dev/shm, but for the semaphores of this test's own multiprocessing queue."""
    try:
        return {f for f in os.listdir("/dev/shm") if not f.startswith("sem.mp-")}
    except OSError:
        return set()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_collectives_over_a_store_without_mpi(size):
    before = _shm_files()
    procs, out = _run(_collectives, size)
    results = sorted(out.get(timeout=120) for _ in range(size))
    for p in procs:
        p.join(30)
    assert [r[1] for r in results] == ["ok"] * size, results
    assert {r[2] for r in results} == {"shm"}
    assert not any(r[3] for r in results), "mpi4py was imported"
    assert _shm_files() <= before


def _subgroup_made_again(rank, size, port, out):
    import time
    try:
        world, _store = _group(rank, size, port, timeout=20)
        for epoch in range(3):
            if rank == 0:
                time.sleep(0.5)   # (rank 1 comes first to each making: the last one's keys are there)
            if rank in (0, 1):
                sub = world.subgroup([0, 1])
                x = np.full(5, float(rank + 10 * epoch), np.float32)
                sub.allreduce(x)
                assert np.array_equal(x, np.full(5, 1.0 + 20 * epoch, np.float32)), (epoch, x)
                sub.free()
            world.barrier()
        out.put((rank, "ok"))
    except BaseException as exc:  # reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def test_a_subgroup_of_a_store_made_group_made_again_meets_anew():
    """world.subgroup([0, 1]) once an epoch, freed after use, on a group made through a store: each
    making meets under keys of its own. (It met under the same prefix each time: rank 1, first to the
    second making, read rank 0's keys of the first, a segment already gone, and failed.)"""
    before = _shm_files()
    _all_ok(_subgroup_made_again, 3)
    assert _shm_files() <= before


def _subgroups_of_one_name(rank, size, port, out):
    import time
    try:
        world, _store = _group(rank, size, port, timeout=20)
        got = []
        for members in ([0, 1], [1, 2]):   # (rank 1 makes both: its second "pair" is rank 2's first)
            if rank in members:
                sub = world.subgroup(members, name="pair")
                x = np.full(3, rank + 1.0, np.float32)
                sub.allreduce(x)
                got.append(float(x[0]))
                sub.free()
        world.barrier()
        start = time.monotonic()
        for name in ("ordered", None):   # the same members in two orders: both ranks would take position 0
            try:
                world.subgroup([0, 1, 2] if rank == 0 else [1, 0, 2], name=name)
                got.append("made")
            except ValueError as exc:
                got.append((str(exc), time.monotonic() - start < 10))
        out.put((rank, "ok", got))
    except BaseException as exc:  # reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}", None))


def test_subgroups_of_one_name_meet_only_their_members_and_in_one_order():
    """Made through a store by hand, two subgroups of one name but other members ([0, 1] and [1, 2],
    "pair") each reduce over their own members (ranks 0 and 2 met as one group, rank 1's second making
    failed in the store), and members given one list in two orders are refused at once, naming both
    lists, with a name given or not (they timed out naming ranks that never joined, all of which had)."""
    before = _shm_files()
    results = _all_ok(_subgroups_of_one_name, 3)
    sums = {0: [3.0], 1: [3.0, 5.0], 2: [5.0]}
    for rank, _, got in results:
        assert got[:-2] == sums[rank], (rank, got)
        for name, (text, soon) in zip(("'ordered'", r"'world/\d-\d-2'"), got[-2:]):
            assert soon and re.search(rf"engine subgroup {name}: rank \d was given ranks \[\d, \d, 2\] where this "
                                      r"rank \(\d\) was given \[\d, \d, 2\]: every rank must pass the same ranks to "
                                      r"subgroup\(\)", text), (rank, text)
    assert _shm_files() <= before


def test_a_group_of_one_made_without_a_store_makes_subgroups():
    """Communicator.single() has no store: its subgroup([0]) is made alone, as before the members'
    agreement on their order (which would have asked the store it does not have)."""
    from engine import Communicator

    sub = Communicator.single().subgroup([0], name="alone")
    x = np.full(3, 2.0, np.float32)
    sub.allreduce(x)
    assert sub.size == 1 and (x == 2).all()


def _sized(rank, size, port, out):
    try:
        import torch.distributed as dist
        import engine
        store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=__import__("datetime").timedelta(seconds=30),
                              wait_for_workers=False)
        told = 3 if rank == 2 else 2
        comm = engine.Communicator.from_store(store, rank, told, timeout=20)
        if rank < 2:
            x = np.ones(3, np.float32)
            comm.allreduce(x)
            assert np.all(x == 2)
        out.put((rank, "ok"))
        store.wait(["done"] if rank == 0 else [])   # (rank 0 hosts the store until rank 2 has read it)
    except BaseException as exc:  # reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))
        store.set("done", "1")


def test_a_rank_told_a_larger_group_than_the_others_names_the_size():
    """Ranks 0 and 1 make a group of 2; rank 2, told a group of 3 (its WORLD_SIZE), reads their parts
    as well as its own: it names the sizes that differ. (It read on, and failed attaching the segment,
    'the ranks disagree on the group (corrupt bootstrap?)'.)"""
    procs, out = _run(_sized, 3)
    results = sorted(out.get(timeout=120) for _ in range(3))
    for p in procs:
        p.join(30)
    assert results[:2] == [(0, "ok"), (1, "ok")], results
    assert "have different settings (the group's size=2 on rank 0, 3 on rank 2 (WORLD_SIZE" in results[2][1], results


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_peer_is_named_well_before_the_timeout(transport):
    """Every survivor names rank 1. Over TCP, rank 2 comes to its allreduce 1 s late, once rank 0 has
    seen the loss and given the group up: rank 0's goodbye, read first, names the rank it lost (it
    named rank 0 alone, "gave the group up")."""
    before = _shm_files()
    procs, out = _run(_dies, 3, transport)
    results = sorted(out.get(timeout=60) for _ in range(2))  # rank 1 is gone
    for p in procs:
        p.join(30)
    for rank, message in results:
        assert rank in (0, 2)
        # the liveness check's error (the group's 60 s timeout would raise EngineTimeout, after the get's)
        assert "EnginePeerLost" in message, message
        assert re.search(r"rank 1 \(pid \d+\) exited" if transport == "shm" else
                         r"rank 1 \(.*\) (closed its connection|was lost)", message), message
    assert procs[1].exitcode == -signal.SIGKILL
    assert _shm_files() <= before


def _gives_up_in_one_stage(rank, size, port, out):
    """Ranks of two "sockets" ({0, 1}, {2, 3}: a hierarchy of shared-memory stages); rank 2 times out
    (0.5 s) in its socket's stage waiting for rank 3, which comes 3 s late; the others' timeout is 30 s."""
    os.environ["ENGINE_SOCKETS"] = "2"
    import time
    import engine
    comm, _store = _group(rank, size, port, timeout=30)
    x = np.ones(1 << 18, np.float32)   # (1 MB: hierarchical)
    comm.allreduce(x)
    if rank == 2:   # (only now: a group's making waits its timeout too, and a slow start is not the case)
        comm.set_timeout(0.5)
    staged = str(comm.algorithm_for(x.nbytes))
    if rank == 3:
        time.sleep(3)
    start = time.monotonic()
    try:
        comm.allreduce(x)
        out.put((rank, staged, "returned", time.monotonic() - start))
    except engine.EngineError as exc:
        out.put((rank, staged, f"{type(exc).__name__}: {exc}", time.monotonic() - start))
    time.sleep(8)   # (alive: its peers learn of its failure from the group, not from its exit)


def test_a_rank_that_gives_up_in_one_stage_of_a_hierarchy_gives_up_its_other_stages_too():
    """Rank 2's timeout in its socket's stage broke the group and that stage only: rank 0, waiting for
    rank 2 in the stage across sockets, waited there until rank 2's process ended (or its own timeout),
    and so did rank 1 for the late rank 3. A group that breaks now breaks its stages too, and each tells
    its peers at once. The stages' errors name their own ranks: they say which those are in the group."""
    procs, out = _run(_gives_up_in_one_stage, 4)
    results = sorted(out.get(timeout=120) for _ in range(4))
    for p in procs:
        p.join(30)
    assert all("composite" in staged or "hier" in staged for _, staged, _, _ in results), results
    for rank, _, what, seconds in results:
        assert what.startswith("EngineTimeout"), (rank, what)
        assert "gave the group up" in what or rank == 2, (rank, what)
        # rank 0 fails at rank 2's timeout (0.5 s); rank 1, and rank 3 as it comes (3 s late), at rank 3's
        assert seconds < (2.0 if rank in (0, 2, 3) else 5.0), (rank, what, seconds)
    # (a stage's errors name its own ranks, and say which they are in the whole group)
    assert "[a stage of group 'world': its ranks 0, 1 are ranks 0, 2 there]" in results[0][2], results[0]
    assert "[a stage of group 'world': its ranks 0, 1 are ranks 2, 3 there]" in results[2][2], results[2]


HIER_MODES = {"off": "twoshot", "slice": "hier", "leader": "leader"}   # (mode: its 1 MB allreduce)


def _in_hier_modes(rank, size, port, out):
    """4 ranks on two forced "sockets", a group in each ENGINE_HIER mode: its allreduce's entry (1 MB:
    over the hierarchy's threshold), its count of stages, and a 1 MB and an odd-sized allreduce and
    broadcast checked against what this rank computes."""
    os.environ.update(ENGINE_SOCKETS="2", ENGINE_THREADS="1")   # (a host of 8+ cores takes twoshot_threads)
    import torch.distributed as dist
    import engine
    try:
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=__import__("datetime").timedelta(seconds=30))
        for mode in HIER_MODES:
            os.environ["ENGINE_HIER"] = mode
            comm = engine.Communicator.from_store(store, rank, size, prefix=mode, timeout=60)
            for n in (1 << 18, 100_003):
                x = np.arange(n, dtype=np.float32) % 7 + rank
                comm.allreduce(x)
                assert np.array_equal(x, sum(np.arange(n, dtype=np.float32) % 7 + r for r in range(size))), (mode, n)
                b = np.full(n, rank, np.int32)
                comm.broadcast(b, root=1)
                assert np.all(b == 1), (mode, n)
            out.put((rank, mode, str(comm.algorithm_for(1 << 20)), len(comm._stages)))
            comm.free()
        out.put((rank, "ok", None, None))
    except BaseException as exc:  # reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}", None, None))


def test_engine_hier_keeps_a_group_flat_or_picks_its_hierarchys_allreduce():
    """ENGINE_HIER, run (tests/test_registry.py checks the plans it makes): off keeps a group of two
    forced sockets flat; slice and leader build its stages and pick their own allreduce. The results are
    right in each."""
    procs, out = _run(_in_hier_modes, 4)
    results = [out.get(timeout=120) for _ in range(4 * (len(HIER_MODES) + 1))]
    for p in procs:
        p.join(30)
    assert sorted(r[1] for r in results if r[2] is None) == ["ok"] * 4, results
    for mode, entry in HIER_MODES.items():
        got = [r for r in results if r[1] == mode]
        assert len(got) == 4 and all(r[2] == entry and (r[3] == 0) == (mode == "off") for r in got), got


def _lost_after_a_mismatch(rank, size, port, out):
    """3 ranks: ranks 0 and 2 all-reduce where rank 1 broadcasts (a mismatch breaks the collectives);
    then rank 0 receives from rank 2, which dies (SIGKILL) instead of sending, while rank 1 lives on."""
    import engine
    comm, store = _group(rank, size, port, timeout=30)
    x = np.ones(1 << 14, np.float32)
    try:
        comm.broadcast(x, root=1) if rank == 1 else comm.allreduce(x)
        first = "returned"
    except engine.EngineError as exc:
        first = f"{type(exc).__name__}: {exc}"
    store.set(f"broke {rank}", "")
    store.wait([f"broke {r}" for r in range(size)])
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        try:
            comm.recv(np.zeros(4, np.float32), 2, 7)
            out.put((rank, first, "returned"))
        except engine.EngineError as exc:
            out.put((rank, first, f"{type(exc).__name__}: {exc}"))
        store.set("received", "")
    else:
        store.wait(["received"])
        out.put((rank, first, None))


def test_a_peer_lost_to_a_message_is_named_not_the_one_a_collective_failed_on_before():
    """The segment's word of the rank a collective failed on (here a mismatch with rank 1) named that
    rank, alive, in a later message's error: `rank 1 (pid N) exited while rank 0 waited for it in
    irecv`. A message's error names the peer its own channel lost: rank 2."""
    procs, out = _run(_lost_after_a_mismatch, 3)
    results = sorted(out.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(30)
    (_, first, message), (_, _, none) = results
    assert first.startswith("EngineMismatch") and "rank 1: broadcast" in first, results
    assert re.match(r"EnginePeerLost: irecv failed: rank 2 \(pid \d+\) exited", message), results
    assert none is None and procs[1].exitcode == 0 and procs[2].exitcode == -signal.SIGKILL, results


def _killed_before_a_broadcast(rank, size, port, out):
    """3 ranks; rank 1 dies (SIGKILL) before the second broadcast of 16 MB from rank 2 (by single copy,
    where the group may: the root writes each reader's tail, the readers copy the head)."""
    import engine
    comm, _store = _group(rank, size, port, timeout=30)
    x = np.full(1 << 22, rank, np.float32)
    comm.broadcast(x, root=2)
    algorithm = str(comm.algorithm_for(x.nbytes, "broadcast"))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.broadcast(x, root=2)
        out.put((rank, algorithm, "returned"))
    except engine.EngineError as exc:
        out.put((rank, algorithm, f"{type(exc).__name__}: {exc}"))


def test_a_reader_of_a_broadcast_whose_root_could_not_finish_names_the_rank_lost():
    """The root of a single-copy broadcast writes no reader's tail once a reader is dead, and tells the
    readers so: a reader whose tail was not written blamed the root's memory (`a single copy from or to
    rank 2's memory failed: rank 2 left this call`), though rank 2 was alive and had lost rank 1. Its
    error names rank 1 now, as the root's does (three runs: where a reader sees rank 1 gone first, it
    names it too)."""
    for _ in range(3):
        procs, out = _run(_killed_before_a_broadcast, 3)
        results = sorted(out.get(timeout=120) for _ in range(2))
        for p in procs:
            p.join(30)
        if "single_copy" not in results[0][1]:
            pytest.skip(f"no single copy here ({results[0][1]})")
        for rank, _, what in results:
            assert what.startswith("EnginePeerLost") and re.search(r"rank 1 \(pid \d+\) exited", what), (rank, what)
        assert procs[1].exitcode == -signal.SIGKILL


def _killed_in_one_stage(rank, size, port, out):
    """Ranks of two "sockets" ({0, 1}, {2, 3}), as above; rank 3 dies (SIGKILL) before the second
    allreduce."""
    os.environ["ENGINE_SOCKETS"] = "2"
    import engine
    comm, _store = _group(rank, size, port, timeout=30)
    x = np.ones(1 << 18, np.float32)   # (1 MB: hierarchical)
    comm.allreduce(x)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.allreduce(x)
        out.put((rank, "returned"))
    except engine.EngineError as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def test_a_rank_lost_in_one_stage_of_a_hierarchy_is_named_in_the_others():
    """Rank 3 dies: ranks 1 and 2, in a stage with it, see its process end; rank 0, in none, heard only
    that rank 1 or rank 2 gave the group up, and named neither rank 3 nor why. A rank that gives a stage
    up over a lost rank now says which (in the numbering of the whole group), and its peers name it."""
    procs, out = _run(_killed_in_one_stage, 4)
    results = dict(out.get(timeout=60) for _ in range(3))
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0, -signal.SIGKILL], results
    assert re.match(r"EnginePeerLost: allreduce failed: rank 3 of group 'world' was lost: rank 1 \(pid \d+\) gave "
                    r"the group up while rank 0 waited for it in \w+ #\d+: a call of it failed there over that loss; "
                    r"none of the group's collectives can end \[a stage of group 'world': its ranks 0, 1 are ranks "
                    r"0, [12] there\]", results[0]), results
    for rank in (1, 2):   # (rank 3 is rank 1 of both of their stages with it)
        assert re.search(r"rank 1 \(pid \d+\) (exited|was lost)", results[rank]), results
        assert "are ranks 1, 3 there]" in results[rank] or "are ranks 2, 3 there]" in results[rank], results


def test_a_store_bootstrap_names_the_missing_ranks_or_a_store_that_stopped_answering():
    """A rank that never writes its part is named at the group's timeout (else the store's); a store
    whose server is gone (torch raises on every call) is named as such, not as every rank missing; a
    store that says why it went (a reconfigure's hub closed) passes that on."""
    from datetime import timedelta

    import torch.distributed as dist
    from engine.bootstrap import StoreBootstrap

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.2))
    store.set("g/boot/0/2", __import__("pickle").dumps("rank 2's"))
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 3 never joined the bootstrap of the group \(g\)"):
        StoreBootstrap(store, 0, 3, "g").allgather("rank 0's")
    # the group's own timeout bounds the wait, not the store's (the world's: 30 minutes by default)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))   # (its wait says how long)
    store.set("h/boot/0/2", __import__("pickle").dumps("rank 2's"))
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 3 never joined the bootstrap of the group \(h\): "
                                           r"wait timeout after 200ms$"):
        StoreBootstrap(store, 0, 3, "h", timeout=0.2).allgather("rank 0's")

    class Gone:
        def set(self, key, value):
            pass

        def get(self, key):
            raise dist.DistNetworkError("Broken pipe")

        check = get

    with pytest.raises(RuntimeError, match=r"the store stopped answering in the group's bootstrap \(g\): "
                                           r"Broken pipe; its server may have run in a process that has exited"):
        StoreBootstrap(Gone(), 0, 3, "g").allgather("rank 0's")

    class HubClosed:   # a reconfigure member's store: its read timed out, then the hub closed
        def set(self, key, value):
            pass

        def get(self, key):
            raise TimeoutError(f"reconfigure: no member set {key!r} in time")

        def check(self, keys):
            raise ConnectionError("the hub (10.0.0.1:9) closed the connection: it failed or was aborted")

    with pytest.raises(ConnectionError, match=r"^the group's bootstrap \(g\): reconfigure: no member set "
                                              r"'g/boot/0/0' in time; then the hub \(10.0.0.1:9\) closed"):
        StoreBootstrap(HubClosed(), 0, 3, "g").allgather("rank 0's")

    class GoneAtOnce(Gone):   # (a shrink's members after rank 0, the store's host, died: its first set fails)
        def set(self, key, value):
            raise dist.DistNetworkError("Broken pipe")

    with pytest.raises(RuntimeError, match=r"the store stopped answering in the group's bootstrap \(g\): "
                                           r"Broken pipe; its server may have run in a process that has exited"):
        StoreBootstrap(GoneAtOnce(), 0, 3, "g").allgather("rank 0's")


def test_a_store_bootstrap_cancelled_leaves_its_word_so_a_member_coming_later_fails_at_once():
    """Rank 0's making is cancelled (its group aborted) while it waits for rank 1: rank 1, coming
    later, fails at once naming rank 0 and why, where it found rank 0's part, went on to the next
    exchange and waited there for rank 0 until its timeout (a shrink aborted on the other members)."""
    import threading
    import time

    import torch.distributed as dist
    from engine.bootstrap import MakingGivenUp, StoreBootstrap

    store, cancels = dist.HashStore(), []
    first = StoreBootstrap(store, 0, 2, "g", on_cancel=cancels.append, timeout=30)
    threading.Timer(0.3, lambda: cancels[0]("group 'w' was aborted (abort())")).start()
    with pytest.raises(ConnectionError, match=r"group 'w' was aborted"):
        first.allgather("rank 0's")
    start = time.monotonic()
    with pytest.raises(MakingGivenUp, match=r"rank 0 gave this making up .*\(its making was cancelled \(group 'w' "
                                            r"was aborted \(abort\(\)\)\)\)"):
        StoreBootstrap(store, 1, 2, "g", timeout=30).allgather("rank 1's")
    assert time.monotonic() - start < 5


def test_a_store_bootstrap_reads_every_rank_in_one_round_trip_where_the_store_can():
    """An exchange through torch's store reads every rank's part with one multi_get (one round trip to
    rank 0's store, not one a rank: what a large world's init paid seven times over); a store without
    multi_get is read a key at a time. Both give every rank's part, in order; a store without wait (a
    reconfigure's, whose reads wait for their keys) is not asked for each key twice."""
    import pickle

    import torch.distributed as dist
    from engine.bootstrap import StoreBootstrap

    class Counted:
        def __init__(self, store, multi):
            self.store, self.calls = store, []
            if multi:
                self.multi_get = lambda keys: (self.calls.append("multi_get"), store.multi_get(keys))[1]

        def set(self, key, value):
            self.store.set(key, value)

        def get(self, key):
            self.calls.append("get")
            return self.store.get(key)

        def check(self, keys):
            return self.store.check(keys)

    for multi in (True, False):
        store = Counted(dist.HashStore(), multi)
        for r in (1, 2, 3):
            store.set(f"g/boot/0/{r}", pickle.dumps(f"rank {r}'s"))
        assert StoreBootstrap(store, 0, 4, "g").allgather("rank 0's") == [f"rank {r}'s" for r in range(4)]
        assert store.calls.count("multi_get") == (1 if multi else 0), store.calls
        assert store.calls.count("get") == (0 if multi else 4), store.calls   # (the reads wait for their keys)

    class OwnStore(dist.Store):   # a user's store that defines get only: torch's multi_get calls it
        def __init__(self):
            super().__init__()
            self.values = {}

        def set(self, key, value):
            self.values[key] = value if isinstance(value, bytes) else value.encode()

        def get(self, key):
            return self.values[key]

    store = OwnStore()
    for r in (1, 2):
        store.set(f"u/boot/0/{r}", pickle.dumps(f"rank {r}'s"))
    assert StoreBootstrap(store, 0, 3, "u").allgather("rank 0's") == [f"rank {r}'s" for r in range(3)]


def test_a_making_under_a_prefix_this_rank_made_a_group_under_before_is_refused_naming_it():
    """Communicator.from_store made again under one name (its prefix, "engine/<name>") read the last
    making's keys as this one's: its ranks met the last group's segment and failed saying it was no
    segment this engine made. The exchange's first round now refuses it, naming the prefix."""
    import torch.distributed as dist
    from engine.bootstrap import StoreBootstrap

    store = dist.HashStore()
    store.set("g/boot/0/1", __import__("pickle").dumps("rank 1's"))
    assert StoreBootstrap(store, 0, 2, "g").allgather("rank 0's") == ["rank 0's", "rank 1's"]
    with pytest.raises(ValueError, match=r"this rank \(0\) made a group under the prefix 'g' in this store before, "
                                         r"and the last making's keys would be read as this one's: give each making a "
                                         r"prefix of its own \(Communicator.from_store's prefix=\)"):
        StoreBootstrap(store, 0, 2, "g").allgather("rank 0's")


def test_a_member_that_comes_to_an_exchange_after_another_gave_the_making_up_fails_at_once():
    """Rank 1 of a making (a shrink's: its waits poll, on_cancel given) was stopped (SIGSTOP) while
    rank 0 waited for it in an exchange; rank 0 gave up at its timeout. Rank 1, continued, found rank
    0's part of that exchange and went on: to make the group (its next call failed), or to wait in the
    next exchange its whole timeout and say rank 0 never joined. Rank 0 leaves in its part that it gave
    up, and why, and rank 1 fails at once saying so."""
    import torch.distributed as dist
    from engine.bootstrap import MakingGivenUp, MissingRanks, StoreBootstrap

    store = dist.HashStore()
    with pytest.raises(MissingRanks):
        StoreBootstrap(store, 0, 2, "g", timeout=0.2, on_cancel=lambda fn: None).allgather("rank 0's")
    late = StoreBootstrap(store, 1, 2, "g", timeout=30, on_cancel=lambda fn: None)
    # (rank 0's part, set before it waited, says it gave up: rank 1 completed the exchange with it and
    # went on to make a group the others had given up)
    with pytest.raises(MakingGivenUp, match=r"rank 0 gave this making up before this rank came \(it waited for ranks "
                                            r"\[1\] in exchange #1 of the making\)"):
        late.allgather("rank 1's")   # (at its timeout, 30 s: MissingRanks)


def test_a_rank_whose_part_of_the_making_failed_says_so_and_raises_without_waiting_for_the_others():
    """A rank whose part of a making failed (its connects to a rank beyond a cut link timed out) waited
    in the next exchange for the others' parts, which it never reads, as long again: for that rank's
    part, never set there (20 s in all, where docs/hosts.md says the timeout). It now leaves its part,
    saying why, and raises its own error at once; a member coming later reads it."""
    import time

    import torch.distributed as dist
    from engine.bootstrap import StoreBootstrap, gather

    def connect():
        raise RuntimeError("engine: rank 0 could not connect to rank 1 within 10 s")
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 could not connect to rank 1"):
        gather(StoreBootstrap(store, 0, 2, "g", timeout=30), connect, "open its end of the group")
    assert time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match=r"group was not made: rank 0 could not open its end of the group "
                                           r"\(RuntimeError: engine: rank 0 could not connect to rank 1"):
        gather(StoreBootstrap(store, 1, 2, "g", timeout=30), lambda: "mine", "open its end of the group")


def test_a_member_that_came_and_gave_up_is_not_named_among_those_that_never_joined():
    """Rank 1 of 4 came to an exchange of the making, and gave it up at its shorter timeout; rank 0,
    at its own, named ranks [1, 2, 3] as never joined, where rank 1 had (it took its part back). Rank
    1's part now says it gave up, and rank 0 names only the ranks that never came."""
    import threading
    import time

    import torch.distributed as dist
    from engine.bootstrap import MissingRanks, StoreBootstrap

    store, errors = dist.HashStore(), {}

    def member(rank, timeout):
        try:
            StoreBootstrap(store, rank, 4, "g", timeout=timeout).allgather(f"rank {rank}'s")
        except MissingRanks as exc:
            errors[rank] = str(exc)
    first = threading.Thread(target=member, args=(0, 1.0))
    first.start()
    time.sleep(0.1)   # (rank 0 came first)
    member(1, 0.2)
    first.join()
    assert re.search(r"ranks \[2, 3\] of 4 never joined", errors[1]), errors
    assert re.search(r"ranks \[2, 3\] of 4 never joined", errors[0]), errors


def test_a_step_that_failed_because_another_member_gave_the_making_up_says_it_gave_up():
    """Rank 1, stopped in a shrink's making while rank 0 gave it up and freed the segment, could not
    attach that segment when it came back, and said only that (`no segment this engine made`): the
    exchange carrying its failure finds that rank 0 gave the making up, and says that instead."""
    import torch.distributed as dist
    from engine.bootstrap import MakingGivenUp, MissingRanks, StoreBootstrap, gather

    store = dist.HashStore()
    with pytest.raises(MissingRanks):
        StoreBootstrap(store, 0, 2, "g", timeout=0.2, on_cancel=lambda fn: None).allgather("rank 0's")

    def attach():
        raise RuntimeError("engine shm: rank 1 cannot open rank 0's segment: not a segment this engine made")
    with pytest.raises(MakingGivenUp, match=r"rank 0 gave this making up before this rank came"):
        gather(StoreBootstrap(store, 1, 2, "g", timeout=30, on_cancel=lambda fn: None), attach, "attach it")


def test_a_rank_missing_from_an_exchange_of_the_making_is_waited_for_once():
    """Rank 1 came to the first exchange of the group's making and never to the next (the shared
    segment's): rank 0 names it at the group's timeout and starts no further exchange, where one
    would wait for it as long again before the error."""
    import torch.distributed as dist
    import engine

    class FirstRoundOnly(dist.Store):   # rank 1 says in the first exchange what rank 0 says, then nothing
        def __init__(self):
            super().__init__()
            self.store, self.rounds = dist.HashStore(), []

        def set(self, key, value):
            self.store.set(key, value)
            if key.endswith("/0") and not value.startswith(b"gave up"):   # (not its word that it gave up)
                self.rounds.append(key)
            if key == "g/boot/0/0":
                self.store.set("g/boot/0/1", value)

        def get(self, key):
            return self.store.get(key)

        def check(self, keys):
            return self.store.check(keys)

        def wait(self, keys, timeout):
            return self.store.wait(keys, timeout)

    store = FirstRoundOnly()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 2 never joined the bootstrap of group 'g' \(g\)"):
        engine.Communicator.from_store(store, 0, 2, prefix="g", transport="shm", timeout=0.5, name="g")
    assert store.rounds == ["g/boot/0/0", "g/boot/1/0"], store.rounds


def test_a_given_up_word_no_rank_wrote_is_said_whole_naming_no_rank():
    """A making's given-up word (rank, why) that no rank of this engine wrote is said as it is, where
    its parse failed and the wait around it read that as ranks that never joined."""
    import torch.distributed as dist
    from engine.bootstrap import _given_up

    store = dist.HashStore()
    assert _given_up(store, "g") is None
    store.set("g/given-up", "3 it waited for ranks [1] in exchange #2")
    assert _given_up(store, "g") == (3, "it waited for ranks [1] in exchange #2")
    for word in (b"\xffnonsense", b"", b"-1 why"):
        store.set("g/given-up", word)
        rank, why = _given_up(store, "g")
        assert rank == -1 and why.startswith("(the store's word, unread: "), (word, why)


def test_a_bootstrap_value_naming_code_is_refused_unrun():
    """Whoever can write to the store could leave a pickle that runs code where it is read: the ranks
    exchange plain data only, and a value naming a function is refused, unrun."""
    import pickle

    import torch.distributed as dist
    from engine.bootstrap import StoreBootstrap

    class Runs:
        def __reduce__(self):
            return (os.system, ("touch /nonexistent/ran",))

    store = dist.HashStore()
    store.set("g/boot/0/1", pickle.dumps(Runs()))
    with pytest.raises(pickle.UnpicklingError, match=r"names posix.system: only plain data"):
        StoreBootstrap(store, 0, 2, "g", timeout=5).allgather(("rank 0's", {1, 2}, [3.5, b"x"], None))


_RANK_SCRIPT = """
import datetime, sys
import numpy as np
import torch.distributed as dist
from engine import Communicator
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
comm = Communicator.from_store(store, rank, 2, timeout=30)
x = np.full(4, rank + 1.0)
comm.allreduce(x)
print(comm.transport, x.tolist(), flush=True)
comm.free()
"""


_EXITS_WITH_A_SEND_IN_FLIGHT = """
import atexit, time
atexit.register(time.sleep, 3)   # (registered before the engine's handlers: runs after the group is left)
import datetime, sys
import numpy as np
import torch.distributed as dist
from engine import Communicator
rank, port, n = int(sys.argv[1]), int(sys.argv[2]), 1 << 20
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
comm = Communicator.from_store(store, rank, 2, timeout=30)
if rank == 0:
    kept = comm.isend(np.arange(n, dtype=np.float32), 1, tag=3)   # never waited: the process ends with it
    store.set("sent", "1")
else:
    store.wait(["sent"])
    time.sleep(1)   # (rank 0 has left the group at its exit by now)
    got = np.zeros(n, np.float32)
    comm.recv(got, 0, tag=3)
    print(comm.algorithm_for(4 * n, "sendrecv"), bool((got == np.arange(n, dtype=np.float32)).all()), flush=True)
    comm.free()
"""


def test_a_send_left_in_flight_at_a_normal_exit_still_arrives():
    """A rank's script ends with a large isend in flight (never waited), its process alive a while after
    the engine's exit handler left the group: the receive made then gets the message whole, as MPI
    delivers a freed request's send. Leaving at exit withdraws nothing, where free() or abort() do
    (tests/mpi/test_errors.py's withdrawn send)."""
    import subprocess

    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [subprocess.Popen([sys.executable, "-c", _EXITS_WITH_A_SEND_IN_FLIGHT, str(rank), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    algorithm, whole = outs[1][0].split()
    if algorithm != "single_copy":
        pytest.skip(f"no single copy here ({algorithm}): the sender moves its message itself")
    assert whole == "True", outs


def test_ranks_of_one_host_in_different_pid_namespaces_meet_over_tcp():
    """Two containers on one host that share its name but not its process ids (Kubernetes' hostNetwork
    pods) can't attach each other's segment through /proc/<pid>: they are different hosts, over TCP."""
    import shutil
    import subprocess

    from ports import free_port
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                                         capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not allowed here")
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [subprocess.Popen(prefix + [sys.executable, "-c", _RANK_SCRIPT, str(rank), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, prefix in ((0, []), (1, ["unshare", "--pid", "--fork", "--mount-proc"]))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [o.strip() for o, _ in outs] == ["tcp [3.0, 3.0, 3.0, 3.0]"] * 2, outs


def test_a_stage_one_rank_cannot_make_fails_the_group_on_every_rank():
    """engine.hierarchy.build over a 2x2 layout (4 ranks as threads, one store): rank 0 fails to make
    its host's stage. Every rank raises, rank 0 its own error and the others naming rank 0 and that
    stage, where the other host's ranks would wait in the next split; the stages made are freed."""
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist
    from engine import hierarchy
    from engine.bootstrap import StoreBootstrap

    store, outcome, freed = dist.HashStore(), {}, []

    def make_stage(sub, transport, name):
        if name == "g/host0" and sub.rank == 0:
            raise OSError("no memory for the stage's segment")
        return SimpleNamespace(free=lambda: freed.append(name))

    def rank(r):
        boot = StoreBootstrap(store, r, 4, "g", timeout=30)
        boot.group = "g"
        try:
            hierarchy.build(SimpleNamespace(rank=r, name="g", transport="shm"), boot, ([0, 0, 1, 1], [0, 1, 0, 1]),
                            make_stage)
            outcome[r] = "made"
        except Exception as exc:
            outcome[r] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcome[0] == "OSError: no memory for the stage's segment", outcome
    for r in (1, 2, 3):
        assert outcome[r].startswith("RuntimeError: engine: group 'g' was not made: rank 0 could not make its host "
                                     "stage (OSError: no memory for the stage's segment)"), outcome
    assert sorted(freed) == ["g/host0", "g/host1", "g/host1"], freed   # (rank 1's and the other host's)


def test_single_copy_insisted_on_by_a_group_of_one_or_refused_by_a_group_where_a_probe_fails():
    """ENGINE_SHM_CMA=1 refuses a group where some rank's single-copy probe failed, on every rank; a
    group of one has nothing to copy between ranks and is made (a plain `python script.py`)."""
    import numpy as np
    import pytest

    import engine
    from engine.bootstrap import agree_on_single_copy

    assert agree_on_single_copy([(True, False), (True, True)]) is True
    assert agree_on_single_copy([(True, False), (False, False)]) is False
    with pytest.raises(RuntimeError, match="ENGINE_SHM_CMA=1, but process_vm_readv between the ranks is not allowed"):
        agree_on_single_copy([(True, True), (False, False)])
    assert agree_on_single_copy([(False, True)]) is False
    mp = pytest.MonkeyPatch()
    mp.setenv("ENGINE_SHM_CMA", "1")
    try:
        comm = engine.Communicator.single(name="one")
        x = np.arange(5, dtype=np.float32)
        comm.allreduce(x)
        assert x.tolist() == [0, 1, 2, 3, 4]
        comm.free()
    finally:
        mp.undo()


def test_groups_of_other_names_on_one_store_keep_apart_and_a_wrong_rank_or_size_is_refused():
    """Two groups made through one store under different names (here two ranks as threads of one
    process, the second group's rank 1 a second late): each meets under its own name's keys. All used
    "engine/world", so the second's rank 0 read the first's keys, got a group that looked whole and
    timed out in its first call (rank 1 failed opening a segment 'whose size is not the agreed one').
    A rank outside 0..size-1, or a size under 1, is refused at once (it waited the timeout, or gave
    another rank)."""
    import threading
    import time

    import torch.distributed as dist

    from engine import Communicator

    store = dist.HashStore()
    groups, errors = {}, []

    def make(name, rank, late=0.0):
        try:
            time.sleep(late)
            comm = Communicator.from_store(store, rank, 2, transport="shm", name=name, timeout=10)
            x = np.full(5, rank + 1.0)
            comm.allreduce(x)
            assert np.array_equal(x, np.full(5, 3.0)), (name, x)
            groups[(name, rank)] = comm
        except Exception as exc:
            errors.append((name, rank, exc))

    for name, late in (("a", 0.0), ("b", 1.0)):
        threads = [threading.Thread(target=make, args=(name, r, late * r)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and sorted(groups) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)], errors
    for comm in groups.values():
        comm.free()
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=rf"from_store: rank {rank} of size {size}: size is the number of ranks"):
            Communicator.from_store(store, rank, size, transport="shm", timeout=2)


def test_a_call_after_abort_is_told_the_group_was_aborted_not_that_it_waited():
    """A call made after abort() is refused, saying the abort ends the waits and refuses later calls
    (it said 'the group was aborted ... while this rank waited', of a call that never waited)."""
    import torch.distributed as dist

    from engine import Communicator, EngineAborted

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    comm.abort()
    try:
        for call in (lambda: comm.allreduce(np.ones(3, np.float32)), comm.barrier, lambda: comm.send(np.ones(3), 0)):
            with pytest.raises(EngineAborted, match=r"failed: the group was aborted \(ProcessGroup.abort\(\) or "
                                                    r"Communicator.abort\(\)\): it ends the waits under way and "
                                                    r"refuses every later call$"):
                call()
    finally:
        comm.free()


def test_a_freed_communicators_every_call_raises_engine_aborted_saying_so():
    """After free() every call raises EngineAborted naming the destroy, as docs/errors.md says (it
    raised AttributeError on its missing core), and check_usable() refuses (it said usable)."""
    import torch.distributed as dist

    from engine import Communicator, EngineAborted

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    comm.free()
    comm.free()   # (twice: nothing more to free)
    calls = {"allreduce": (np.ones(3),), "broadcast": (np.ones(3),), "barrier": (), "send": (np.ones(3), 0),
             "irecv": (np.ones(3), 0), "algorithm_for": (64,), "allreduce_parts": ([np.ones(3)],),
             "subgroup": ([0],), "check_usable": ("allgather",)}
    for name, args in calls.items():
        shown = "allgather" if name == "check_usable" else name
        with pytest.raises(EngineAborted, match=rf"^{shown} failed: the group was destroyed \(destroy_process_group or "
                                                 r"Communicator\.free\(\)\): create a new group$"):
            getattr(comm, name)(*args)
    comm.abort()   # (a no-op on a freed group)


def test_a_timeout_argument_that_is_negative_nan_or_not_a_number_is_refused_and_numpy_outputs_named():
    """A group's timeout, set_timeout's and a call's (call_timeout) are refused where negative or NaN,
    as ENGINE_TIMEOUT is (NaN never timed out: a receive nobody sends to waited for ever; -1 timed out
    at once), or not a number (a TypeError from deep inside). A read-only or non-C-contiguous numpy
    output is named with the fix, as other buffers are (numpy's own ValueError came out bare)."""
    import torch.distributed as dist

    from engine import Communicator

    for bad, kind in ((float("nan"), ValueError), (-1, ValueError), ("abc", TypeError)):
        with pytest.raises(kind, match=r"timeout must be a number of seconds >= 0 \(inf: never\), got"):
            Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", timeout=bad)
    with pytest.raises(ValueError, match=r"a group's timeout of 0 would time every call out at once; give seconds > 0"):
        Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", timeout=0)
    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", timeout=float("inf"))
    try:
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0"):
            comm.set_timeout(float("nan"))
        with pytest.raises(ValueError, match=r"a call's timeout must be a number of seconds >= 0"):
            with comm.call_timeout(-2):
                pass
        readonly = np.zeros(4, np.float32)
        readonly.flags.writeable = False
        with pytest.raises(ValueError, match=r"is read-only; the engine writes into it, so pass a writable"):
            comm.allreduce(np.ones(4, np.float32), readonly)
        with pytest.raises(ValueError, match=r"is not C-contiguous; the engine writes into it"):
            comm.allreduce(np.ones(4, np.float32), np.zeros(8, np.float32)[::2])
    finally:
        comm.free()


def test_allreduce_parts_refuses_parts_that_share_memory_and_a_wire_that_is_no_dtype():
    """Communicator.allreduce_parts writes each part's result as its pack goes: two parts on one
    buffer (the same array twice, overlapping views) gave wrong sums (4 where 2 ranks of ones sum to 2),
    so they are refused, naming the fix; a wire that names no dtype raised a bare KeyError."""
    import torch
    import torch.distributed as dist

    from engine import Communicator

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm")
    try:
        x = torch.ones(1000)
        for parts in ([x, x], [x[:600], x[400:]]):
            with pytest.raises(ValueError, match=r"allreduce_parts: two parts share memory"):
                comm.allreduce_parts(parts)
        comm.allreduce_parts([x[:500], x[500:]])
        assert torch.equal(x, torch.ones(1000))
        with pytest.raises(ValueError, match=r"allreduce_parts: wire 'fp16' is not a dtype name: one of .*float16"):
            comm.allreduce_parts([x], wire="fp16")
    finally:
        comm.free()


def test_a_message_that_is_no_whole_number_of_the_receive_buffers_elements_is_refused():
    """A message carries no dtype (as MPI's): 6 bytes received into float32 elements returned a count
    of 1 with the buffer half overwritten; it raises, naming the fix. Whole elements of another dtype
    can't be told apart from the right one (as in MPI)."""
    import torch.distributed as dist

    from engine import Communicator

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm")
    try:
        sent = comm.isend(np.arange(6, dtype=np.uint8), 0, tag=3)
        with pytest.raises(ValueError, match=r"recv from rank 0: 6 bytes arrived, not a whole number of the receive "
                                             r"buffer's 4-byte elements: the sender sent another dtype"):
            comm.recv(np.zeros(2, np.float32), 0, tag=3)
        sent.wait()
        comm.isend(np.arange(8, dtype=np.uint8), 0, tag=4)
        assert comm.recv(np.zeros(2, np.float32), 0, tag=4) == (0, 4, 2)
    finally:
        comm.free()


def test_a_user_op_whose_address_is_no_function_is_refused():
    """A reduce op is any object with _address(dtype) (engine.reduction makes them): one that gives 0 or
    not an integer is refused, where its address was called as a C function."""
    import torch.distributed as dist

    from engine import Communicator

    class NoFunction:
        def __init__(self, address):
            self.address = address

        def _address(self, dtype):
            return self.address

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm")
    try:
        for address in (0, -8, "0x1000", None):
            with pytest.raises(TypeError, match=r"_address\(\) gave .*, not a function's address; make user ops with "
                                                r"engine\.reduction"):
                comm.allreduce(np.ones(3, np.float32), op=NoFunction(address))
    finally:
        comm.free()


def test_counts_that_are_no_whole_numbers_an_op_given_as_a_flag_and_a_sparse_tensor_are_refused_with_the_fix(
        monkeypatch):
    """counts=[2.5] moved 2 elements and then blamed the buffer ('counts[0] is 2'); a string raised a
    bare comparison error. op=True ran PRODUCT (bool is int 1) where debug mode refused it. A sparse
    tensor was told to pass tensor.contiguous(), which gives a sparse tensor again."""
    import torch
    import torch.distributed as dist

    from engine import Communicator

    for debug in ("0", "1"):
        monkeypatch.setenv("ENGINE_DEBUG", debug)
        comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm")
        try:
            send, out = np.ones(3, np.float32), np.zeros(3, np.float32)
            for counts in ([2.5], ["3"], [None]):
                with pytest.raises(TypeError, match=r"allgather counts\[0\] is .*, not a whole number of elements; "
                                                    r"pass ints"):
                    comm.allgather(send, out, counts=counts)
            comm.allgather(send, out, counts=[np.int64(3)])
            assert (out == 1).all()
            for flag in (True, False):
                with pytest.raises(TypeError, match=r"op must be an engine.ReduceOp, its name, or a user op"):
                    comm.allreduce(np.full(3, 2, np.float32), op=flag)
            with pytest.raises(TypeError, match=r"is a torch.sparse_coo tensor: the engine moves dense tensors; pass "
                                                r"tensor.to_dense\(\)"):
                comm.allreduce(torch.ones(3).to_sparse())
        finally:
            comm.free()


def test_debug_mode_refuses_roots_counts_and_dtypes_with_the_calls_own_errors(monkeypatch):
    """ENGINE_DEBUG=1 packs each call's root and counts into its signature before the call checks
    them: a root of 2**70 or counts adding up past 2**63 raised a bare OverflowError from numpy there.
    A numpy array of a dtype no buffer carries (datetime64) was said to be 'not C-contiguous' (debug
    mode's read) or raised numpy's own 'cannot include dtype' (the call's)."""
    import torch.distributed as dist

    from engine import Communicator

    for debug in ("0", "1"):
        monkeypatch.setenv("ENGINE_DEBUG", debug)
        comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm")
        try:
            with pytest.raises(ValueError, match=r"root 1180591620717411303424 is out of range for a group of size 1"):
                comm.broadcast(np.ones(4, np.float32), root=2 ** 70)
            with pytest.raises(TypeError, match=r"root is 'x', not an int"):
                comm.broadcast(np.ones(4, np.float32), root="x")
            with pytest.raises(ValueError, match=r"allgather counts add up to more than \d+ elements"):
                comm.allgather(np.ones(2, np.float32), np.empty(4, np.float32), counts=[2 ** 63])
            for call in (lambda: comm.allreduce(np.ones(4, "M8[s]")), lambda: comm.broadcast(np.ones(4, "M8[s]"))):
                with pytest.raises(TypeError, match=r"\(numpy.ndarray\) has a dtype the engine does not support "
                                                    r"\(cannot include dtype 'M' in a buffer\); supported dtypes: bool"):
                    call()
            x = np.ones(4, np.float32)
            comm.allreduce(x)
            assert (x == 1).all()
            whole = np.zeros(3, np.float32)   # (the root's counts' digest against the ranks' own counts)
            comm.gather(np.ones(3, np.float32), whole, root=0, counts=[3])
            comm.scatter(np.arange(3, dtype=np.float32), x[:3], root=0, counts=[3])
            assert (whole == 1).all() and x[:3].tolist() == [0, 1, 2]
        finally:
            comm.free()


DESTROYED = """
import gc, os, sys, threading
import torch, torch.distributed as dist
gc.disable()
def state():
    return len(os.listdir("/proc/self/fd")), sorted(t.name for t in threading.enumerate())
dist.init_process_group("engine", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
made = state()
dist.destroy_process_group()
destroyed = state()
gc.collect()
print(repr((made, destroyed, state())), flush=True)
"""


def test_destroy_process_group_leaves_no_thread_and_no_socket_for_the_collector():
    """With the collector off (or before it runs), destroy_process_group left the watchdog thread and
    torch's store (its sockets, rank 0's server) alive: the group's watch and core hold each other, and
    the watch held the store. Destroyed now, the process holds what it holds once collected."""
    import ast
    import subprocess
    out = subprocess.run([sys.executable, "-c", DESTROYED, str(free_port())], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    made, destroyed, collected = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert "engine-watchdog" in made[1], made
    assert destroyed == collected, (made, destroyed, collected)


_WORLDS_MADE_ELSEWHERE = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
rank, port, own = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rank == 0:   # a world of its own first, in a store of its own
    dist.init_process_group("engine", init_method=f"tcp://127.0.0.1:{own}", rank=0, world_size=1)
    dist.destroy_process_group()
dist.init_process_group("engine", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=10))
group = dist.new_group([0, 1], timeout=timedelta(seconds=10))
t = torch.full((2,), rank + 1.0)
dist.all_reduce(t, group=group)
print("sum", t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_a_rank_that_made_a_world_in_another_store_before_meets_the_others_in_new_group():
    """Rank 0 made and destroyed a world of its own (its own store) before the two ranks made theirs:
    their new_group waited for ever (its keys were under the count of the worlds each process made, 2
    on rank 0, 1 on rank 1). The count is now that of the worlds each rank made in the world's store."""
    import subprocess
    port, own = str(free_port()), str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _WORLDS_MADE_ELSEWHERE, str(r), port, own], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "sum [3.0, 3.0]" in out, out[-3000:]


_COUNTED_AHEAD = """
import sys
from datetime import timedelta
import torch.distributed as dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=30))
if rank == 1:   # (counted twice: as a process that took the place of one that made the world on this store)
    from torchbridge import creation
    counted = creation.makings_of
    creation.makings_of = lambda *args, **kwargs: (counted(*args, **kwargs), counted(*args, **kwargs))[1]
store.set(f"ready/{rank}", "1")
store.wait(["ready/0", "ready/1"])
try:
    dist.init_process_group("engine", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=3))
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
store.set(f"done/{rank}", "1")
store.wait(["done/0", "done/1"])
"""


def test_ranks_that_counted_their_makings_apart_are_told_so_where_they_miss_each_other():
    """Rank 1's count of its makings of the world in the store is one ahead (a process that took the
    place of one that made it there: the dead one counted too), so the two meet in different makings
    and each misses the other at the timeout. The error said only that the other never joined; it
    says now that the other counted its makings apart, and what to do."""
    import subprocess
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _COUNTED_AHEAD, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    for rank, out in enumerate(outs):
        other, counts, how = 1 - rank, ((2, 1), (1, 2))[rank], ("they met in a later making", (
            "they have not come to this making, or this rank counted ahead of them"))[rank]
        assert (f"MissingRanks: engine: ranks [{other}] of 2 never joined the bootstrap of group '0'" in out and
                f"ranks [{other}] made this group {counts[0]} times in this store, this rank {counts[1]} times, so "
                f"{how}" in out and "join the others through dist._reconfigure" in out), out


def test_a_rank_that_never_came_is_not_said_to_have_counted_apart():
    """counted_apart's sentence, from the missing ranks' counts in the store: none for a rank that never
    made the group there (it said such a rank met in another making); certain for one ahead; for one
    behind, that it has not come yet or this rank counted ahead."""
    import torch.distributed as dist

    from torchbridge.creation import counted_apart

    store = dist.HashStore()
    for rank, count in ((1, 3), (2, 1)):
        store.add(f"engine/makings-of-rank-{rank}", count)
    assert counted_apart(store, [], [3], 2) == ""
    assert "ranks [1] made this group 3 times in this store, this rank 2 times, so they met in a later making" \
        in counted_apart(store, [], [1, 3], 2)
    assert "ranks [2] made this group 1 times in this store, this rank 2 times, so they have not come to this " \
        "making, or this rank counted ahead of them" in counted_apart(store, [], [2, 3], 2)
    # (a group of some of the world's ranks: its rank i's count is under world rank ranks[i])
    assert "ranks [1] made this group 3 times" in counted_apart(store, [7, 1], [1], 2)
    assert counted_apart(store, [1, 7], [1], 2) == ""


def test_a_new_group_waiting_for_its_members_ends_when_the_group_it_is_made_from_is_aborted():
    """Ranks 0 and 1 made a new group whose rank 2 never came; another thread aborted the world it was
    made from: the making waited on, its timeout (torch's default for new_group: 30 minutes). It ends
    within a look of the abort now, saying so, and leaves why for a member that comes later."""
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist
    from engine._core import EngineAborted
    from engine.bootstrap import MakingGivenUp, agree_on_members

    core = SimpleNamespace(aborted=False)
    world = SimpleNamespace(name="0", _core=core, lost_ranks=lambda: {})
    store = dist.HashStore()
    timer = threading.Timer(0.3, setattr, [core, "aborted", True])
    timer.start()
    start = time.monotonic()
    with pytest.raises(EngineAborted, match=r"engine new_group '1': group '0', the group this one is made from, was "
                                            r"aborted \(or destroyed\) while this rank waited"):
        agree_on_members(store, "m", 0, [0, 1, 2], 1800, "engine new_group '1'", "was given", "ranks to new_group",
                         parent=world)
    assert time.monotonic() - start < 1.5
    timer.join()
    with pytest.raises(MakingGivenUp, match="rank 0 gave this making up"):
        agree_on_members(store, "m", 1, [0, 1, 2], 5, "engine new_group '1'", "was given", "ranks to new_group")
