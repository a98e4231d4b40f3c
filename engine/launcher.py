"""Who started this process: an MPI launcher (mpirun / mpiexec / srun), or something MPI cannot
join (torchrun, mp.spawn, plain python). Read from the environment only; nothing is imported."""

import math
import os

# (name, rank, size, local rank, local size) variables of each launcher; the first whose rank is set wins.
LAUNCHERS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH/Hydra or Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Slurm srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
)

MPIRUN_HINT = "launch the job with `mpirun -n N python script.py` (or srun with PMI/PMIx)"


def detect_launcher(environ=None):
    """(launcher name, rank, size, local rank, local size or None) from the environment, or None. Never
    for a torchrun worker (TORCHELASTIC_RUN_ID): torchrun started by srun or mpirun runs its workers
    beside the launcher's rank, whose variables they inherit, not as ranks of the launcher's job. Nor
    for a Slurm batch script or an salloc shell: they carry SLURM_PROCID and SLURM_NTASKS of the
    allocation, but only a step srun launched has SLURM_STEP_ID; a script that runs mp.spawn there
    makes a world of its own."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return None
    for name, rank, size, _, _ in _present(env):
        if rank in env and size in env:
            local_rank, local_size = local_of(env, int(env[rank]))
            return name, int(env[rank]), int(env[size]), local_rank or 0, local_size
    return None


def _present(env):
    """The launchers whose variables describe this process (Slurm's only in a step srun launched)."""
    return [launcher for launcher in LAUNCHERS if launcher[0] != "Slurm srun" or "SLURM_STEP_ID" in env]


def local_of(env, rank):
    """(local rank, local size or None) of this rank from the first launcher that numbers the ranks of
    a host and agrees on its rank, or (None, None). srun's PMI-2 plugin (--mpi=pmi2, MPICH's and Intel
    MPI's usual one under Slurm) sets Hydra's PMI_RANK and PMI_SIZE but not its MPI_LOCALRANKID: the
    local rank is then Slurm's own."""
    for _, rank_var, _, local, local_size in _present(env):
        if env.get(rank_var, "").strip() != str(rank):
            continue
        ls = env.get(local_size, "")
        if local_size == "SLURM_STEP_TASKS_PER_NODE":
            ls = _slurm_tasks_here(ls or env.get("SLURM_TASKS_PER_NODE", ""), env.get("SLURM_NODEID", ""))
        if local in env or ls.isdigit():
            return int(env[local]) if local in env else None, int(ls) if ls.isdigit() else None
    return None, None


def _slurm_tasks_here(counts, node):
    """This node's task count from Slurm's per-node list ("2(x3),1": two tasks on each of the first three
    nodes, one on the fourth) and the node's index (SLURM_NODEID), as text ("" where either is
    missing or malformed). (SLURM_NTASKS_PER_NODE is what the job asked for, set only when it asked.)"""
    if not node.isdigit():
        return ""
    left = int(node)
    for part in counts.split(","):
        count, repeated, times = part.partition("(x")
        times = times[:-1] if repeated and times.endswith(")") else "" if repeated else "1"
        if not (count.isdigit() and times.isdigit()):
            return ""
        if left < int(times):
            return count
        left -= int(times)
    return ""


def launcher_of_world(world_size, environ=None):
    """detect_launcher() where the world being made is the launcher's job (world_size: the size the
    caller gave, or None), else None: a world of another size is made beside it (mp.spawn under
    `srun -n 1`, a world made by hand with its store and size inside an MPI job), through torch's store."""
    launched = detect_launcher(environ)
    if launched is None or world_size in (None, -1, "") or int(world_size) == launched[2]:
        return launched
    return None


def local_size(environ=None):
    """How many of the job's processes this host runs, as the launcher says (torchrun's
    LOCAL_WORLD_SIZE, or an MPI launcher's local size), or None where none says."""
    env = os.environ if environ is None else environ
    ls = env.get("LOCAL_WORLD_SIZE", "")
    if ls.isdigit():
        return int(ls)
    found = detect_launcher(env)
    return found[4] if found else None


def usable_cores(root="/"):
    """The cores this process may run on: its affinity (a launcher that binds ranks narrows it), the
    first of them only where its cgroup's CPU quota grants fewer (a container's CPU limit, as
    Kubernetes sets it: the host's cores are all in the affinity, and a rank spinning on more than
    the quota is throttled)."""
    try:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = tuple(range(os.cpu_count() or 1))
    quota = cpu_quota(root)
    return cores[:quota] if quota is not None else cores


def cpu_quota(root="/"):
    """The CPUs this process's cgroup may use over time, rounded up (cgroup v2's cpu.max, v1's
    cpu.cfs_quota_us over cpu.cfs_period_us; the smallest along its path up the tree, since a parent's
    limit holds for its children), or None where no quota is set or the files can't be read. root:
    where / is (tests give a made-up tree)."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base = os.path.join(root, "sys/fs/cgroup")          # v2: one tree (beside v1's, in hybrid mode)
            if not os.path.exists(os.path.join(base, "cgroup.controllers")):
                base = os.path.join(base, "unified")
            read = _v2_quota
        elif "cpu" in controllers.split(","):
            base = os.path.join(root, "sys/fs/cgroup", controllers)   # v1: the cpu controller's tree
            if not os.path.isdir(base):
                base = os.path.join(root, "sys/fs/cgroup/cpu")
            read = _v1_quota
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            quota = read(os.path.join(base, *parts[:depth]))
            if quota is not None:
                found.append(quota)
    return max(1, math.ceil(min(found))) if found else None


def _v2_quota(directory):
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(directory):
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None
