"""torch.distributed on backend "engine" with CUDA tensors, under mpiexec (tests/test_gpu_suites.py).

Every collective, per dtype and op, against references each rank computes itself. The transport is
whatever ENGINE_CUDA_TRANSPORT says: nccl (world size 1 on one GPU, or one rank per GPU), or staged
(several ranks sharing one GPU, through host memory over MPI).
"""

import os

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from refdata import torch_data, torch_op_supported, torch_reference  # noqa: E402

dist.init_process_group(backend="engine")
R, P = dist.get_rank(), dist.get_world_size()
LOCAL = int(os.environ.get("LOCAL_RANK", R))
DEV = torch.device("cuda", LOCAL % torch.cuda.device_count())
torch.cuda.set_device(DEV)
PG = dist.distributed_c10d._get_default_group()
TRANSPORT = os.environ.get("ENGINE_CUDA_TRANSPORT", "auto")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
       "avg": dist.ReduceOp.AVG}


def data(rank, n, dtype, salt=0):
    return torch_data(rank, n, dtype, salt).to(DEV)


def ref(op, n, dtype, ranks=None):
    return torch_reference(op, n, dtype, range(P) if ranks is None else ranks).to(DEV)


def nccl_side():
    """This group's engine.cuda CudaCommunicator (nccl transport only)."""
    dev = PG._cuda_device(DEV.index)
    if not hasattr(dev, "cc"):
        pytest.skip("transport is staged")
    return dev.cc


def test_transport_is_the_expected_one():
    dev = PG._cuda_device(DEV.index)
    assert type(dev).__name__ == ("StagedDevice" if TRANSPORT == "staged" else "CudaDevice")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_every_op(dtype):
    for op, red in OPS.items():
        if not torch_op_supported(op, dtype):
            continue
        for n in (1, 7, 1031):
            t = data(R, n, dtype)
            dist.all_reduce(t, op=red)
            assert torch.equal(t, ref(op, n, dtype)), (op, dtype, n, t[:6])


@pytest.mark.parametrize("algorithm", ["nccl", "ring"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.int16], ids=str)
def test_engine_ring_and_nccl_allreduce(algorithm, dtype):
    """Both GPU algorithms of the registry, directly (the ring also reduces what NCCL can't: int16, bitwise)."""
    cc = nccl_side()
    stream = torch.cuda.current_stream(DEV).cuda_stream
    for op in ("sum", "max", "min", "product", "band", "bxor", "avg"):
        if not torch_op_supported(op, dtype) or (algorithm == "nccl" and (dtype == torch.int16 or op in ("band", "bxor"))):
            continue
        for n in (0, 1, P - 1, 5, 17, 1031, 1 << 20 | 3):
            t = data(R, n, dtype)
            cc.allreduce(t, op.upper(), stream=stream, algorithm=algorithm)
            torch.cuda.synchronize()
            assert torch.equal(t, ref(op, n, dtype)), (algorithm, op, dtype, n)


def test_async_work_waits_on_the_stream_not_the_host():
    t = data(R, 1 << 20, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    side = torch.cuda.Stream(DEV)
    with torch.cuda.stream(side):
        work.wait()  # the side stream now waits for the collective
        doubled = t * 2
    side.synchronize()
    assert torch.equal(doubled, ref("sum", 1 << 20, torch.float32) * 2)
    assert work.is_completed()


def test_future_then_chain():
    t = data(R, 1000, torch.float32)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 3)
    assert torch.equal(fut.wait(), ref("sum", 1000, torch.float32) * 3)


def test_premul_sum_and_non_contiguous():
    t = data(R, 64, torch.float32)
    premul = dist._make_nccl_premul_sum(0.5)
    if getattr(premul, "factor", None) is not None:
        dist.all_reduce(t, op=premul)
        assert torch.equal(t, ref("sum", 64, torch.float32) * 0.5)
    else:  # torch before 2.13 (the lent GPU machine's image): a clear error, not a wrong sum
        with pytest.raises(RuntimeError, match="PREMUL_SUM's factor from ReduceOp.factor"):
            dist.all_reduce(t, op=premul)
    m = data(R, 64, torch.float32).view(8, 8).t()
    dist.all_reduce(m)
    assert torch.equal(m, ref("sum", 64, torch.float32).view(8, 8).t())


