"""Ranks whose ENGINE_* settings differ, each case on a fresh group (engine.Communicator under mpiexec,
every rank of the world, ENGINE_SOCKETS=2 so that a shared-memory group of 4 runs in two levels): rank
0 alone sets the case's variable. Every rank must refuse the group at once, naming the variable and
both values, where before a rank cut the same call differently: a two-shot step size read a peer's
blocks as its own and returned a wrong sum, other sizes failed or hung in the call, a hierarchy made
on some ranks only hung the others in its next split, ranks opening different transports or
connecting differently waited for each other for ever. A rank that can't read its settings (a
tuning file missing on its host) tells the others; a rank's own thread slices may differ. Then rank
1 alone sets a variable to a value it can't use (UNUSABLE): it raises, and the others name it.

Prints `CASE <name> rank <r>: <ExceptionType>: <message>` (or `made`), `UNUSABLE <name> rank <r>: ...`
likewise, then, on a group every rank agrees on, `AFTER <transport> rank <r>: <the sum's wrong
elements>`."""

import os

# name: (transport (None: ENGINE_TRANSPORT's), variable, rank 0's value)
CASES = {"shm two-shot step": ("shm", "ENGINE_SHM_CHUNK_BYTES", "131072"),
         "shm threshold": ("shm", "ENGINE_SHM_ONESHOT_MAX_BYTES", "1024"),
         "shm forced algorithm": ("shm", "ENGINE_ALLREDUCE_ALGO", "ring"),
         "shm debug mode": ("shm", "ENGINE_DEBUG", "1"),
         "shm levels": ("shm", "ENGINE_HIER", "off"),
         "shm sockets": ("shm", "ENGINE_SOCKETS", "1"),
         "shm threads of one socket": ("shm", "ENGINE_THREADS", "2"),
         "shm a rank's own thread slices": ("shm", "ENGINE_SHM_THREAD_SLICE_BYTES", "4096"),
         "the transport": (None, "ENGINE_TRANSPORT", "tcp"),
         "tcp ring segment": ("tcp", "ENGINE_RING_SEGMENT_BYTES", "65536"),
         "tcp connections": ("tcp", "ENGINE_TCP_CONNECT", "lazy"),
         "tcp tuning file missing on one rank": ("tcp", "ENGINE_TUNING_FILE", "/nonexistent/tuned.json"),
         "mpi tags": ("mpi", "ENGINE_MPI_TAG_UB", "32767"),
         "mpi native pieces": ("mpi", "ENGINE_MPI_CHUNK_ELEMENTS", "1000")}

# name: (transport, variable, a value rank 1 alone sets and can't use). It raises its own error; the
# others name it, where before they waited for it for ever in the exchange it never reached.
UNUSABLE = {"tcp streams": ("tcp", "ENGINE_TCP_STREAMS", "99"),
            "tcp interface missing on one host": ("tcp", "ENGINE_SOCKET_IFNAME", "nosuch0"),
            "shm slot size": ("shm", "ENGINE_SHM_SLOT_BYTES", "lots"),
            "shm single copy mode": ("shm", "ENGINE_SHM_CMA", "sometimes"),
            "shm two-shot step": ("shm", "ENGINE_SHM_CHUNK_BYTES", "big"),
            "shm threads": ("shm", "ENGINE_THREADS", "-1"),
            "shm spin budget": ("shm", "ENGINE_SPIN_US", "fast"),
            "shm flight recorder": ("shm", "ENGINE_FLIGHT_RECORDER_SIZE", "0"),
            "shm trace file": ("shm", "ENGINE_TRACE", "/nonexistent/trace.json"),
            "mpi tags": ("mpi", "ENGINE_MPI_TAG_UB", "many")}




def main():
    import numpy as np

    import engine
    from mpi4py import MPI

    R, P = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()

    def allreduce_errors(comm, n=1 << 18):
        x = np.arange(n, dtype=np.float32) % 1000 + R
        out = np.empty_like(x)
        comm.allreduce(x, out)
        return int((out != P * (np.arange(n, dtype=np.float32) % 1000) + P * (P - 1) // 2).sum())

    for label, cases, setter in (("CASE", CASES, 0), ("UNUSABLE", UNUSABLE, 1)):
        for name, (transport, var, value) in cases.items():
            before = os.environ.get(var)
            if R == setter:
                os.environ[var] = value
            try:
                comm = engine.Communicator(transport=transport, timeout=20)
                print(f"{label} {name} rank {R}: made, {allreduce_errors(comm)} wrong", flush=True)
                comm.free()
            except Exception as exc:
                print(f"{label} {name} rank {R}: {type(exc).__name__}: {exc}", flush=True)
            if before is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = before

    for transport in ("shm", "tcp", "mpi"):
        comm = engine.Communicator(transport=transport, timeout=20)
        print(f"AFTER {transport} rank {R}: {allreduce_errors(comm)} wrong", flush=True)
        comm.free()


if __name__ == "__main__":
    main()
