"""Under mpiexec with 3 ranks: rank 1 can't make its end of a TCP group after the group's addresses
went round (its TcpTransport raises MemoryError: injected, as a rank out of memory or descriptors
would). The others must fail at once, not wait in the mesh's connect for the group's 60 s, naming
rank 1 and that it could not make its end (tests/test_faults.py).

Prints one short line a rank, `rank R: SECONDS TYPE NAMES HINT` (NAMES: `rank-1` where the message names
rank 1, HINT: `its-end` where it says it may have failed to make its end; else `-`), or `rank R: made`;
the whole message goes to stderr (long lines of two ranks may interleave)."""

import sys
import time

from mpi4py import MPI

import engine
import engine._core

rank = MPI.COMM_WORLD.Get_rank()
if rank == 1:
    def no_memory(*args, **kwargs):
        raise MemoryError("engine: no memory for TCP channel 0's transport (injected by the test)")
    engine._core.TcpTransport = no_memory   # (engine/tcp.py looks it up at each group)
MPI.COMM_WORLD.Barrier()   # (the clock starts when every rank is here: a rank slow to import is no delay)
start = time.monotonic()
try:
    engine.Communicator(transport="tcp", timeout=60)
    print(f"rank {rank}: made", flush=True)
except Exception as exc:
    text = str(exc)
    print(f"rank {rank}: {time.monotonic() - start:.2f} {type(exc).__name__} "
          f"{'rank-1' if 'rank 1 could not' in text else '-'} "
          f"{'its-end' if 'make its end of the group' in text else '-'}", flush=True)
    print(f"rank {rank}: {text}", file=sys.stderr, flush=True)