@pytest.mark.parametrize("compression", [None, "float16", "bfloat16"])
def test_coalesced_and_fused_with_compression(compression):
    sizes = [1, 300, 0, 4097, 2]
    ts = [data(R, n, torch.float32, salt=i) for i, n in enumerate(sizes)]
    if compression is None:
        dist.all_reduce_coalesced(ts, op=dist.ReduceOp.AVG)
    else:
        PG.fused_allreduce_async(ts, "avg", compression=compression).wait()
    wire = getattr(torch, compression or "float32")
    for i, (t, n) in enumerate(zip(ts, sizes)):
        want = sum(torch_data(r, n, torch.float32, salt=i) for r in range(P)) / P
        if compression:
            want = sum((torch_data(r, n, torch.float32, salt=i) / P).to(wire) for r in range(P)).float()
        assert torch.allclose(t, want.to(DEV), atol=1e-2 if compression else 1e-6), (i, compression)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_broadcast_and_reduce(dtype):
    for root in range(P):
        t = data(R, 33, dtype)
        dist.broadcast(t, src=root)
        assert torch.equal(t, data(root, 33, dtype))
        for op in ("sum", "max", "bor"):
            if not torch_op_supported(op, dtype):
                continue
            t = data(R, 33, dtype)
            dist.reduce(t, dst=root, op=OPS[op])
            if R == root:
                assert torch.equal(t, ref(op, 33, dtype)), (op, dtype, root)


def test_all_gather_variants():
    outs = [torch.empty(5, device=DEV) for _ in range(P)]
    dist.all_gather(outs, data(R, 5, torch.float32))
    for r in range(P):
        assert torch.equal(outs[r], data(r, 5, torch.float32))
    flat = torch.empty(5 * P, dtype=torch.bfloat16, device=DEV)
    dist.all_gather_into_tensor(flat, data(R, 5, torch.bfloat16))
    assert torch.equal(flat, torch.cat([data(r, 5, torch.bfloat16) for r in range(P)]))
    uneven = [torch.empty(r + 1, dtype=torch.int32, device=DEV) for r in range(P)]
    dist.all_gather(uneven, data(R, R + 1, torch.int32))
    for r in range(P):
        assert torch.equal(uneven[r], data(r, r + 1, torch.int32))


def test_gather_and_scatter():
    for root in range(P):
        outs = [torch.empty(4, device=DEV) for _ in range(P)] if R == root else None
        dist.gather(data(R, 4, torch.float32), outs, dst=root)
        if R == root:
            for r in range(P):
                assert torch.equal(outs[r], data(r, 4, torch.float32))
        out = torch.empty(6, dtype=torch.int64, device=DEV)
        pieces = [data(r, 6, torch.int64, salt=root) for r in range(P)] if R == root else None
        dist.scatter(out, pieces, src=root)
        assert torch.equal(out, data(R, 6, torch.int64, salt=root))


@pytest.mark.parametrize("op", ["sum", "max", "avg", "bxor"])
def test_reduce_scatter_variants(op):
    dtype = torch.int32 if op == "bxor" else torch.float32
    full = ref(op, 4 * P, dtype)
    out = torch.empty(4, dtype=dtype, device=DEV)
    dist.reduce_scatter_tensor(out, data(R, 4 * P, dtype), op=OPS[op])
    assert torch.equal(out, full[4 * R:4 * R + 4]), op
    ins = list(data(R, 4 * P, dtype).split(4))
    out2 = torch.empty(4, dtype=dtype, device=DEV)
    dist.reduce_scatter(out2, ins, op=OPS[op])
    assert torch.equal(out2, full[4 * R:4 * R + 4]), op


