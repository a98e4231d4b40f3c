"""The conformance matrix, rank side. tests/matrix.py runs it on every configuration and writes the
table (docs/matrix.md); in CI it runs inside the per-configuration launches of test_mpi_suites.py
(mpiexec, 2-4 ranks, shared memory and MPI), test_launchers.py (torchrun) and test_hosts.py
(namespace hosts, every ENGINE_HIER mode).

Every entry of the algorithm registry (engine/registry.py) of this configuration's transport is
forced in turn (ENGINE_<COLLECTIVE>_ALGO=<transport>:<name> while its group is made), and its
collective runs through the torch API and through the engine's own API: every dtype and reduce op it
takes, at sizes 1, odd and not divisible by the group size, and larger than the segment (the groups
here have 16 KiB slots), every root, even and uneven counts; each result against what this rank
computes itself, and the flight recorder must name the entry. An entry this configuration can't run
(it needs single copy, a hierarchy, a GPU) is skipped, saying what it needs. Then, per collective,
the automatic choice at sizes around the thresholds must be the one the registry's rules name.
Nothing here names an algorithm: a new entry adds its rows."""

import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import engine
import torch_world
from engine import registry
from refdata import NUMPY_DTYPES, op_supported, rank_data, reference, torch_data, torch_op_supported, torch_reference

R, P, _ = torch_world.init()
WORLD = dist.distributed_c10d._get_default_group()
TRANSPORT = WORLD.communicator.transport
CAPS = WORLD.communicator.plan.caps
SLOT = 16 << 10
SETTINGS = {"ENGINE_SHM_SLOT_BYTES": str(SLOT), "ENGINE_SHM_QUEUE_BYTES": str(SLOT),
            "ENGINE_SHM_THREAD_SLICE_BYTES": "64",  # threaded kernels split even these sizes
            # a single-copy reduce_scatter reads 3000 bytes of each input at a time on 2-3 ranks; on 4,
            # a slot's share per peer is smaller and bounds the piece
            "ENGINE_SHM_PULL_PIECE_BYTES": "3000"}
BIG = 40_000  # bytes: more than two slots
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64]
MOVED_ONLY = [torch.complex64]
# torch 2.13 renamed the tensor forms; older releases have only the old names.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
       "avg": dist.ReduceOp.AVG}


