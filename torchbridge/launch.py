"""Zero-config launch: rank, world size and local rank from the MPI launcher's environment, and a
rendezvous address and free port agreed through MPI, written to the env:// variables torch reads.
Values the user (or a library such as DeepSpeed) set win, checked against the launcher: a RANK or
WORLD_SIZE that disagrees is an error; a LOCAL_RANK that differs (a numbering of its own) is replaced by
the launcher's, with one warning."""

import os
import random
import socket
import warnings


from engine.launcher import MPIRUN_HINT, detect_launcher, launcher_of_world, local_of


_chosen_port = {}   # id(environ) -> the MASTER_PORT this process chose for its last group


def prepare_env(world_size=-1, rank=-1, environ=None, timeout=None):
    """Fills the env:// variables torch reads from the MPI launcher. Without one (torchrun and
    mp.spawn set them themselves; plain `python` is a world of one), or where the launcher's job is
    this one process and the world is bigger (given as world_size or WORLD_SIZE: mp.spawn under
    `srun -n 1`), nothing is needed from MPI. In a job of several ranks, a world of another size is
    an error (the launcher's variables are the only ones env:// has there).
    A MASTER_PORT the engine chose for an earlier world of this process is chosen anew: a rank that
    reached its next init_process_group first would join the earlier world's store, still up in
    rank 0 (it was destroyed there a moment later), and leave rank 0's new store waiting for it.
    timeout (seconds; None: the engine's default, a group's) is how long the ranks wait for each other
    in MPI's start-up and the agreement on the store's address. MPI_Init can't be interrupted (it
    holds the GIL): at the timeout the rank says why and exits, which ends the job, where it waited
    for ever on a rank that never called init_process_group."""
    env = os.environ if environ is None else environ
    if env.get("MASTER_PORT") is not None and env.get("MASTER_PORT") == _chosen_port.get(id(env)):
        del env["MASTER_PORT"]
    launcher = detect_launcher(env)
    if launcher is not None and launcher[2] == 1:
        launcher = launcher_of_world(world_size if world_size not in (None, -1) else env.get("WORLD_SIZE"), env)
    if launcher is None:
        size = world_size if world_size not in (None, -1) else int(env.get("WORLD_SIZE", "1"))
        if size != 1:
            return  # torchrun / mp.spawn: the ranks meet through torch's store, on one host
        launcher = ("singleton", 0, 1, 0, 1)  # plain `python script.py`: one rank
    name, mpi_rank, mpi_size, local_rank, local_size = launcher
    for var, mpi_value, arg in (("RANK", mpi_rank, rank), ("WORLD_SIZE", mpi_size, world_size)):
        given = arg if arg not in (None, -1) else env.get(var)
        if given not in (None, "") and int(given) != mpi_value:
            raise RuntimeError(f"{var}={given} disagrees with the MPI launcher ({name}), which says {mpi_value}: "
                               f"unset {var} (the engine reads it from MPI) or make it agree")
        env.setdefault(var, str(mpi_value))
    if name == "singleton" or local_of(env, mpi_rank)[0] is None:
        env.setdefault("LOCAL_RANK", str(local_rank))  # no launcher's numbering to follow: a value set wins
    else:
        _follow_launchers_local_rank(env, name, local_rank)
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return
    if mpi_size == 1:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        _choose_port(env, str(free_port()))
        return
    from engine import mpi
    from engine._core import ExitDeadline
    from engine.watch import Watch
    seconds = Watch.timeout_of(timeout)   # (the group's: given, else ENGINE_TIMEOUT, else torch's default)
    deadline = ExitDeadline(seconds, f"engine: rank {mpi_rank} of {mpi_size} ({name}) waited {seconds:g} s (the "
                                     "group's timeout) for every rank of the job to start MPI and agree on the store's "
                                     "address in init_process_group: some rank never called init_process_group (or is "
                                     "stuck before it); this rank exits (1), which ends the job\n")
    try:
        comm = mpi.load(deadline=False).COMM_WORLD   # (under this deadline, with its words)
        if comm.Get_size() != mpi_size or comm.Get_rank() != mpi_rank:
            raise RuntimeError(f"MPI says rank {comm.Get_rank()} of {comm.Get_size()} but the {name} environment says "
                               f"{mpi_rank} of {mpi_size}; {MPIRUN_HINT}")
        # Across hosts, probe which of rank 0's addresses every rank reaches (decided by rank 0 for all:
        # the probe is collective).
        probe = comm.bcast(local_size != mpi_size and not env.get("MASTER_ADDR") if mpi_rank == 0 else None, root=0)
        addr = reachable_address(comm) if probe else (env.get("MASTER_ADDR") or "127.0.0.1")
        addr, port = comm.bcast((addr, env.get("MASTER_PORT") or str(free_port())) if mpi_rank == 0 else None, root=0)
    finally:
        deadline.cancel()
    env.setdefault("MASTER_ADDR", addr)
    _choose_port(env, port)


