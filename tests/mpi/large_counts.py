"""Over 2**31 elements (2 GiB of int8/uint8 per buffer): allreduce (the ring), broadcast and reduce
(chunked native MPI; shared memory has no int limits) are correct, not truncated. Run by
tests/test_large_counts.py on 2 ranks, on both transports."""

import numpy as np

import engine

N = 2**31 + 7
c = engine.world()
r, P = c.rank, c.size
marks = np.array([0, 1, 2**31 - 1, 2**31, 2**31 + 1, N - 1], dtype=np.int64)


def check(name, got_marks, want_marks):
    ok = np.array_equal(got_marks, want_marks)
    print(f"rank {r}: {name} {'ok' if ok else 'WRONG'} {got_marks.tolist()} vs {want_marks.tolist()}", flush=True)
    assert ok


x = np.full(N, r + 1, np.int8)
x[marks] = np.arange(len(marks), dtype=np.int8) + r
assert c.algorithm_for(N) == {"mpi": "ring", "shm": "twoshot"}[c.transport]
c.allreduce(x)
check("allreduce", x[marks], sum(np.arange(len(marks), dtype=np.int8) + q for q in range(P)).astype(np.int8))
assert x[12345] == P * (P + 1) // 2
del x

b = np.zeros(N, np.uint8) if r else np.full(N, 9, np.uint8)
if r == 0:
    b[marks] = [1, 2, 3, 4, 5, 6]
c.broadcast(b, root=0)
check("broadcast", b[marks], np.array([1, 2, 3, 4, 5, 6], np.uint8))
assert b[N // 3] == 9
del b

y = np.full(N, r + 1, np.int8)
y[-1] = 3 * (r + 1)
c.reduce(y, root=0)  # in place at the root
if r == 0:
    check("reduce", y[[0, 2**31, N - 1]], np.array([P * (P + 1) // 2, P * (P + 1) // 2, 3 * P * (P + 1) // 2], np.int8))
c.barrier()
