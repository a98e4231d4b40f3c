"""Zero-config launch: rank, world size and local rank from the MPI launcher's environment, and a
rendezvous address and free port agreed through MPI, written to the env:// variables torch reads.
Values the user set win, and are checked against MPI."""

import os
import socket


from engine.launcher import LAUNCHERS, MPIRUN_HINT, detect_launcher  # noqa: F401  (re-exported)


def prepare_env(world_size=-1, rank=-1, environ=None):
    """Fills the env:// variables torch reads from the MPI launcher. Without one (torchrun and
    mp.spawn set them themselves; plain `python` is a world of one) nothing is needed from MPI."""
    env = os.environ if environ is None else environ
    launcher = detect_launcher(env)
    if launcher is None:
        size = world_size if world_size not in (None, -1) else int(env.get("WORLD_SIZE", "1"))
        if size != 1:
            return  # torchrun / mp.spawn: the ranks meet through torch's store, on one host
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
    from engine import mpi
    comm = mpi.load().COMM_WORLD
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
