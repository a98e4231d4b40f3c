"""A rank never joins the making of a group over MPI, whose blocking collectives nothing interrupts:
at the group's timeout (5 s) the job must end, naming the making and the call (mpirun ends non-zero).
MAKING=world: rank 1 never makes engine.Communicator() over MPI's world (the others wait in its first
MPI_Allgather); MAKING=subgroup: the world is made, then rank 1 never joins subgroup([0, 1]) (rank 0
waits in MPI_Comm_create_group; rank 2, not a member, leaves); MAKING=torch: the same for
dist.new_group([0, 1]) made over MPI (rank 1 skips it past torch's store agreement on the members:
it waits in MPI_Comm_create_group)."""
import os

from mpi4py import MPI

import engine

MODE = os.environ.get("MAKING", "world")
rank = MPI.COMM_WORLD.Get_rank()


def never():
    os.read(os.pipe()[0], 1)   # an event that never comes: the others' abort ends this rank


if MODE == "world":
    if rank == 1:
        never()
    engine.Communicator(timeout=5)
elif MODE == "subgroup":
    comm = engine.Communicator(timeout=5)
    if rank == 1:
        never()
    if rank == 2:
        raise SystemExit
    comm.subgroup([0, 1])
print(f"rank {rank}: returned (unexpected)", flush=True)
