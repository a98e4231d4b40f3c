"""Training libraries on the engine, on CPU at 3 ranks, each compared with one process trained on the
full batches (the scripts in tests/clients/): DeepSpeed ZeRO stages 1-3 under torchrun and mpirun,
HF Accelerate over a group made first with backend "engine", Lightning's DDPStrategy and torch.compile
(functional collectives in a fullgraph function, a compiled DDP model) at 2 ranks; Ray Train's
TorchTrainer in the full run only (`make clients-full`: its install and run, about 75 s, don't fit
CI's budget).

`make setup` installs the libraries (requirements-clients.txt; Ray: requirements-clients-full.txt). A
missing one fails its test, naming the install command."""

import importlib.util
import os
import re
import sys

import pytest

from mpirun import mpi_env, mpiexec_command, run_job
from torchrun import clean_env, free_port, torchrun_command

CLIENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients")
ROOT = os.path.dirname(os.path.dirname(CLIENTS))
RANKS = 3  # DeepSpeed (ZeRO's partitions uneven: 212 parameters) and Ray
FEW_RANKS = 2  # Accelerate, Lightning, torch.compile: the same exactness at a lower cost (2 cores)
TOLERANCE = 1e-6
FULL = os.environ.get("ENGINE_CLIENTS_FULL") == "1"  # make clients-full
# torch.compile's backend: inductor (what users run; about 27 s more on 2 cores: its C++ kernels build).
# CI's torch 2.14 stage runs aot_eager, the same Dynamo graphs and functional collectives without
# inductor's kernels; its newest torch runs inductor (Makefile).
COMPILE_BACKEND = os.environ.get("ENGINE_CLIENTS_COMPILE_BACKEND", "inductor")


def needs(*modules, requirements="requirements-clients.txt", make="make setup"):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: pip install -c constraints.txt -r {requirements} "
                    f"({make} does)", pytrace=False)


def run(cmd, cwd, env, timeout=300):
    """The command's output, its stdout then its stderr; it must exit 0. A job past its timeout is killed
    whole (launcher and ranks) and fails the test with what its ranks wrote and where they waited
    (tests/mpirun.py: run_job)."""
    done = run_job(cmd, timeout, {**env, "PYTHONWARNINGS": "ignore::FutureWarning"}, " ".join(map(str, cmd)), cwd=cwd)
    assert done.returncode == 0, done.stdout[-4000:] + "\n" + done.stderr[-4000:]
    return done.stdout + "\n" + done.stderr


def differences(out):
    """{what: (ranks, largest difference from one process)} from the scripts' CLIENT lines."""
    # (the number alone: under torchrun --tee another rank's prefix may follow it on the same line)
    found = re.findall(r"CLIENT (.+?): (\d+) ranks.*?largest difference from one process on the full batches "
                       r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|nan))", out)
    return {what: (int(ranks), float(worst)) for what, ranks, worst in found}


def check(out, expected, nranks=RANKS):
    got = differences(out)
    assert set(got) == set(expected), out[-5000:]
    for what in expected:
        ranks, worst = got[what]
        assert ranks == nranks and worst <= TOLERANCE, f"{what}: {ranks} ranks, difference {worst}\n{out[-5000:]}"
        print(f"{what}: {ranks} ranks, largest difference from one process {worst:.3g}")  # shown by pytest -rA
    return got


def torchrun(script, *args, tmp_path, nranks=RANKS, **env):
    return run(torchrun_command(nranks) + [os.path.join(CLIENTS, script), *args], tmp_path, clean_env(**env))


DEEPSPEED_ENV = {"DS_ACCELERATOR": "cpu"}


def test_deepspeed_zero_stages_under_torchrun(tmp_path):
    needs("deepspeed")
    out = torchrun("deepspeed_zero.py", "1", "2", "3", tmp_path=tmp_path, **DEEPSPEED_ENV)
    check(out, [f"deepspeed zero-{s} torchrun" for s in (1, 2, 3)])


def test_deepspeed_zero_stages_under_mpirun(tmp_path):
    """DeepSpeed's MPI discovery sets RANK, WORLD_SIZE and LOCAL_RANK itself. Open MPI's own mapping
    (no --bind-to none here) numbers the local ranks of an oversubscribed host out of rank order (ranks 1
    and 2 get 2 and 1 on 2 cores), where DeepSpeed counts them in rank order: the engine takes Open MPI's,
    with at most one warning per rank, and DeepSpeed's own check that the two agree then passes."""
    needs("deepspeed", "mpi4py")
    cmd = mpiexec_command(RANKS)
    if "--bind-to" in cmd:
        i = cmd.index("--bind-to")
        del cmd[i:i + 2]
    env = {**mpi_env(), **DEEPSPEED_ENV, "DS_PORT": str(free_port())}
    out = run(cmd + [sys.executable, os.path.join(CLIENTS, "deepspeed_zero.py"), "1", "2", "3"], tmp_path, env)
    check(out, [f"deepspeed zero-{s} mpirun" for s in (1, 2, 3)])
    for rank in range(RANKS):
        warned = re.findall(rf"\[\d+,{rank}\]<stderr>:.*LOCAL_RANK=\d+ differs from the local rank", out)
        assert len(warned) <= 1, out[-5000:]


def test_accelerate_over_a_group_made_first(tmp_path):
    needs("accelerate")
    check(torchrun("accelerate_ddp.py", tmp_path=tmp_path, nranks=FEW_RANKS), ["accelerate ddp torchrun"], FEW_RANKS)


def test_lightning_ddp_strategy(tmp_path):
    needs("pytorch_lightning")
    check(torchrun("lightning_ddp.py", tmp_path=tmp_path, nranks=FEW_RANKS), ["lightning ddp torchrun"], FEW_RANKS)


def test_torch_compile_functional_collectives_and_compiled_ddp(tmp_path):
    out = torchrun("compiled.py", COMPILE_BACKEND, tmp_path=tmp_path, nranks=FEW_RANKS,
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    assert f"CLIENT torch.compile({COMPILE_BACKEND}) fullgraph functional collectives: {FEW_RANKS} ranks, equal to " \
        "eager" in out, out[-5000:]
    check(out, [f"torch.compile({COMPILE_BACKEND}) ddp torchrun"], FEW_RANKS)


@pytest.mark.skipif(not FULL, reason="Ray Train runs in the full run: make clients-full (ENGINE_CLIENTS_FULL=1)")
def test_ray_train_torch_trainer(tmp_path):
    needs("ray", requirements="requirements-clients-full.txt", make="make clients-full")
    out = run([sys.executable, os.path.join(CLIENTS, "ray_train.py"), str(RANKS)], tmp_path, clean_env())
    check(out, ["ray train torchtrainer"])