def sizes(itemsize):
    """1, odd and not divisible by the group size, larger than the segment."""
    return [1, 2 * P + 1, BIG // itemsize + 1]


def name_of(dtype):
    return str(dtype).split(".")[-1]


def cases(entry, dtypes, op_ok):
    """(dtype, op, n) covering every dtype x op at one odd size, every dtype x size with SUM, and float32
    x every op x every size: each pair of the three dimensions meets."""
    out = []
    for dt in dtypes:
        isz = torch.empty(0, dtype=dt).element_size() if isinstance(dt, torch.dtype) else np.dtype(dt).itemsize
        for op in OPS:
            if not op_ok(op, dt) or not entry.takes_call(name_of(dt), op):
                continue
            every_size = op == "sum" or (name_of(dt) == "float32")
            for n in (sizes(isz) if every_size else [2 * P + 1]):
                out.append((dt, op, n))
    return out


def group(entry=None):
    """A new group of every rank, made while entry is forced (None: the automatic choice)."""
    env = dict(SETTINGS)
    if entry is not None:
        env[registry.force_variable(entry.collective)] = f"{entry.transport}:{entry.name}"
    return torch_world.engine_group(**env)


def ran(comm, entry, what):
    """The flight recorder names the entry that ran the last operation."""
    got = comm.core.records()[-1][4]
    assert got == entry.name, f"{what}: the recorder says {got}, forced {entry.name}"


def equal(got, want, what):
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert got.dtype == want.dtype and torch.equal(got, want), \
        f"{what}: got {got.reshape(-1)[:6].tolist()} want {want.reshape(-1)[:6].tolist()}"


# -- reductions --

def check_allreduce(pg, comm, entry):
    for dt, op, n in cases(entry, TORCH_DTYPES, torch_op_supported):
        want = torch_reference(op, n, dt, range(P))
        t = torch_data(R, n, dt)
        dist.all_reduce(t, op=OPS[op], group=pg)
        equal(t, want, f"dist.all_reduce {op} {dt} n={n}")
        ran(comm, entry, "dist.all_reduce")
        if op == "sum":
            t = torch_data(R, n, dt)
            dist.all_reduce(t, op=OPS[op], group=pg, async_op=True).wait()
            equal(t, want, f"dist.all_reduce async {dt} n={n}")
            if dt.is_floating_point:
                t = torch_data(R, n, dt)
                dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=pg)
                equal(t, (torch_reference("sum", n, torch.float64, range(P)) * 0.5).to(dt), f"PREMUL_SUM {dt} n={n}")
    avg_near_the_largest_value(pg, comm, entry)
    for dt in (torch.float32, torch.bfloat16, torch.int64):
        ts = [torch_data(R, n, dt, salt=i) for i, n in enumerate(sizes(dt.itemsize) * 2)]
        with warnings.catch_warnings():  # torch announces its deprecation; code written for it still calls it
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_reduce_coalesced(ts, group=pg)
        for i, (t, n) in enumerate(zip(ts, sizes(dt.itemsize) * 2)):
            want = sum(torch_data(r, n, torch.float64, salt=i) for r in range(P)).to(dt)
            equal(t, want, f"all_reduce_coalesced {dt} part {i}")
    for dt, op, n in cases(entry, NUMPY_DTYPES, lambda op, dt: op_supported(op, dt)):
        want = reference(op, [rank_data(r, n, dt) for r in range(P)])
        out = np.full(n, 9, dtype=dt)
        comm.allreduce(rank_data(R, n, dt), out, op=op)
        np.testing.assert_array_equal(out, want, err_msg=f"comm.allreduce {op} {dt} n={n} out of place")
        ran(comm, entry, "comm.allreduce")
        buf = rank_data(R, n, dt)
        comm.allreduce(buf, op=op)
        np.testing.assert_array_equal(buf, want, err_msg=f"comm.allreduce {op} {dt} n={n} in place")
    if entry.takes_call("float32", "user"):
        for n in sizes(4):
            buf = rank_data(R, n, "float32")
            comm.allreduce(buf, op=ABSMAX)
            want = np.stack([rank_data(r, n, "float32") for r in range(P)])
            np.testing.assert_array_equal(buf, absmax_reference(want), err_msg=f"user op n={n}")
            ran(comm, entry, "comm.allreduce user op")


# AVG of values whose sum overflows the dtype but whose mean doesn't: the mean, never inf, on every
# allreduce, reduce and reduce_scatter entry; the inputs a rank doesn't get back stay as they were.
NEAR_THE_LARGEST = ((torch.float16, 40000.0), (torch.bfloat16, 2.0 ** 127), (torch.float32, 2.0 ** 127))


def near_the_largest(dt, big, n):
    t = torch.full((n,), big, dtype=dt)
    t[1::2] = -big
    return t


def avg_near_the_largest_value(pg, comm, entry):
    for dt, big in NEAR_THE_LARGEST:
        if not entry.takes_call(name_of(dt), "avg"):
            continue
        for n in sizes(dt.itemsize):
            want = near_the_largest(dt, big, n)
            what = f"{entry.collective} AVG of {big} {dt} n={n}"
            if entry.collective == "allreduce":
                t = want.clone()
                dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
                equal(t, want, what)
            elif entry.collective == "reduce":
                t = want.clone()
                dist.reduce(t, dst=dist.get_global_rank(pg, P - 1), op=dist.ReduceOp.AVG, group=pg)
                equal(t, want, what if R == P - 1 else f"{what}: a non-root's tensor")
            else:
                whole = near_the_largest(dt, big, n * P)
                out = torch.empty(n, dtype=dt)
                reduce_scatter_single(out, whole, op=dist.ReduceOp.AVG, group=pg)
                equal(out, whole[R * n:(R + 1) * n], what)
                equal(whole, near_the_largest(dt, big, n * P), f"{what}: its input")
            ran(comm, entry, what)
    segment = {engine._core.Impl.ONESHOT, engine._core.Impl.TWOSHOT, engine._core.Impl.THREADED,
               engine._core.Impl.SEGMENT, engine._core.Impl.SINGLE_COPY}
    if entry.collective == "allreduce" and entry.impl in segment and entry.takes_call("float16", "avg"):
        # (the segment's own reductions divide inside: a block with an element whose sum overflows was
        # made again wholly from inputs divided first, which took its tiny elements below float16's
        # normal range, 2**-24 / 2 to 0; only the elements that overflowed are made again now)
        n = 2 * P + 1
        t = torch.full((n,), 2.0 ** -24, dtype=torch.float16)
        t[::2] = 60000.0
        want = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
        equal(t, want, f"allreduce AVG of 60000 and 2**-24 float16 n={n}")
        ran(comm, entry, "allreduce AVG of 60000 and 2**-24 float16")
    if entry.collective == "allreduce" and entry.takes_call("float16", "avg"):
        n = 2 * P + 1
        src, out = np.full(n, 40000.0, dtype=np.float16), np.zeros(n, dtype=np.float16)
        comm.allreduce(src, out, op="avg")
        np.testing.assert_array_equal(out, src, err_msg="comm.allreduce AVG of 40000 float16 out of place")
        np.testing.assert_array_equal(src, np.full(n, 40000.0, dtype=np.float16), err_msg="its input changed")


