"""What torch's own tools see of a group on backend "engine": every collective and point-to-point call
as a profiler event (named as torch's backends name theirs); the group as its devices' backend; the
monitored barrier, naming the ranks that did not arrive; sparse all_reduce (Gloo's), and DDP with a
sparse embedding trained exactly like one process."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_world

R, P, GLOO = torch_world.init()
WORLD = dist.group.WORLD


def engine_events(prof):
    return [e for e in prof.events() if e.name.startswith("engine:")]


def collective_calls():
    """(event name, the shapes torch's backends record, the call) for every collective at P ranks."""
    t = torch.full((3, 4), float(R))
    rows = torch.ones(2 * P, 4)
    return [
        ("all_reduce", [[3, 4]], lambda: dist.all_reduce(t)),
        ("all_reduce", [[3, 4]], lambda: dist.all_reduce(t, async_op=True).wait()),
        ("all_reduce", [[4, 3]], lambda: dist.all_reduce(t.t())),  # non-contiguous: the general path
        ("all_reduce_coalesced", [[3, 4], [2]], lambda: dist.all_reduce_coalesced([t, torch.ones(2)])),
        ("broadcast", [[3, 4]], lambda: dist.broadcast(t, 0)),
        ("reduce", [[3, 4]], lambda: dist.reduce(t, 0)),
        ("all_gather", [[3, 4]], lambda: dist.all_gather([torch.empty(3, 4) for _ in range(P)], t)),
        ("all_gather_into_tensor", [[3, 4]], lambda: dist.all_gather_single(torch.empty(3 * P, 4), t)),
        ("gather", [[3, 4]], lambda: dist.gather(t, [torch.empty(3, 4) for _ in range(P)] if R == 0 else None)),
        ("scatter", [[3, 4]] * P if R == 0 else [],
         lambda: dist.scatter(t, [torch.ones(3, 4)] * P if R == 0 else None)),
        ("reduce_scatter", [[3, 4]] * P, lambda: dist.reduce_scatter(t, [torch.ones(3, 4)] * P)),
        ("reduce_scatter_tensor", [[3 * P, 4]], lambda: dist.reduce_scatter_single(t, torch.ones(3 * P, 4))),
        ("all_to_all", [[2]] * P, lambda: dist.all_to_all([torch.empty(2) for _ in range(P)], [torch.ones(2)] * P)),
        ("all_to_all_single", [[2 * P, 4]], lambda: dist.all_to_all_single(torch.empty(2 * P, 4), rows)),
        ("barrier", [], lambda: dist.barrier()),
        ("monitored_barrier", [], lambda: WORLD.monitored_barrier(timedelta(seconds=30))),
    ]


def test_every_collective_is_a_profiler_event_with_its_shapes():
    calls = collective_calls()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _, _, call in calls:
            call()
    events = sorted(engine_events(prof), key=lambda e: e.time_range.start)
    assert [(e.name, e.input_shapes) for e in events] == [(f"engine:{name}", shapes) for name, shapes, _ in calls]
    # the autograd profiler (what torch's own suite uses) sees them too
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        dist.all_reduce(torch.ones(5))
        dist.broadcast(torch.ones(6), 0)
    assert [(e.name, e.input_shapes) for e in prof.function_events if e.name.startswith("engine:")] == \
        [("engine:all_reduce", [[5]]), ("engine:broadcast", [[6]])]


@pytest.mark.skipif(P < 2, reason="point-to-point needs a peer")
def test_point_to_point_is_a_profiler_event():
    t = torch.arange(6.0).reshape(2, 3)
    with torch.profiler.profile(record_shapes=True) as prof:
        if R == 0:
            dist.send(t, 1)
            dist.isend(t, 1).wait()
            dist.send(t, 1)
        elif R == 1:
            dist.recv(t, 0)
            dist.irecv(t, 0).wait()
            dist.recv(t)
    names = sorted(e.name for e in engine_events(prof))
    expected = {0: ["engine:send"] * 3, 1: ["engine:recv", "engine:recv", "engine:recvAnySource"]}.get(R, [])
    assert names == expected
    assert all(e.input_shapes == [[2, 3]] for e in engine_events(prof))


@pytest.mark.skipif(P < 2, reason="needs a late peer")
def test_async_work_is_an_event_until_it_completes():
    """Rank 0 issues an asynchronous all_reduce, then (inside a marker range) tells the others to join it,
    point to point: the all_reduce can't complete before the marker starts, so its event, which lasts
    until the work completes and not just the call that queued it, ends after the marker's start."""
    t, go = torch.ones(100), torch.zeros(1)
    dist.barrier()
    if R != 0:
        dist.recv(go, 0)
    with torch.profiler.profile() as prof:
        work = dist.all_reduce(t, async_op=True)
        if R == 0:
            with torch.profiler.record_function("peers-released"):
                for peer in range(1, P):
                    dist.send(go, peer)
        work.wait()
    (event,) = [e for e in engine_events(prof) if e.name == "engine:all_reduce"]
    if R == 0:
        (marker,) = [e for e in prof.events() if e.name == "peers-released"]
        assert event.time_range.end >= marker.time_range.start, (event.time_range, marker.time_range)
    assert torch.equal(t, torch.full((100,), float(P)))


def test_no_events_and_same_results_without_a_profiler():
    t = torch.full((7,), float(R + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((7,), float(sum(range(1, P + 1)))))
    with torch.profiler.profile() as prof:
        pass
    assert engine_events(prof) == []


def test_the_group_is_its_devices_backend():
    c10d = dist.distributed_c10d
    assert WORLD._get_backend(torch.device("cpu")) is WORLD
    assert WORLD._device_types == [torch.device("cpu")]
    assert c10d._device_capability() == ["cpu"]
    with pytest.warns(UserWarning, match="deprecated"):
        assert c10d._get_pg_default_device() == torch.device("cpu")
    with pytest.raises(RuntimeError, match="No backend type associated with device type meta: backend 'engine' "
                                           "serves cpu tensors"):
        WORLD._get_backend(torch.device("meta"))


def test_monitored_barrier_passes_when_everyone_arrives():
    for wait_all in (False, True):
        WORLD.monitored_barrier(timedelta(seconds=30), wait_all_ranks=wait_all)
    WORLD.monitored_barrier()  # the group's timeout
    sub = dist.new_group(sorted({0, P - 1}))
    if R in (0, P - 1):
        sub.monitored_barrier(timedelta(seconds=30))
        dist.destroy_process_group(sub)   # (torch names a later group by how many each rank holds)
    dist.barrier()


@pytest.mark.skipif(P < 2, reason="needs a missing rank")
@pytest.mark.parametrize("wait_all,every", [(False, False), (True, False), (True, True)])
def test_monitored_barrier_names_the_ranks_that_did_not_arrive(wait_all, every):
    """The last rank (or every rank but 0) arrives only after rank 0's timeout: rank 0 names it (with
    wait_all_ranks, every one, as "Ranks" even if one: Gloo's words), the ranks that arrived in time hear
    from rank 0 that it failed, and so does the late one."""
    late = list(range(1, P)) if every else [P - 1]
    timeout = timedelta(seconds=1)
    dist.barrier()
    if R in late:
        dist.recv(torch.empty(1), 0)  # rank 0 has given up
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        WORLD.monitored_barrier(timeout, wait_all_ranks=wait_all)
    elapsed = time.monotonic() - start
    message = str(raised.value)
    if R == 0:
        for r in late:
            dist.send(torch.empty(1), r)
        named = f"Rank{'s' if wait_all else ''} {', '.join(map(str, late))}"
        assert f"[Rank 0]: {named} failed to pass monitoredBarrier in 1000 ms: Timed out waiting for" in message
        assert elapsed > 0.9, elapsed   # it waited its timeout (no upper bound: the machine may be busy)
    else:
        assert message.startswith(f"Rank {R} successfully reached monitoredBarrier, but received errors while waiting "
                                  f"for send/recv from rank 0: rank 0 reported: [Rank 0]: Rank"), message
    dist.barrier()
    WORLD.monitored_barrier(timedelta(seconds=30))  # everyone in step again


@pytest.mark.skipif(P != 3, reason="needs a rank that waits for rank 0's answer while another is late (at 3 "
                                    "ranks only: it waits 4 s, in every suite that runs it)")
def test_a_monitored_barrier_longer_than_the_groups_timeout_ends_alike_on_every_rank():
    """The last rank arrives after the group's timeout but within the barrier's: rank 0 waits for it and
    passes, and so must rank 1, which arrived at once (it waited for rank 0's answer only as long as the
    group's timeout, and failed blaming rank 0, which had arrived)."""
    group = dist.new_group(timeout=timedelta(seconds=2))
    if R == P - 1:
        time.sleep(4)
    group.monitored_barrier(timedelta(seconds=8))
    dist.destroy_process_group(group)
    dist.barrier()


def test_monitored_barrier_with_no_time_left_blames_rank_0():
    if P == 1:
        WORLD.monitored_barrier(timedelta(0))  # nobody to wait for
        return
    dist.barrier()
    if R != 0:
        dist.recv(torch.empty(1), 0)  # rank 0 has given up
    with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier after 0 ms: Timed out before rank 1 "
                                           "arrived" if R == 0 else "rank 0 reported: "):
        WORLD.monitored_barrier(timedelta(0))
    if R == 0:
        for r in range(1, P):
            dist.send(torch.empty(1), r)
    dist.barrier()


def sparse_input(rank, dtype):
    """Rank r's COO tensor of shape (6, 3): uncoalesced (a repeated row), overlapping other ranks' rows;
    rank 1 has none at all."""
    if rank == 1:
        return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64), torch.empty(0, 3, dtype=dtype), (6, 3),
                                       check_invariants=True)
    rows = torch.tensor([[rank % 6, (2 * rank + 1) % 6, rank % 6, 5]])
    values = (torch.arange(12, dtype=torch.float64).reshape(4, 3) + 10 * rank).to(dtype)
    return torch.sparse_coo_tensor(rows, values, (6, 3), check_invariants=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64], ids=str)
