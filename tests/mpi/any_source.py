"""Receives from any rank, over MPI, under mpiexec (4 ranks): each rank sends to its right-hand
neighbour, on tags 0 and 7, messages from 1 element to 300,001 (eager and rendezvous), and receives
its left-hand neighbour's from any rank. Prints `any-source: ok <mode>` on each rank that got every
message right; a lost message ends in the engine's timeout naming the receive.

`python any_source.py plain` does the same with mpi4py alone, polling MPI_Test as the engine does:
under MPICH 5.0.2's UCX network module (the mpich wheel's default) with MPIR_CVAR_NOLOCAL=1, a rank's
posted MPI_ANY_SOURCE receive misses its neighbour's message there, and the script says so after
10 s. tests/test_mpi_suites.py runs the engine's part (engine.mpi.any_source_by_probe)."""

import sys
import time

import numpy as np

SIZES = [1, 7, 100, 1000, 10001, 20001, 65537, 300001]
DTYPES = [np.float32, np.float16, np.int64]
ROUNDS = 3


def plain():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.rank, comm.size

    def wait(req, what):
        status, start = MPI.Status(), time.monotonic()
        while not req.Test(status):
            if time.monotonic() - start > 10:
                print(f"any-source: rank {rank} never got {what}", flush=True)
                comm.Abort(1)
        return status
    return comm, rank, size, wait


def across_collectives():
    """A receive from any rank left pending across the collectives that block inside MPI (its
    reductions and allgather): its sender waits for its (rendezvous) send before it joins them, so
    rank 0's receive must get its message while rank 0 waits in the collective, as a posted receive
    does by MPI's progress rule. (A probing receive, ENGINE_MPI_ANY_SOURCE=probe, never did: rank 0
    sat in MPI_Allgather, rank 1 in its send, until the timeout.) A job of its own: after the
    exchanges of main(), Open MPI 5.0.11's shared-memory module was seen to corrupt memory under
    mpi4py alone (docs/hosts.md)."""
    import engine
    comm = engine.Communicator(transport="mpi", timeout=30)
    rank, size = comm.rank, comm.size
    mode = "probe" if comm._core.any_source_by_probe else "post"
    calls = {"allreduce": lambda: comm.allreduce(np.ones(16, np.float32), algorithm="native"),
             "reduce": lambda: comm.reduce(np.ones(16, np.float32), root=size - 1),
             "allgather": lambda: comm.allgather(np.ones(4, np.float32), np.empty(4 * size, np.float32)),
             "reduce_scatter": lambda: comm.reduce_scatter(np.ones(4 * size, np.float32), np.empty(4, np.float32))}
    big = 1 << 20
    for name, call in calls.items():
        if rank == 0:
            got = np.empty(big, np.float32)
            r = comm.irecv(got, None, 9)
            call()
            assert r.wait()[:2] == (1, 9) and (got == 1).all(), name
        else:
            if rank == 1:
                comm.isend(np.ones(big, np.float32), 0, 9).wait()
            call()
    print(f"any-source across collectives: ok {mode} rank {rank}", flush=True)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "engine"
    if mode == "plain":
        from mpi4py import MPI
        comm, rank, size, wait = plain()
        irecv = lambda buf, source, tag: comm.Irecv(buf, MPI.ANY_SOURCE if source is None else source, tag)
        isend = lambda buf, dest, tag: comm.Isend(buf, dest, tag)
        result = lambda req, what: (lambda st: (st.Get_source(), st.Get_tag()))(wait(req, what))
    else:
        import engine
        comm = engine.Communicator(transport="mpi", timeout=30)
        rank, size = comm.rank, comm.size
        irecv, isend = comm.irecv, comm.isend
        result = lambda req, what: req.wait()[:2]
        mode = "probe" if comm._core.any_source_by_probe else "post"
    right, left = (rank + 1) % size, (rank - 1) % size
    for _ in range(ROUNDS):
        for n in SIZES:
            for dt in DTYPES:
                mine = np.full(n, rank, dt)
                for tag, source in ((0, left), (7, None)):   # (from the neighbour named, then from any rank)
                    got = np.empty(n, dt)
                    r = irecv(got, source, tag)
                    s = isend(mine, right, tag)
                    # the send waited for first: a large one completes only once its receiver's receive
                    # has its message, which that receiver gets while it too waits on its send
                    result(s, "its send's completion") if mode == "plain" else s.wait()
                    where = result(r, f"{n} {np.dtype(dt).name} from {'any rank' if source is None else source}, tag {tag}")
                    assert where == (left, tag) and (got == left).all(), (where, n, dt)
    # Receives from any rank keep MPI's order: several waiting at once, the oldest that matches gets
    # each message (by tag; ANY_TAG matches all), and one sender's messages arrive in the order sent.
    if mode != "plain":
        for _ in range(20):
            got = [np.empty(4, np.int64) for _ in range(4)]
            rs = [irecv(got[0], None, 5), irecv(got[1], None, 6), irecv(got[2], None, -1), irecv(got[3], None, 5)]
            ss = [isend(np.full(4, 10 * rank + k, np.int64), right, tag) for k, tag in enumerate((5, 5, 6, 5))]
            for s in ss:
                s.wait()
            where = [r.wait() for r in rs]
            assert where == [(left, 5, 4), (left, 6, 4), (left, 5, 4), (left, 5, 4)], where
            assert [int(g[0]) for g in got] == [10 * left, 10 * left + 2, 10 * left + 1, 10 * left + 3], got
            # a receive of any tag takes its sender's first message, whichever tag a younger one asks for
            rs = [irecv(got[0], None, -1), irecv(got[1], None, 5)]
            ss = [isend(np.full(4, 10 * rank + k, np.int64), right, tag) for k, tag in enumerate((6, 5))]
            for s in ss:
                s.wait()
            where = [r.wait() for r in rs]
            assert where == [(left, 6, 4), (left, 5, 4)] and [int(g[0]) for g in got[:2]] == [10 * left, 10 * left + 1], \
                (where, got)
    print(f"any-source: ok {mode} rank {rank}", flush=True)   # (engine: how it received from any rank)


if sys.argv[1:] == ["collectives"]:
    across_collectives()
else:
    main()
