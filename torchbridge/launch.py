"""Zero-config launch: rank, world size and local rank from the MPI launcher's environment, and a
rendezvous address and free port agreed through MPI, written to the env:// variables torch reads.
Values the user set win, and are checked against MPI."""

import os
import socket

# (rank, size, local rank, local size) variables of each launcher; the first whose rank is set wins.
LAUNCHERS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH/Hydra or Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Slurm srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)

MPIRUN_HINT = "launch the job with `mpirun -n N python script.py` (or srun with PMI/PMIx)"


def detect_launcher(environ=None):
    """(launcher name, rank, size, local rank, local size or None) from the environment, or None."""
    env = os.environ if environ is None else environ
    for name, rank, size, local, local_size in LAUNCHERS:
        if rank in env and size in env:
            ls = env.get(local_size, "")
            return (name, int(env[rank]), int(env[size]), int(env.get(local, 0)),
                    int(ls) if ls.isdigit() else None)
    return None


def prepare_env(world_size=-1, rank=-1, environ=None):
    env = os.environ if environ is None else environ
    launcher = detect_launcher(env)
    if launcher is None:
        size = world_size if world_size not in (None, -1) else int(env.get("WORLD_SIZE", "1"))
        if size != 1 and env.get("MASTER_ADDR") and _cuda_available():
            return  # torchrun set env:// itself; CUDA tensors go over NCCL, no MPI needed
        if size != 1:
            raise RuntimeError(
                f"backend 'engine' moves CPU tensors over MPI, but this process was not started by an MPI "
                f"launcher (world size {size}: torchrun or mp.spawn start independent processes that MPI "
                f"cannot join); {MPIRUN_HINT}")
        launcher = ("singleton", 0, 1, 0, 1)  # plain `python script.py`: one rank
    name, mpi_rank, mpi_size, local_rank, local_size = launcher
    for var, mpi_value, arg in (("RANK", mpi_rank, rank), ("WORLD_SIZE", mpi_size, world_size),
                                ("LOCAL_RANK", local_rank, -1)):
        given = arg if arg not in (None, -1) else env.get(var)
        if given not in (None, "") and int(given) != mpi_value:
            raise RuntimeError(f"{var}={given} disagrees with the MPI launcher ({name}), which says {mpi_value}: "
                               f"unset {var} (the engine reads it from MPI) or make it agree")
        env.setdefault(var, str(mpi_value))
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return
    if mpi_size == 1:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
        return
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() != mpi_size or comm.Get_rank() != mpi_rank:
        raise RuntimeError(f"MPI says rank {comm.Get_rank()} of {comm.Get_size()} but the {name} environment says "
                           f"{mpi_rank} of {mpi_size}; {MPIRUN_HINT}")
    addr = port = None
    if comm.Get_rank() == 0:
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if local_size == mpi_size else host_address())
        port = env.get("MASTER_PORT") or str(free_port())
    addr, port = comm.bcast((addr, port), root=0)
    env.setdefault("MASTER_ADDR", addr)
    env.setdefault("MASTER_PORT", port)


def _cuda_available():
    import torch
    return torch.cuda.is_available()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_address():
    """A non-loopback address of this host (the rendezvous server runs on rank 0)."""
    host = socket.gethostname()
    try:
        for *_, sockaddr in socket.getaddrinfo(host, None, socket.AF_INET):
            if not sockaddr[0].startswith("127."):
                return sockaddr[0]
    except socket.gaierror:
        pass
    return host