def test_sparse_all_reduce_sum_vs_gloo_and_reference(dtype):
    t = sparse_input(R, dtype)
    dist.all_reduce(t)
    expected = sum(sparse_input(r, dtype).to_dense() for r in range(P))
    assert t.is_sparse and t.is_coalesced()
    assert torch.equal(t.to_dense(), expected)
    g = sparse_input(R, dtype)
    dist.all_reduce(g, group=GLOO)
    assert torch.equal(t.to_dense(), g.to_dense())
    w = sparse_input(R, dtype)
    dist.all_reduce(w, async_op=True).wait()
    assert torch.equal(w.to_dense(), expected)


def test_sparse_all_reduce_refuses_other_ops_and_mismatched_tensors():
    with pytest.raises(RuntimeError, match="sparse tensor: only ReduceOp.SUM is supported"):
        dist.all_reduce(sparse_input(R, torch.float32), op=dist.ReduceOp.MAX)
    only_all_reduce = "a torch.sparse_coo tensor was passed to a call that takes dense tensors; only all_reduce"
    for call in (lambda s: dist.broadcast(s, 0), lambda s: dist.all_gather([torch.empty(6, 3)] * P, s),
                 lambda s: dist.all_reduce_coalesced([s])):
        with pytest.raises(RuntimeError, match=only_all_reduce):  # refused locally, before any communication
            call(sparse_input(R, torch.float32))
    # a compressed layout (CSR), which has no is_contiguous() (torch's own error, saying nothing to do, was
    # raised), and which all_reduce does not sum either
    csr = torch.eye(3).to_sparse_csr()
    for call in (lambda s: dist.all_reduce(s), lambda s: dist.all_reduce(s, async_op=True).wait(),
                 lambda s: dist.broadcast(s, 0), lambda s: dist.reduce(s, 0),
                 lambda s: dist.all_gather_into_tensor(torch.empty(3 * P, 3), s),
                 *([lambda s: dist.send(s, (R + 1) % P) if R % 2 == 0 else dist.recv(s, (R - 1) % P)] * (P > 1))):
        with pytest.raises(RuntimeError, match="a torch.sparse_csr tensor.*(to_sparse_coo|to_dense)"):
            call(csr)
    if P > 1:
        shape = (6, 3) if R != P - 1 else (7, 3)
        t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 3), shape, check_invariants=True)
        others = f"ranks {P - 1}" if R != P - 1 else f"ranks {', '.join(map(str, range(P - 1)))}"
        with pytest.raises(ValueError, match=f"{others} passed a sparse tensor of another shape"):
            dist.all_reduce(t)
    if P > 1:   # (one size, float-ness and shape: only the dtype tells them apart)
        dtype = torch.float16 if R == 0 else torch.bfloat16
        with pytest.raises(ValueError, match="another shape, sparse dimension or dtype than this rank's .*"
                                             f"{dtype}.*{torch.bfloat16 if R == 0 else torch.float16}"):
            dist.all_reduce(sparse_input(R, dtype))
    t = torch.full((3,), 1.0)
    dist.all_reduce(t)  # the group goes on
    assert torch.equal(t, torch.full((3,), float(P)))