def check_reduce(pg, comm, entry):
    avg_near_the_largest_value(pg, comm, entry)
    for root in range(P):
        for dt, op, n in cases(entry, TORCH_DTYPES, torch_op_supported):
            t = torch_data(R, n, dt)
            dist.reduce(t, dst=dist.get_global_rank(pg, root), op=OPS[op], group=pg)
            if R == root:
                equal(t, torch_reference(op, n, dt, range(P)), f"dist.reduce root {root} {op} {dt} n={n}")
            ran(comm, entry, "dist.reduce")
        for dt, op, n in cases(entry, NUMPY_DTYPES, lambda op, dt: op_supported(op, dt)):
            out = np.full(n, 9, dtype=dt)
            comm.reduce(rank_data(R, n, dt), out if R == root else None, op=op, root=root)
            if R == root:
                np.testing.assert_array_equal(out, reference(op, [rank_data(r, n, dt) for r in range(P)]),
                                              err_msg=f"comm.reduce root {root} {op} {dt} n={n}")
            ran(comm, entry, "comm.reduce")


def check_reduce_scatter(pg, comm, entry):
    if entry.name == "single_copy":
        assert comm.core.pull_piece == int(SETTINGS["ENGINE_SHM_PULL_PIECE_BYTES"]), comm.core.pull_piece
    avg_near_the_largest_value(pg, comm, entry)
    for dt, op, n in cases(entry, TORCH_DTYPES, torch_op_supported):
        whole = torch_reference(op, n * P, dt, range(P))
        out = torch.empty(n, dtype=dt)
        reduce_scatter_single(out, torch_data(R, n * P, dt), op=OPS[op], group=pg)
        equal(out, whole[R * n:(R + 1) * n], f"dist.reduce_scatter_single {op} {dt} n={n}")
        ran(comm, entry, "dist.reduce_scatter_single")
        counts = [n + r for r in range(P)]  # uneven: the automatic choice where the entry takes none
        full = torch_reference(op, sum(counts), dt, range(P))
        out = torch.empty(counts[R], dtype=dt)
        dist.reduce_scatter(out, list(torch_data(R, sum(counts), dt).split(counts)), op=OPS[op], group=pg)
        equal(out, full.split(counts)[R], f"dist.reduce_scatter uneven {op} {dt}")
    for dt, op, n in cases(entry, NUMPY_DTYPES, lambda op, dt: op_supported(op, dt)):
        whole = reference(op, [rank_data(r, n * P, dt) for r in range(P)])
        out = np.empty(n, dtype=dt)
        comm.reduce_scatter(rank_data(R, n * P, dt), out, op=op)
        np.testing.assert_array_equal(out, whole[R * n:(R + 1) * n], err_msg=f"comm.reduce_scatter {op} {dt} n={n}")
        ran(comm, entry, "comm.reduce_scatter")


# -- data movement --

MOVE_DTYPES = TORCH_DTYPES + MOVED_ONLY


def movement_cases():
    return [(dt, n) for dt in MOVE_DTYPES for n in sizes(dt.itemsize)]


def check_broadcast(pg, comm, entry):
    for root in range(P):
        for dt, n in movement_cases():
            t = torch_data(R, n, dt) if R == root else torch.zeros(n, dtype=dt)
            dist.broadcast(t, src=dist.get_global_rank(pg, root), group=pg)
            equal(t, torch_data(root, n, dt), f"dist.broadcast root {root} {dt} n={n}")
            ran(comm, entry, "dist.broadcast")
            a = torch_data(R, n, dt) if R == root else torch.zeros(n, dtype=dt)
            comm.broadcast(a, root)
            equal(a, torch_data(root, n, dt), f"comm.broadcast root {root} {dt} n={n}")


