"""Zero-config launch: env:// variables from the MPI launcher, user values checked; without an MPI
launcher (torchrun-style env://) the ranks meet through torch's store and MPI is never imported."""

import os
import subprocess
import sys
import textwrap

import pytest

from mpirun import mpi_env
from torchbridge.launch import detect_launcher, free_port, prepare_env

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    assert "mpi4py" not in sys.modules, "import torch must not import MPI"
    dist.init_process_group(backend="engine")
    t = torch.ones(3)
    dist.all_reduce(t)
    print("world", dist.get_world_size(), dist.get_backend(), t.tolist(), "mpi4py" in sys.modules)
    dist.destroy_process_group()
""")


def clean_env(**extra):
    env = {k: v for k, v in mpi_env().items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "PMIX_", "SLURM_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra)
    return env


@pytest.mark.parametrize("environ,expected", [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ("Open MPI", 2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1"}, ("MPICH/Hydra or Intel MPI", 1, 3, 1, None)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, ("Slurm srun", 5, 8, 1, None)),
    ({}, None),
])
def test_detect_launcher(environ, expected):
    assert detect_launcher(environ) == expected


def test_user_values_win_and_are_checked():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    prepare_env(environ=env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == \
        ("0", "1", "0", "10.0.0.1", "1234")
    bad = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "RANK": "0"}
    with pytest.raises(RuntimeError, match="RANK=0 disagrees with the MPI launcher .Open MPI., which says 1"):
        prepare_env(environ=bad)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4 disagrees"):
        prepare_env(world_size=4, environ={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


def test_without_mpi_launcher_env_is_left_to_torch():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    prepare_env(environ=dict(env))
    assert prepare_env(environ=env) is None and env == {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                        "MASTER_PORT": "1234"}


def test_torchrun_style_env_launch_runs_without_mpi():
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=port))
             for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert "world 2 engine [2.0, 2.0, 2.0] False" in out, out + err[-2000:]


def test_plain_python_is_a_world_of_one():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "world 1 engine [1.0, 1.0, 1.0] False" in proc.stdout


def test_registration_does_not_import_mpi_or_the_engine():
    code = ("import sys, torch, torch.distributed as dist; "
            "print('engine' in dist.Backend.backend_list, 'mpi4py' in sys.modules, 'engine' in sys.modules, "
            "'numba' in sys.modules, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "False", "False", "False"], out.stderr