@pytest.mark.parametrize("nnz, index", [(-1, None), (1 << 40, None), (1, 99), (1, -1)])
def test_sparse_all_reduce_refuses_entries_a_peer_announces_out_of_bounds(nnz, index):
    """What the peers send is read as bounds-checked data: the last rank speaks sparse_sum's protocol by
    hand (its count of entries, then its indices and values), announcing a count no (6, 3) tensor holds,
    or an index outside it; every other rank refuses, naming it (a count of 2**40 was allocated, an
    index out of range written out of bounds)."""
    from torchbridge.sparse import _dtype_code, uneven
    comm = WORLD.communicator
    if R == P - 1:
        meta = torch.tensor([nnz, 1, 2, hash((6, 3)), _dtype_code(torch.float32)], dtype=torch.int64)
        metas = torch.empty(P * 5, dtype=torch.int64)
        comm.allgather(meta, metas)
        if index is not None:
            counts = metas.view(P, 5)[:, 0].tolist()
            comm.allgather(torch.tensor([[index]]), torch.empty(sum(counts), 1, dtype=torch.int64), uneven(counts))
            comm.allgather(torch.ones(1, 3), torch.empty(sum(counts), 3), uneven([n * 3 for n in counts]))
    else:
        told = (f"rank {P - 1} announced {nnz} entries, where a coalesced \\(6, 3\\) tensor with 1 sparse "
                "dimensions holds 0 to 6" if index is None else
                f"rank {P - 1} sent the index \\({index},\\), outside the shape \\(6, 3\\)")
        with pytest.raises(RuntimeError, match=told):
            dist.all_reduce(sparse_input(R, torch.float32))
    t = torch.full((3,), 1.0)
    dist.all_reduce(t)  # the group goes on
    assert torch.equal(t, torch.full((3,), float(P)))


VOCAB, DIM, PER_RANK, STEPS = 12, 4, 4, 6


def embedding_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True),
                               torch.nn.Linear(DIM, 1)).double()


def embedding_batches():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (PER_RANK * P, 3), generator=gen),
             torch.randn(PER_RANK * P, 1, generator=gen, dtype=torch.float64)) for _ in range(STEPS)]


def train_embedding(net, shard):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for ids, y in embedding_batches():
        if shard:
            ids, y = ids.chunk(P)[R], y.chunk(P)[R]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(ids), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def test_ddp_with_a_sparse_embedding_trains_like_one_process():
    ddp = DDP(embedding_model())
    first = next(ddp.parameters())
    with torch.profiler.profile() as prof:
        ddp(torch.tensor([[0, 1, 2]])).sum().backward()
    assert first.grad.is_sparse  # the embedding's gradient stayed sparse through the engine
    assert "engine:all_reduce" in {e.name for e in prof.events()}
    ddp = DDP(embedding_model())
    trained = train_embedding(ddp, shard=True)
    reference = train_embedding(embedding_model(), shard=False)
    for a, b in zip(trained, reference):
        assert (a - b).abs().max() < 1e-12, (a - b).abs().max()