def check_allgather(pg, comm, entry):
    for dt, n in movement_cases():
        out = torch.empty(n * P, dtype=dt)
        all_gather_single(out, torch_data(R, n, dt), group=pg)
        equal(out, torch.cat([torch_data(r, n, dt) for r in range(P)]), f"all_gather_single {dt} n={n}")
        ran(comm, entry, "dist.all_gather_single")
        outs = [torch.empty(n + r, dtype=dt) for r in range(P)]
        dist.all_gather(outs, torch_data(R, n + R, dt), group=pg)
        for r in range(P):
            equal(outs[r], torch_data(r, n + r, dt), f"dist.all_gather uneven {dt} from {r}")
        out = torch.empty(n * P, dtype=dt)
        comm.allgather(torch_data(R, n, dt), out)
        equal(out, torch.cat([torch_data(r, n, dt) for r in range(P)]), f"comm.allgather {dt} n={n}")


def check_gather(pg, comm, entry):
    for root in range(P):
        for dt, n in movement_cases():
            outs = [torch.empty(n + r, dtype=dt) for r in range(P)] if R == root else None
            dist.gather(torch_data(R, n + R, dt), outs, dst=dist.get_global_rank(pg, root), group=pg)
            for r in range(P if R == root else 0):
                equal(outs[r], torch_data(r, n + r, dt), f"dist.gather root {root} {dt} from {r}")
            out = torch.empty(n * P, dtype=dt)
            comm.gather(torch_data(R, n, dt), out if R == root else None, root)
            if R == root:
                equal(out, torch.cat([torch_data(r, n, dt) for r in range(P)]), f"comm.gather root {root} {dt}")
            ran(comm, entry, "comm.gather")


def check_scatter(pg, comm, entry):
    for root in range(P):
        for dt, n in movement_cases():
            out = torch.empty(n, dtype=dt)
            parts = [torch_data(r, n, dt, salt=root) for r in range(P)] if R == root else None
            dist.scatter(out, parts, src=dist.get_global_rank(pg, root), group=pg)
            equal(out, torch_data(R, n, dt, salt=root), f"dist.scatter root {root} {dt} n={n}")
            ran(comm, entry, "dist.scatter")
            counts = [n + r for r in range(P)]
            out = torch.empty(counts[R], dtype=dt)
            whole = torch.cat([torch_data(r, counts[r], dt) for r in range(P)]) if R == root else None
            comm.scatter(whole, out, root, counts)
            equal(out, torch_data(R, counts[R], dt), f"comm.scatter uneven root {root} {dt}")


def check_alltoall(pg, comm, entry):
    for dt, n in movement_cases():
        src = torch.cat([torch_data(R, n, dt, salt=q) for q in range(P)])
        out = torch.empty(n * P, dtype=dt)
        dist.all_to_all_single(out, src, group=pg)
        equal(out, torch.cat([torch_data(q, n, dt, salt=R) for q in range(P)]), f"all_to_all_single {dt} n={n}")
        ran(comm, entry, "dist.all_to_all_single")
        send = [n + q for q in range(P)]          # rank R sends n + q elements to q
        recv = [n + R for _ in range(P)]
        src = torch.cat([torch_data(R, send[q], dt, salt=q) for q in range(P)])
        out = torch.empty(sum(recv), dtype=dt)
        dist.all_to_all_single(out, src, recv, send, group=pg)
        equal(out, torch.cat([torch_data(q, n + R, dt, salt=R) for q in range(P)]), f"uneven all_to_all {dt}")
        outs = [torch.empty(n, dtype=dt) for _ in range(P)]
        dist.all_to_all(outs, [torch_data(R, n, dt, salt=q) for q in range(P)], group=pg)
        for q in range(P):
            equal(outs[q], torch_data(q, n, dt, salt=R), f"dist.all_to_all {dt} from {q}")
        out = torch.empty(n * P, dtype=dt)
        comm.alltoall(torch.cat([torch_data(R, n, dt, salt=q) for q in range(P)]), out)
        equal(out, torch.cat([torch_data(q, n, dt, salt=R) for q in range(P)]), f"comm.alltoall {dt} n={n}")
        ran(comm, entry, "comm.alltoall")