def test_all_to_all_equal_and_uneven():
    inp = torch.arange(2 * P, device=DEV, dtype=torch.float32) + 100 * R
    out = torch.empty(2 * P, device=DEV)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(2 * R, 2 * R + 2, dtype=torch.float32) + 100 * r for r in range(P)])
    assert torch.equal(out, want.to(DEV))
    sends = [torch.full((r + 1,), float(R), device=DEV) for r in range(P)]
    recvs = [torch.empty(R + 1, device=DEV) for _ in range(P)]
    dist.all_to_all(recvs, sends)
    for r in range(P):
        assert torch.equal(recvs[r], torch.full((R + 1,), float(r), device=DEV))


def test_point_to_point_batch_and_barrier():
    if P > 1:
        right, left = (R + 1) % P, (R - 1) % P
        got = torch.empty(1 << 18, device=DEV)
        ops = [dist.P2POp(dist.isend, data(R, 1 << 18, torch.float32), right),
               dist.P2POp(dist.irecv, got, left)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        torch.cuda.synchronize()
        assert torch.equal(got, data(left, 1 << 18, torch.float32))
    dist.barrier()
    objs = [None] * P
    dist.all_gather_object(objs, {"rank": R})
    assert objs == [{"rank": r} for r in range(P)]


@pytest.mark.parametrize("hook", [None, "allreduce_hook", "fp16_compress_hook"])
def test_ddp_on_cuda_matches_the_full_batch_step(hook):
    import torchbridge.hooks
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(DEV)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(DEV)
    reference.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEV.index])
    if hook:
        ddp.register_comm_hook(None, getattr(torchbridge.hooks, hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8 * P, 16, generator=g).to(DEV), torch.randn(8 * P, 4, generator=g).to(DEV)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[8 * R:8 * R + 8]), y[8 * R:8 * R + 8]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=2e-3 if hook == "fp16_compress_hook" else 1e-5), (hook, (a - b).abs().max())



def test_abort_ends_the_cuda_side_and_a_reconfigure_brings_it_back():
    """abort() of a group ends its CUDA side (ncclCommAbort: nothing waits on the stream or a peer), and
    its CUDA Works raise the abort; after a reconfigure its CUDA tensors go through a CUDA side made
    anew among the members it has now: the transport chosen again (ranks sharing a GPU: staged) and
    NCCL's unique id passed over the group's CPU communicator (a reconfigure's members need share no
    store, and torch's store still holds the id of the group's first communicator)."""
    import time
    from datetime import timedelta
    from types import SimpleNamespace
    expected = "StagedDevice" if P > torch.cuda.device_count() else "CudaDevice"
    os.environ["ENGINE_CUDA_TRANSPORT"] = "auto"   # (the group chooses for itself, as a user's does)
    try:
        g = dist.new_group(backend="engine")
        b = g._get_backend(DEV)
        for attempt, uuid in ((0, None), (1, 7100), (2, 7101)):
            if uuid is not None:
                handles = [None] * P
                dist.all_gather_object(handles, b.get_reconfigure_handle())
                b.reconfigure(SimpleNamespace(uuid=uuid, handles=handles, timeout=timedelta(seconds=60))).wait()
            for n in (1, 1031, 1 << 20):
                t = data(R, n, torch.float32)
                dist.all_reduce(t, group=g)
                assert torch.equal(t, ref("sum", n, torch.float32)), (attempt, n)
            assert type(b._cuda_device(DEV.index)).__name__ == expected
            if attempt == 2:
                break
            pending = None
            if expected == "CudaDevice":
                torch.cuda._sleep(int(2e9))   # the stream is busy for about a second: the all_reduce waits behind it
                pending = dist.all_reduce(data(R, 5, torch.float32), group=g, async_op=True)
            start = time.monotonic()
            b.abort()
            print(f"rank {R}: abort() took {time.monotonic() - start:.3f} s ({expected}, attempt {attempt})", flush=True)
            with pytest.raises(Exception, match="was aborted"):
                dist.all_reduce(data(R, 5, torch.float32), group=g)
            if pending is not None:
                with pytest.raises(Exception, match="was aborted"):
                    pending.wait()
            torch.cuda.synchronize()
        dist.destroy_process_group(g)
    finally:
        os.environ["ENGINE_CUDA_TRANSPORT"] = TRANSPORT
