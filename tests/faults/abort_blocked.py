"""abort() ends a call blocked on a rank that never arrives: every rank but the last enters a
collective (or a receive) that the last rank never joins; 1 s in, abort() is called on the group from
another thread (ABORT_FROM=thread, default) or from a SIGUSR1 handler (ABORT_FROM=signal: the signal is
sent by a helper thread, Python runs the handler on the main thread while that thread waits in the
engine). Each waiting rank prints `abort: rank R OP over TRANSPORT ended S s after abort() (FROM):
ERROR` (S < 0 where a peer that aborted first ended the call, telling it that the peer left); then the
group is reconfigured with every rank and checked with an all_reduce.

Under torchrun or mpirun (ENGINE_TRANSPORT picks the transport), 2 or more ranks; group timeout 60 s.
OP: ABORT_OP=all_reduce (default) | barrier | recv."""

import os
import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("engine", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    how = os.environ.get("ABORT_FROM", "thread")
    op = os.environ.get("ABORT_OP", "all_reduce")
    store = dist.distributed_c10d._get_default_store()
    store.set(f"abort/handle/{rank}", pg.get_reconfigure_handle())
    handles = [store.get(f"abort/handle/{r}").decode() for r in range(size)]
    transport = pg.communicator.transport
    aborted_at = []

    def abort():
        aborted_at.append(time.monotonic())
        pg.abort()

    if rank != size - 1:
        if how == "signal":
            signal.signal(signal.SIGUSR1, lambda *_: abort())
            timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        else:
            timer = threading.Timer(1.0, abort)
        timer.start()
        try:
            if op == "recv":
                dist.recv(torch.zeros(4), src=size - 1)
            elif op == "barrier":   # over MPI: MPI's own collective (MPI_Ibarrier), waited on by the engine
                dist.barrier()
            else:
                dist.all_reduce(torch.ones(1000))
            raise SystemExit(f"rank {rank}: the {op} returned although rank {size - 1} never joined")
        except RuntimeError as exc:
            ended = time.monotonic()
            # A peer that aborted first may have ended the call (it left) before this rank's own abort():
            # wait for that (a signal's handler runs on this thread, at its next Python step), and the
            # time printed is then negative.
            timer.join()
            deadline = ended + 5
            while not aborted_at and time.monotonic() < deadline:
                time.sleep(0.001)
            print(f"abort: rank {rank} {op} over {transport} ended {ended - aborted_at[0]:.4f} s after abort() "
                  f"({how}): {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    else:
        time.sleep(1.5)
        pg.abort()
    store.set(f"abort/done/{rank}", "1")
    store.wait([f"abort/done/{r}" for r in range(size)])
    opts = SimpleNamespace(uuid=77, handles=handles, timeout=timedelta(seconds=30))
    pg.reconfigure(opts).wait()
    t = torch.full((8,), rank + 1.0)
    dist.all_reduce(t)
    assert t[0].item() == size * (size + 1) / 2, t
    print(f"abort: rank {rank} reconfigured after abort over {pg.communicator.transport}: all_reduce right", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
