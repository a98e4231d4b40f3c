"""A rank SIGKILLed in the middle of a job under `mpiexec --with-ft ulfm` (Open MPI's fault-tolerant
MPI, whose job outlives a rank): every survivor's next collective fails with EnginePeerLost, naming the
dead rank, or, on a rank whose wait inside MPI was on a live peer, the revoke that ended it (the engine
revokes a broken group's MPI communicators; without that such a rank waited until the timeout). The
survivors shrink the dead rank away and go on: collectives on the shrunk world, a new group, and rounds
half a second apart that a launcher ending the job on a death would not let them run. Each survivor
prints `lost: <error>` and `survivor R is rank r of n: ok`, and then exits: MPI_Finalize, whose fence
over every process of the job, the dead one too, the engine has Open MPI skip (it hung there in 8 of
40 launches on 2 busy cores, open-mpi/ompi#11404). Run by tests/test_launch.py and
tests/test_hosts.py."""

import os
import re
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine import EnginePeerLost

DEAD = 1

dist.init_process_group("engine", timeout=timedelta(seconds=60))
# (set by the engine before MPI starts: the survivors' MPI_Finalize skips the fence over the dead rank)
assert os.environ.get("OMPI_MCA_async_mpi_finalize") == "1", os.environ.get("OMPI_MCA_async_mpi_finalize")
rank, n = dist.get_rank(), dist.get_world_size()
t = torch.ones(3)
dist.all_reduce(t)
assert t.tolist() == [float(n)] * 3, t
if rank == DEAD:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    dist.all_reduce(torch.ones(1 << 10))
    raise SystemExit(f"rank {rank}: the all_reduce returned although rank {DEAD} was killed")
except EnginePeerLost as exc:
    assert re.search(rf"rank {DEAD} (\(pid \d+\) )?exited|revoked its MPI communicators", str(exc)), exc
    print(f"lost: rank {rank}: {exc}", flush=True)
dist.shrink_group([DEAD], shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
survivors = [r for r in range(n) if r != DEAD]
assert (dist.get_rank(), dist.get_world_size()) == (survivors.index(rank), n - 1)
t = torch.full((5,), float(rank))
dist.all_reduce(t)
assert t.tolist() == [float(sum(survivors))] * 5, t
out = torch.zeros(n - 1)
dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
assert out.tolist() == [float(r) for r in survivors], out
sub = dist.new_group(list(range(n - 1)))
t = torch.ones(2)
dist.all_reduce(t, group=sub)
assert t.tolist() == [float(n - 1)] * 2, t
for _ in range(4):
    time.sleep(0.5)
    t = torch.ones(7)
    dist.all_reduce(t)
    assert t.tolist() == [float(n - 1)] * 7, t
print(f"survivor {rank} is rank {dist.get_rank()} of {dist.get_world_size()}: ok", flush=True)
dist.destroy_process_group()
