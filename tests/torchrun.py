"""Runs a pytest file under torchrun with N ranks (no MPI launcher: the engine bootstraps through
torch's store and runs over shared memory). Used by tests/test_launchers.py and usable by hand:

    python tests/torchrun.py 3 tests/mpi/test_torch_backend.py
"""

import sys

from mpirun import mpi_env, run_job
from ports import free_port


def torchrun_command(nranks):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nranks), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "--tee", "3"]


def clean_env(**extra):
    """The environment without any MPI launcher's variables (as a torchrun job has it)."""
    env = {k: v for k, v in mpi_env().items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "PRTE_")) and k != "ENGINE_MPI_SUITE"}
    env["ENGINE_TORCHRUN_SUITE"] = "1"
    env.update(extra)
    return env


def run_pytest(nranks, paths, timeout, extra=(), env=None):
    paths = [paths] if isinstance(paths, str) else list(paths)
    cmd = torchrun_command(nranks) + ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "--color=no",
                                      *extra, *paths]
    return run_job(cmd, timeout, clean_env(**(env or {})), f"{nranks} ranks under torchrun, {' '.join(paths)}")


if __name__ == "__main__":
    proc = run_pytest(int(sys.argv[1]), sys.argv[2], timeout=600, extra=sys.argv[3:])
    print(proc.stdout, proc.stderr)
    sys.exit(proc.returncode)