def check_barrier(pg, comm, entry):
    for _ in range(3):
        dist.barrier(group=pg)
        ran(comm, entry, "dist.barrier")
        comm.barrier()
        ran(comm, entry, "comm.barrier")


def check_sendrecv(pg, comm, entry):
    if P == 1:
        pytest.skip("point-to-point needs a peer")
    right, left = (R + 1) % P, (R - 1) % P
    offered = comm.core.seg.single_copy_sends if entry.transport == "shm" else 0
    for dt, n in movement_cases():
        out = torch.empty(n, dtype=dt)
        ops = [dist.P2POp(dist.isend, torch_data(R, n, dt), dist.get_global_rank(pg, right), group=pg),
               dist.P2POp(dist.irecv, out, dist.get_global_rank(pg, left), group=pg)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        equal(out, torch_data(left, n, dt), f"batch_isend_irecv {dt} n={n}")
        if R % 2 == 0:
            dist.send(torch_data(R, n, dt), dist.get_global_rank(pg, right), group=pg)
            dist.recv(out, dist.get_global_rank(pg, left), group=pg)
        else:
            dist.recv(out, dist.get_global_rank(pg, left), group=pg)
            dist.send(torch_data(R, n, dt), dist.get_global_rank(pg, right), group=pg)
        equal(out, torch_data(left, n, dt), f"dist.send/recv {dt} n={n}")
        got = torch.empty(n, dtype=dt)
        source, _, count = comm.sendrecv(torch_data(R, n, dt), right, got, None, sendtag=7, recvtag=7)
        equal(got, torch_data(left, n, dt), f"comm.sendrecv {dt} n={n}")
        assert source == left and count == n
    if entry.transport == "shm":   # (3 messages a case: those in the single-copy sizes moved so, and only those)
        seg = comm.core.seg
        want = sum(3 for dt, n in movement_cases() if seg.cma_min <= n * dt.itemsize <= seg.cma_max)
        assert (want > 0) == (entry.name == "single_copy"), (entry.name, seg.cma_min, seg.cma_max)
        assert seg.single_copy_sends - offered == want, \
            f"{seg.single_copy_sends - offered} messages offered by single copy of {want}, forced {entry.name}"
    # One buffer both ways sends what it held (as MPI_Sendrecv_replace), however long the exchange lasts
    # (the larger sizes: a message still leaving while its peer's arrives).
    for dt, n in movement_cases() + [(torch.float32, 1 << 20), (torch.float32, 3 << 20)] * 2:
        both = torch_data(R, n, dt)
        comm.sendrecv(both, right, both, left, sendtag=7, recvtag=7)
        equal(both, torch_data(left, n, dt), f"comm.sendrecv of one buffer {dt} n={n}")
        whole = torch_data(R, n + n // 2, dt)   # and two views of one buffer that overlap
        comm.sendrecv(whole[:n], right, whole[n // 2:], left, sendtag=7, recvtag=7)
        equal(whole[n // 2:], torch_data(left, n + n // 2, dt)[:n], f"comm.sendrecv of overlapping views {dt} n={n}")


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


# -- a user reduction (the engine's API only) --

@engine.reduction
def ABSMAX(a, b):
    return a if abs(a) > abs(b) or (abs(a) == abs(b) and a >= b) else b


def absmax_reference(stack):
    out = stack[0].copy()
    for row in stack[1:]:
        keep = (np.abs(out) > np.abs(row)) | ((np.abs(out) == np.abs(row)) & (out >= row))
        out = np.where(keep, out, row)
    return out


# -- the rows --

ENTRIES = registry.entries(transport=TRANSPORT)
assert set(CHECKS) == set(registry.COLLECTIVES), "every collective of the registry needs a check here"


def test_the_world_runs_the_transport_asked_for():
    """(A group of one made through torch's store has no peer to meet: it runs over shared memory.)"""
    asked = os.environ.get("ENGINE_TRANSPORT", "auto")
    if P == 1 and os.environ.get("ENGINE_TORCHRUN_SUITE"):
        asked = "shm"
    assert asked in ("auto", TRANSPORT), f"ENGINE_TRANSPORT={asked}, but the world runs over {TRANSPORT}"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.key)
def test_entry(entry):
    missing = entry.needs - CAPS
    if missing:
        pytest.skip(f"needs {', '.join(sorted(missing))}, which this configuration lacks")
    with group(entry) as (pg, comm):
        CHECKS[entry.collective](pg, comm, entry)
        if entry.impl == registry.Impl.THREADED and P > 1:
            # the blocking calls ran on the rank's threads, not on its one (a team that never started
            # would still give right answers)
            assert comm.core.threads_running == comm.core.threads > 1, (comm.core.threads_running, comm.core.threads)
            # and the helpers took slices of them (ENGINE_SHM_THREAD_SLICE_BYTES, a cache line here)
            assert comm.core.threads_shared > 0, comm.core.thread_slice
            assert comm.core.team_spin == comm.core.spin_budget   # the helpers wait as the group's waits do


# The automatic choice: at every edge of the group's rules (and a step either side), the entry the
# registry's rules name runs.
def edges(plan, collective):
    out = {4, 1 << 20}
    for _, lo, hi, _, _ in plan.rules[collective]:
        for b in (lo - 4, lo, hi, hi + 4):
            if 0 < b <= 4 << 20:
                out.add(b // 4 * 4)
    return sorted(out)


RUN_ONE = {
    "allreduce": lambda pg, n: dist.all_reduce(torch.ones(n), group=pg),
    "reduce": lambda pg, n: dist.reduce(torch.ones(n), dst=dist.get_global_rank(pg, 0), group=pg),
    "reduce_scatter": lambda pg, n: reduce_scatter_single(torch.empty(n), torch.ones(n * P), group=pg),
    "broadcast": lambda pg, n: dist.broadcast(torch.ones(n), src=dist.get_global_rank(pg, 0), group=pg),
    "allgather": lambda pg, n: all_gather_single(torch.empty(n * P), torch.ones(n), group=pg),
    "gather": lambda pg, n: dist.gather(torch.ones(n), [torch.empty(n) for _ in range(P)] if R == 0 else None,
                                        dst=dist.get_global_rank(pg, 0), group=pg),
    "scatter": lambda pg, n: dist.scatter(torch.empty(n), [torch.ones(n)] * P if R == 0 else None,
                                          src=dist.get_global_rank(pg, 0), group=pg),
    "alltoall": lambda pg, n: dist.all_to_all_single(torch.empty(n * P), torch.ones(n * P), group=pg),
    "barrier": lambda pg, n: dist.barrier(group=pg),
}


@pytest.mark.parametrize("collective", sorted(RUN_ONE))
def test_automatic_choice_follows_the_registry(collective):
    with group() as (pg, comm):
        for nbytes in edges(comm.plan, collective):
            RUN_ONE[collective](pg, nbytes // 4)
            op = "sum" if collective in registry.REDUCTIONS else None
            want = comm.plan.choose(collective, nbytes // 4 * 4, P, "float32", op)
            got = comm.core.records()[-1][4]
            assert got == want.name, f"{collective} of {nbytes} bytes ran {got}; the rules say {want.name}"


def as_bytes(raw):
    """A size as a user writes it in a variable: digits and a K or M."""
    return int(raw.rstrip("KM")) << {"K": 10, "M": 20}.get(raw[-1], 0)


def test_the_rules_lie_at_the_thresholds_values():
    """Each threshold that bounds a rule of this group's transport is a bound of its collective's rules at
    its value: its default, or where the launch moved it (tests/test_mpi_suites.py's moved-thresholds
    case, the hierarchy's in tests/test_launchers.py's 4-rank torchrun run) the moved one, so the
    automatic choice above is walked at the edges the variables set. A moved ring segment is the group's."""
    with group() as (pg, comm):
        plan, segment = comm.plan.rules, comm.core.ring_segment_bytes
    used = 0
    for collective, rules in plan.items():
        bounds = {b for _, lo, hi, _, _ in rules for b in (lo, hi)}
        for t in {v for e, *_ in rules for v in (e.min_bytes, e.max_bytes) if isinstance(v, registry.Tunable)}:
            raw = os.environ.get(t.env)
            want = as_bytes(raw) if raw else t.default
            assert want in bounds, (collective, t.env, raw, want, sorted(bounds))
            assert not raw or want != t.default, (t.env, raw)   # (a launch that moves one moves it off its default)
            used += 1
    assert used, plan
    raw = os.environ.get("ENGINE_RING_SEGMENT_BYTES")
    assert segment == (as_bytes(raw) if raw else registry.RING_SEGMENT.default), (raw, segment)
