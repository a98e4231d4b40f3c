"""Launcher variables and failures at init, under mpiexec with 3 ranks (tests/test_launch.py). MODE:

  mpi-first VAR      the script initialises MPI first (as DeepSpeed's MPI discovery does); rank 1's RANK
                     (VAR=RANK) or world_size argument (VAR=WORLD_SIZE) disagrees with the launcher. The
                     others wait for it in the engine's rendezvous, and it would wait for them in
                     MPI_Finalize: the job must end, non-zero, with the error shown.
  ds-env VAR         as mpi-first, with MASTER_ADDR and MASTER_PORT set as DeepSpeed sets them: the others
                     wait for rank 1 in torch's store rendezvous instead.
  engine-starts-mpi VAR   rank 1 fails before MPI starts; the others start it in the rendezvous.
  after-init         init succeeds everywhere; rank 1 then raises (nothing catches it) while the others
                     wait for it in a barrier.
  local-rank         MPI first, and every rank's LOCAL_RANK set to a numbering of its own (reversed, as
                     another layer may number the ranks of a host): init succeeds, with one warning on each
                     rank whose value differed, and LOCAL_RANK then follows the launcher.

Each rank prints when it calls init_process_group (time.time()), so the test can time the end from there."""

import os
import sys
import time

import torch
import torch.distributed as dist

from engine.launcher import detect_launcher

MODE = sys.argv[1]
VAR = sys.argv[2] if len(sys.argv) > 2 else ""
FAILING = 1
_, rank, size, launchers_local_rank, _ = detect_launcher()
if MODE in ("mpi-first", "ds-env", "local-rank"):
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()
if MODE == "ds-env":
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ["TEST_PORT"]
if MODE == "local-rank":
    os.environ["LOCAL_RANK"] = str(size - 1 - launchers_local_rank)
kwargs = {}
if rank == FAILING and VAR == "RANK":
    os.environ["RANK"] = "7"
elif rank == FAILING and VAR == "WORLD_SIZE":
    kwargs["world_size"] = 4
print(f"rank {rank} calls init_process_group at {time.time():.3f}", flush=True)
dist.init_process_group(backend="engine", **kwargs)
print(f"rank {rank} is past init_process_group with LOCAL_RANK={os.environ['LOCAL_RANK']} (launcher: "
      f"{launchers_local_rank})", flush=True)
if MODE == "after-init" and rank == FAILING:
    raise RuntimeError(f"rank {rank} fails after init on purpose")
t = torch.ones(3)
dist.all_reduce(t)
dist.barrier()
print(f"rank {rank} done: {t.tolist()}", flush=True)
dist.destroy_process_group()