def _choose_port(env, port):
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = _chosen_port[id(env)] = port


def _follow_launchers_local_rank(env, launcher, local_rank):
    """LOCAL_RANK changes nothing the engine does (it finds the ranks sharing each host itself, from
    their host identities); it is there for the script and its libraries, to pick a device. Another
    layer may number the ranks of a host differently from the launcher: DeepSpeed's MPI discovery counts
    the earlier ranks with the same processor name, where Open MPI numbers them in its mapping's order
    (`mpirun -n 3 --oversubscribe` on 2 cores gives ranks 1 and 2 the local ranks 2 and 1), and then
    DeepSpeed's engine itself requires LOCAL_RANK to equal OMPI_COMM_WORLD_LOCAL_RANK. Under an MPI
    launcher the launcher's numbering is the one every layer can agree on: a LOCAL_RANK that differs
    is accepted and replaced by it, with one warning."""
    given = env.get("LOCAL_RANK")
    if given not in (None, "") and given.strip() != str(local_rank):
        warnings.warn(f"LOCAL_RANK={given} differs from the local rank the MPI launcher gave this process "
                      f"({launcher}: {local_rank}); LOCAL_RANK is set to {local_rank} (the engine finds the ranks "
                      "of each host itself; LOCAL_RANK only picks devices, and one numbering must hold for all)",
                      RuntimeWarning, stacklevel=4)
    env["LOCAL_RANK"] = str(local_rank)


def free_ports(n):
    """n distinct ports that nothing on this host listens on or uses now, below the kernel's ephemeral
    range. A port from that range, free when chosen, may be taken before the store binds it: every
    outgoing connection takes one (the engine's TCP transport and torch's stores bind port 0 too).
    Ports below the range are given out only on request, so one free at the choice stays free. Where
    the range can't be read, or fewer than n below it are free: the rest are ports the kernel picks,
    from the range. Drawn with the system's randomness, not the random module's: a script's seed
    neither decides the ports nor is moved by the choice."""
    if n < 1:
        raise ValueError(f"free_ports: n must be 1 or more, got {n}")
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 1024
    ports = []
    for port in random.SystemRandom().sample(range(max(1024, low - 12000), low), max(0, min(12000, low - 1024))):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports


def free_port():
    return free_ports(1)[0]


def host_addresses():
    """This host's non-loopback IPv4 addresses: its hostname's first (as DNS or /etc/hosts answer),
    then every interface's."""
    out = []
    try:
        out += [sa[0] for *_, sa in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except socket.gaierror:
        pass
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    out.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))  # SIOCGIFADDR
                except OSError:  # an interface without an IPv4 address
                    pass
    except (ImportError, OSError):
        pass
    return [a for a in dict.fromkeys(out) if not a.startswith("127.")]


def reachable_address(comm, timeout=2.0):
    """An address of rank 0 that every rank can reach, agreed through MPI (collective). Rank 0 listens
    on every interface and offers its addresses; each rank tries to connect to each; the first that all
    reached wins. A host with several interfaces (a private cluster network and a public one, a docker
    bridge, an address the hostname resolves to but other hosts can't route to) then still works."""
    import threading
    listener = None
    if comm.Get_rank() == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("0.0.0.0", 0))
        listener.listen(64)
        listener.settimeout(0.2)
        stop = threading.Event()

        def accept():
            while not stop.is_set():
                try:
                    listener.accept()[0].close()
                except OSError:
                    pass
        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        offer = (host_addresses(), listener.getsockname()[1])
    else:
        offer = None
    candidates, port = comm.bcast(offer, root=0)
    reached = 0
    if comm.Get_rank() != 0:
        for i, addr in enumerate(candidates):
            try:
                socket.create_connection((addr, port), timeout=timeout).close()
                reached |= 1 << i
            except OSError:
                pass
    else:
        reached = (1 << len(candidates)) - 1
    masks = comm.allgather(reached)
    if listener is not None:
        stop.set()
        thread.join()
        listener.close()
    everyone = [a for i, a in enumerate(candidates) if all(m >> i & 1 for m in masks)]
    if not everyone:
        raise RuntimeError(f"no address of rank 0's host ({', '.join(candidates) or 'none found'}) is reachable "
                           "from every rank; set MASTER_ADDR to one that is (and MASTER_PORT)")
    return everyone[0]
