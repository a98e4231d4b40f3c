"""Zero-config launch: env:// variables from the MPI launcher, user values checked; without an MPI
launcher (torchrun-style env://) the ranks meet through torch's store and MPI is never imported."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from mpirun import (assert_rank_1_shrunk_away, launcher_output, mpi_aborted, mpi_env, mpiexec_command, run_job,
                    run_launcher, ulfm_unavailable, under_open_mpi)
from ports import free_port
from torchbridge.launch import detect_launcher, prepare_env

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


S = {"SLURM_STEP_ID": "0"}   # (a step srun launched)


@pytest.mark.parametrize("environ,expected", [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ("Open MPI", 2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1"}, ("MPICH/Hydra or Intel MPI", 1, 3, 1, None)),
    ({**S, "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, ("Slurm srun", 5, 8, 1, None)),
    # the local size: this node's entry in the step's per-node counts (the job's where srun gave none)
    ({**S, "SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
      "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS_PER_NODE": "2"}, ("Slurm srun", 6, 7, 0, 1)),
    ({**S, "SLURM_PROCID": "2", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
      "SLURM_TASKS_PER_NODE": "2(x3),1"}, ("Slurm srun", 2, 7, 0, 2)),
    ({**S, "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "3"}, ("Slurm srun", 0, 3, 0, 3)),
    ({**S, "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "4",
      "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}, ("Slurm srun", 0, 3, 0, None)),
    ({**S, "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "2(x"}, ("Slurm srun", 0, 3, 0, None)),
    # srun --mpi=pmi2: Hydra's rank and size without its local rank, which Slurm's variables give
    ({**S, "PMI_RANK": "3", "PMI_SIZE": "8", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
      "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, ("MPICH/Hydra or Intel MPI", 3, 8, 3, 4)),
    # a batch script (or an salloc shell): the allocation's variables, no step; a launcher's job only
    # where that launcher numbers the ranks itself
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
      "SLURM_TASKS_PER_NODE": "4"}, None),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"},
     ("MPICH/Hydra or Intel MPI", 1, 2, 0, None)),
    ({}, None),
])
def test_detect_launcher(environ, expected):
    assert detect_launcher(environ) == expected


def test_open_mpi_is_made_to_yield_when_its_ranks_fill_the_cores_and_mpich_is_left_alone():
    """engine.mpi.polite_env: Open MPI's yield-when-idle is set (and said) from as many local ranks as
    cores, unless the user set it; MPICH's and Intel MPI's launcher get no Open MPI setting (MPICH
    yields in its waits by itself)."""
    from engine.mpi import polite_env
    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    env = dict(ompi)
    assert "OMPI_MCA_mpi_yield_when_idle=1" in polite_env(env, cores=4) and env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert polite_env(dict(ompi), cores=8) is None
    env = {**ompi, "OMPI_MCA_mpi_yield_when_idle": "0"}
    assert polite_env(env, cores=2) is None and env["OMPI_MCA_mpi_yield_when_idle"] == "0"
    env = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"}
    assert polite_env(env, cores=2) is None and "OMPI_MCA_mpi_yield_when_idle" not in env


def _cgroup_tree(root, lines, files):
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("".join(line + "\n" for line in lines))
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return str(root)


def test_a_containers_cpu_quota_caps_the_cores_a_rank_counts(tmp_path):
    """engine.launcher.cpu_quota reads the cgroup's CPU limit (a Kubernetes pod's): cgroup v2's cpu.max,
    alone or beside v1 (hybrid), and v1's CFS quota; the smallest along the path up the tree, rounded up.
    usable_cores keeps that many of the affinity's cores, so that ranks filling a quota smaller than
    the host yield their waits (they counted the host's cores: spinning ranks were throttled)."""
    from engine.launcher import cpu_quota, usable_cores
    v2 = {"sys/fs/cgroup/cgroup.controllers": "cpu", "sys/fs/cgroup/cpu.max": "max 100000",
          "sys/fs/cgroup/pod/cpu.max": "250000 100000", "sys/fs/cgroup/pod/rank/cpu.max": "max 100000"}
    assert cpu_quota(_cgroup_tree(tmp_path / "v2", ["0::/pod/rank"], v2)) == 3
    hybrid = {"sys/fs/cgroup/unified/cgroup.controllers": "", "sys/fs/cgroup/unified/job/cpu.max": "50000 100000"}
    assert cpu_quota(_cgroup_tree(tmp_path / "hybrid", ["4:memory:/job", "0::/job"], hybrid)) == 1
    v1 = {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1", "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
          "sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_quota_us": "400000",
          "sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_period_us": "100000",
          "sys/fs/cgroup/cpu,cpuacct/a/b/cpu.cfs_quota_us": "600000",
          "sys/fs/cgroup/cpu,cpuacct/a/b/cpu.cfs_period_us": "100000"}
    assert cpu_quota(_cgroup_tree(tmp_path / "v1", ["3:cpu,cpuacct:/a/b", "2:memory:/a/b"], v1)) == 4
    unlimited = _cgroup_tree(tmp_path / "none", ["1:cpu:/", "0::/"],
                             {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"})
    assert cpu_quota(unlimited) is None and cpu_quota(str(tmp_path / "nothing")) is None
    affinity = tuple(sorted(os.sched_getaffinity(0)))
    assert usable_cores(unlimited) == affinity
    assert usable_cores(_cgroup_tree(tmp_path / "one", ["0::/"], {"sys/fs/cgroup/cgroup.controllers": "",
                                                                  "sys/fs/cgroup/cpu.max": "100000 100000"})) \
        == affinity[:1]


def test_ulfm_jobs_finalize_without_the_fence_over_dead_ranks():
    """engine.mpi.survivable_finalize_env: under ULFM (the launcher's OMPI_MCA_mpi_ft_enable) Open MPI's
    async_mpi_finalize is set before MPI starts, so the survivors' MPI_Finalize skips the PMIx fence
    over every process of the job, the dead ones too (open-mpi/ompi#11404); their own barrier stays.
    A plain job and a user's own choice are left alone; where MPI has started already, the note says
    what to set."""
    from engine.mpi import survivable_finalize_env
    env = {"OMPI_MCA_mpi_ft_enable": "1"}
    assert survivable_finalize_env(env) is None and env["OMPI_MCA_async_mpi_finalize"] == "1"
    env = {"OMPI_MCA_mpi_ft_enable": "1"}
    note = survivable_finalize_env(env, started=True)
    assert "set OMPI_MCA_async_mpi_finalize=1" in note and "OMPI_MCA_async_mpi_finalize" not in env
    env = {"OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_async_mpi_finalize": "0"}
    assert survivable_finalize_env(env, started=True) is None and env["OMPI_MCA_async_mpi_finalize"] == "0"
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}
    assert survivable_finalize_env(env) is None and "OMPI_MCA_async_mpi_finalize" not in env


@pytest.mark.parametrize("mpi_first", [False, True])
def test_a_ulfm_process_that_started_mpi_before_the_engine_is_told_to_skip_the_fence(mpi_first):
    """An MPI singleton with ULFM's setting: the engine's load() sets async_mpi_finalize before MPI
    starts; where the script started MPI first it is too late, and the engine says what to set."""
    code = ("import os\n" + ("from mpi4py import MPI\n" if mpi_first else "") +
            "import engine.mpi\nengine.mpi.load()\nprint('async_mpi_finalize', os.environ.get('OMPI_MCA_async_mpi_finalize'))")
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX", "OMPI_MCA_async"))}
    # (btl self: a singleton that starts MPI itself would leave Open MPI's shared-memory segment behind)
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_btl": "self"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(os.listdir("/dev/shm")) <= before, set(os.listdir("/dev/shm")) - before
    assert f"async_mpi_finalize {None if mpi_first else 1}" in proc.stdout, proc.stdout + proc.stderr
    told = "set OMPI_MCA_async_mpi_finalize=1 so that the survivors" in proc.stderr
    assert told == mpi_first, proc.stderr


MPICH_VERSION = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\nMPICH Device:       ch4:{}\n"


@pytest.mark.parametrize("version,environ,probes", [
    (MPICH_VERSION.format("ucx ofi"), {}, True),                                   # UCX, the default module
    (MPICH_VERSION.format("ucx ofi"), {"MPIR_CVAR_CH4_NETMOD": "ofi"}, False),
    (MPICH_VERSION.format("ofi ucx"), {}, False),
    (MPICH_VERSION.format("ofi ucx"), {"MPIR_CVAR_CH4_NETMOD": "UCX"}, True),
    (MPICH_VERSION.format("ofi"), {}, False),
    ("Open MPI v5.0.9, package: Open MPI", {}, False),
    ("Intel(R) MPI Library 2021.19 for Linux* OS", {}, False),
    ("Open MPI v5.0.9", {"ENGINE_MPI_ANY_SOURCE": "probe"}, True),
    (MPICH_VERSION.format("ucx ofi"), {"ENGINE_MPI_ANY_SOURCE": " Post"}, False),
])
def test_receives_from_any_rank_probe_under_mpichs_ucx_module_or_when_asked(version, environ, probes):
    from engine.mpi import any_source_by_probe
    assert any_source_by_probe(version, environ) is probes


def test_a_mistyped_any_source_mode_is_refused_naming_the_choices():
    from engine.mpi import any_source_by_probe
    with pytest.raises(ValueError, match="ENGINE_MPI_ANY_SOURCE='poll': use 'probe' or 'post'"):
        any_source_by_probe("MPICH Version: 5.0.2", {"ENGINE_MPI_ANY_SOURCE": "poll"})


def test_the_chosen_port_comes_from_below_the_ephemeral_range_and_is_free():
    """The MASTER_PORT the engine chooses (mpirun without one; here a world of one) comes from below the
    kernel's ephemeral range, where no outgoing connection takes it before the store binds it (a port
    the kernel picks, as before, comes from that range), and nothing listens on it."""
    import socket
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(20):
        env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
        prepare_env(environ=env)
        port = int(env["MASTER_PORT"])
        assert 1024 <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("", port))


def test_a_rank_that_reaches_the_store_before_it_listens_meets_it_at_once(monkeypatch):
    """Rank 1's rendezvous starts before rank 0's TCPStore listens (the usual order): it tries again
    every few milliseconds until the store accepts (torchbridge.rendezvous), where torch's client,
    refused, backed off 0.3-0.7 s before its next try, and every init paid that. Then the store works.
    With nothing ever listening it ends at the timeout naming the address."""
    import socket
    import threading
    from datetime import timedelta
    import torch.distributed as dist
    from torchbridge import rendezvous
    port, tries = free_port(), []
    real = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: (tries.append(a[0]), real(*a, **k))[1])
    server = []
    later = threading.Timer(0.3, lambda: server.append(dist.TCPStore("127.0.0.1", port, 2, True,
                                                                     timeout=timedelta(seconds=30))))
    later.start()
    store, rank, size = rendezvous.rendezvous(f"tcp://127.0.0.1:{port}?rank=1&world_size=2", -1, -1,
                                              timedelta(seconds=30))
    later.join()
    assert (rank, size) == (1, 2) and len(tries) > 10 and set(tries) == {("127.0.0.1", port)}, (rank, size, tries[:3])
    store.set("k", "v")
    assert server[0].get("k") == b"v"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 found nothing listening at torch's store at 127\.0\.0\.1:\d+ "
                                           r"for 0\.5 s \(the group's timeout; connection refused\)"):
        rendezvous.rendezvous(f"tcp://127.0.0.1:{free_port()}", 1, 2, timedelta(seconds=0.5))
    assert time.monotonic() - start < 5
    monkeypatch.setenv("RANK", "2")   # (whose rank waits: the argument, the url's, env://'s RANK; 0 serves)
    assert [rendezvous._client_rank(u, r) for u, r in [("env://", -1), ("tcp://h:1?rank=3", -1), ("tcp://h:1", 0),
                                                        ("tcp://h:1", None)]] == [2, 3, 0, None]
    # every 0.1 ms at first in a small world; a large one's ranks together try no more often than 10,000
    # times a second, then 2,000 (a job of thousands must not flood rank 0's host, nor a busy one its cores)
    assert rendezvous._poll_gap(0.01, 2) == 1e-4 and rendezvous._poll_gap(1.0, 2) == 2e-3
    assert 999 / rendezvous._poll_gap(0.01, 1000) <= 10000 and 999 / rendezvous._poll_gap(1.0, 1000) <= 2000


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


def test_a_world_beside_the_launchers_job_is_left_to_torch():
    """A torchrun worker that srun or mpirun started inherits the launcher's variables (TORCHELASTIC_RUN_ID
    says it is torchrun's), and mp.spawn under `srun -n 1` makes a world of another size than the job:
    neither is the launcher's world, so RANK, WORLD_SIZE and the store are torch's, as for Gloo (the engine
    refused them: 'RANK=1 disagrees with the MPI launcher (Slurm srun), which says 0'). (In a job of
    several ranks, a world of another size over env:// stays an error: test_user_values_win_and_are_checked.)"""
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}
    torchrun = {**slurm, "TORCHELASTIC_RUN_ID": "job", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    env = dict(torchrun)
    assert detect_launcher(env) is None and prepare_env(environ=env) is None and env == torchrun
    for given in (dict(world_size=2, rank=1), {}):   # (the size given, or in WORLD_SIZE)
        env = dict(slurm, **({} if given else {"WORLD_SIZE": "2", "RANK": "1"}))
        kept = dict(env)
        assert prepare_env(environ=env, **given) is None and env == kept


def test_local_rank_of_another_layer_is_replaced_by_the_launchers_with_one_warning():
    """DeepSpeed's MPI discovery numbers a host's ranks by processor name, Open MPI in its mapping's order:
    LOCAL_RANK changes nothing the engine does, so a differing value is accepted and made the launcher's
    (DeepSpeed itself then requires LOCAL_RANK == OMPI_COMM_WORLD_LOCAL_RANK)."""
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    with pytest.warns(RuntimeWarning, match=r"LOCAL_RANK=1 differs from the local rank the MPI launcher gave this "
                                            r"process \(Open MPI: 2\); LOCAL_RANK is set to 2") as caught:
        prepare_env(environ=env)
    assert len(caught) == 1 and (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "3", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare_env(environ=env)  # agrees now: nothing to say
    # No local rank from the launcher: nothing to follow, the value set wins.
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare_env(environ=env)
    assert env["LOCAL_RANK"] == "1"
    # srun --mpi=pmi2: Hydra's rank without its local rank; Slurm's numbering is the launcher's (every
    # rank of a node was given LOCAL_RANK=0, and scripts put them all on one device)
    env = {"PMI_RANK": "3", "PMI_SIZE": "8", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
           "SLURM_STEP_ID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    prepare_env(environ=env)
    assert env["LOCAL_RANK"] == "3"
    # RANK and WORLD_SIZE decide the result: a disagreement stays an error.
    with pytest.raises(RuntimeError, match="RANK=0 disagrees with the MPI launcher"):
        prepare_env(environ={"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "RANK": "0", "LOCAL_RANK": "1"})


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


def test_a_backend_string_giving_a_device_to_another_backend_is_warned_of():
    """"cpu:gloo,cuda:engine" can't be honoured (torch gives a backend that makes a whole ProcessGroup
    every device): init_process_group says so, once, naming where each device's tensors go; the
    group works (on the engine), and "engine" or "cpu:engine,cuda:engine" say nothing."""
    code = textwrap.dedent("""
        import json, sys, warnings, torch, torch.distributed as dist
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dist.init_process_group(sys.argv[1], store=dist.HashStore(), rank=0, world_size=1)
        t = torch.ones(3)
        dist.all_reduce(t)
        print(type(dist.distributed_c10d._get_default_group()).__name__, t.tolist())
        print(json.dumps([str(w.message) for w in seen if "makes the whole group" in str(w.message)]))
    """)
    for backend, said in (("cpu:gloo,cuda:engine", "cpu tensors go to engine, not gloo"),
                          ("cuda:gloo,cpu:engine", "cuda tensors go to engine, not gloo"),
                          ("engine", None), ("cpu:engine,cuda:engine", None)):
        proc = subprocess.run([sys.executable, "-c", code, backend], env=clean_env(), capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        group, warned = proc.stdout.splitlines()[-2:]
        assert group == "EngineProcessGroup [1.0, 1.0, 1.0]", proc.stdout
        warned = json.loads(warned)
        if said is None:
            assert warned == [], (backend, warned)
        else:
            assert len(warned) == 1 and said in warned[0] and f"backend='{backend}'" in warned[0], (backend, warned)


BESIDE_MPI = textwrap.dedent("""
    import datetime, os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp

    def world(rank, how, rounds):
        for i in range(rounds):
            if how == "store":   # (a world of one made by hand, inside an MPI job)
                dist.init_process_group("engine", store=dist.HashStore(), rank=0, world_size=1)
            elif how.startswith("tcp://"):
                dist.init_process_group("engine", init_method=how, rank=rank, world_size=2)
            else:
                if i and dist_rank == 0:
                    time.sleep(0.5)   # (rank 1 reaches the store first: it must not read the last world's keys)
                dist.init_process_group("engine", init_method=how)
            t = torch.ones(3) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            with open(os.path.join(sys.argv[3], f"{os.getpid()}"), "a") as out:   # (ranks' prints would interleave)
                print("round", i, "rank", dist.get_rank(), "of", dist.get_world_size(), t.tolist(), file=out)
            dist.destroy_process_group()

    dist_rank = int(os.environ.get("RANK", "0"))
    if __name__ == "__main__":
        how, rounds = sys.argv[1], int(sys.argv[2])
        if how == "spawn":
            mp.spawn(world, args=(sys.argv[4], rounds), nprocs=2)
        else:
            world(dist_rank, how, rounds)
""")
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
         "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("case", ["torchrun-under-srun", "spawn-under-srun", "world-of-one-under-mpiexec",
                                  "env-with-query-under-mpiexec"])
def test_worlds_beside_an_mpi_launchers_job_and_made_again(case, tmp_path):
    """Worlds that are not the MPI launcher's job, made as Gloo makes them: torchrun started by srun
    (the launcher's variables inherited; three worlds one after another on torchrun's store, rank 0
    coming to each new one after rank 1, which must not read the keys the last one left: a segment
    of another size), mp.spawn under `srun -n 1` (a tcp:// world of 2), a world of one made with its
    own store in each rank of an MPI job (the engine took MPI's world of 2 for it), and env:// with a
    query (`env://?use_libuv=0`: the zero-config fill skipped it)."""
    script, outs = tmp_path / "beside.py", tmp_path / "out"
    script.write_text(BESIDE_MPI)
    outs.mkdir()
    if case == "torchrun-under-srun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(script), "env://", "3", str(outs)]
        env, expect = clean_env(**SLURM), [f"round {i} rank {r} of 2 [3.0, 3.0, 3.0]" for i in range(3) for r in range(2)]
    elif case == "spawn-under-srun":
        cmd = [sys.executable, str(script), "spawn", "1", str(outs), f"tcp://127.0.0.1:{free_port()}"]
        env, expect = clean_env(**SLURM), [f"round 0 rank {r} of 2 [3.0, 3.0, 3.0]" for r in range(2)]
    else:
        how = "store" if case.startswith("world-of-one") else "env://?use_libuv=0"
        cmd, env = mpiexec_command(2) + [sys.executable, str(script), how, "1", str(outs)], mpi_env()
        expect = ["round 0 rank 0 of 1 [1.0, 1.0, 1.0]"] * 2 if how == "store" else \
            [f"round 0 rank {r} of 2 [3.0, 3.0, 3.0]" for r in range(2)]
    proc = run_launcher(cmd, 120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = [line for f in outs.iterdir() for line in f.read_text().splitlines()]
    assert sorted(got) == sorted(expect), proc.stdout[-3000:] + proc.stderr[-3000:]


REMADE_GROUPS = textwrap.dedent("""
    import datetime, torch, torch.distributed as dist
    seconds = datetime.timedelta(seconds=20)
    for world, members in enumerate(([0, 1], [0, 1, 2])):
        dist.init_process_group("engine", timeout=seconds)
        group = dist.new_group(members, timeout=seconds)   # (torch names it "1" in each world)
        t = torch.ones(1)
        if dist.get_rank() in members:
            dist.all_reduce(t, group=group)
        print(f"world {world} rank {dist.get_rank()} {t.item()}", flush=True)
        dist.destroy_process_group()
""")


def test_a_worlds_groups_made_again_under_torchrun_read_nothing_the_last_world_left(tmp_path):
    """Under torchrun a world made again after destroy_process_group meets on the agent's store, where
    torch names its groups from 1 again: group "1" of ranks [0, 1, 2] after the last world's of [0, 1].
    It is made (rank 2 read the last world's keys: "rank 0 was given ranks [0, 1]", and the others
    waited to the timeout)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(tmp_path / "remade.py")]
    (tmp_path / "remade.py").write_text(REMADE_GROUPS)
    proc = run_launcher(cmd, 120, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = sorted(re.findall(r"world \d rank \d \d\.\d", proc.stdout))   # (the ranks' lines may interleave)
    assert got == sorted([f"world 0 rank {r} {2.0 if r < 2 else 1.0}" for r in range(3)] +
                         [f"world 1 rank {r} 3.0" for r in range(3)]), proc.stdout[-3000:]


def run_ended_in_mpi_init(cmd, env):
    """Runs a job whose rank 0 the engine ends inside MPI_Init. MPICH's start-up has made its shared
    segment by then (mpich_shm_*), which a rank ended there can't remove (MPICH's own, as at a SIGKILL
    there): the test removes the ones the job left."""
    before = set(os.listdir("/dev/shm"))
    try:
        return run_launcher(cmd, 120, env=env)
    finally:
        for name in set(os.listdir("/dev/shm")) - before:
            if name.startswith("mpich_shm_"):
                os.unlink(os.path.join("/dev/shm", name))


def test_a_rank_that_never_calls_init_ends_the_job_at_the_timeout_of_the_others():
    """Under an MPI launcher without MASTER_ADDR, init_process_group meets the other ranks in MPI's start-up,
    which waits for every rank of the job and can't be interrupted (MPI_Init holds the GIL): rank 1 never
    calls init_process_group; rank 0 (timeout 3 s) says so at its timeout and exits 1, which ends the job,
    where it waited in MPI_Init for as long as rank 1 stayed away (for ever, for a rank stuck before it)."""
    code = textwrap.dedent("""
        import datetime, os, time, torch.distributed as dist
        from engine.launcher import detect_launcher
        if detect_launcher()[1] == 1:
            time.sleep(30)
            raise SystemExit(0)
        dist.init_process_group("engine", timeout=datetime.timedelta(seconds=3))
        print("init returned", flush=True)
    """)
    env = {k: v for k, v in mpi_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    start = time.monotonic()
    proc = run_ended_in_mpi_init(mpiexec_command(2) + [sys.executable, "-c", code], env)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "init returned" not in out, out[-3000:]
    assert re.search(r"engine: rank 0 of 2 \(.*\) waited 3 s \(the group's timeout\) for every rank of the job to "
                     r"start MPI .*: some rank never called init_process_group", out), out[-3000:]
    if under_open_mpi():   # (its launcher ends the job at the rank's exit; MPICH's waits for rank 1's)
        assert took < 25, f"the job ended {took:.1f} s after it started\n" + out[-3000:]


def test_a_rank_that_never_starts_mpi_ends_the_job_at_the_engines_timeout():
    """The engine's own API under mpiexec (engine.world()): rank 1 never starts MPI; rank 0, waiting in
    MPI's start-up, says so at ENGINE_TIMEOUT (3 s) and exits 1, where it waited for as long as rank 1
    stayed away."""
    code = textwrap.dedent("""
        import time
        from engine.launcher import detect_launcher
        if detect_launcher()[1] == 1:
            time.sleep(30)
            raise SystemExit(0)
        import engine
        engine.world()
        print("world made", flush=True)
    """)
    start = time.monotonic()
    proc = run_ended_in_mpi_init(mpiexec_command(2) + [sys.executable, "-c", code], {**mpi_env(), "ENGINE_TIMEOUT": "3"})
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "world made" not in out, out[-3000:]
    assert re.search(r"engine: rank 0 of 2 \(.*\) waited 3 s \(ENGINE_TIMEOUT\) in MPI's start-up for every rank of "
                     r"the job to start MPI: some rank never did", out), out[-3000:]
    if under_open_mpi():
        assert took < 25, f"the job ended {took:.1f} s after it started\n" + out[-3000:]


def test_a_timeout_that_is_not_a_timedelta_is_refused_as_torch_refuses_it():
    code = "import torch.distributed as dist; dist.init_process_group('engine', timeout=60)"
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert "TypeError: Expected timeout argument to be of type datetime.timedelta, got 60" in proc.stderr, proc.stderr


def test_mpi_started_alone_leaves_no_singleton_setting_behind():
    """MPI started in a process no launcher started (engine.MPI) runs on Open MPI's `self` BTL alone: the
    setting (OMPI_MCA_btl=self) is there while MPI starts, and gone after, where an MPI job this process
    launches would inherit it and fail (its ranks could not reach each other)."""
    code = ("import os, engine; engine.MPI.COMM_WORLD.Get_size(); print('left', os.environ.get('OMPI_MCA_btl'))")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert "left None" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("btl", ["^ofi", "self,sm,tcp"])
def test_mpi_started_alone_maps_no_shared_memory_segment_under_the_users_btl_list(btl):
    """A user's OMPI_MCA_btl (docs/tuning.md's ^ofi) made the engine leave Open MPI's BTLs as they were
    in a process no launcher started: its shared-memory BTL made a 16 MiB segment in /dev/shm that no
    launcher removes (on every run). The list now leaves sm out while MPI starts, and is the user's
    again after."""
    code = ("import os, engine; from engine import failure; engine.MPI.COMM_WORLD.Get_size(); "
            "print('left', os.environ.get('OMPI_MCA_btl'), 'mapped', failure._mpi_segments(), "
            "'Open MPI' in engine.MPI.Get_library_version())")
    proc = subprocess.run([sys.executable, "-c", code], env={**clean_env(), "OMPI_MCA_btl": btl}, capture_output=True,
                          text=True, timeout=60)
    if "True" not in proc.stdout:
        pytest.skip("Open MPI's setting: another MPI reads none of it")
    assert f"left {btl} mapped [] True" in proc.stdout, proc.stdout + proc.stderr


def test_registration_does_not_import_mpi_or_the_engine():
    code = ("import sys, torch, torch.distributed as dist; "
            "print('engine' in dist.Backend.backend_list, 'mpi4py' in sys.modules, 'engine' in sys.modules, "
            "'numba' in sys.modules, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "False", "False", "False"], out.stderr


def test_with_torchs_autoload_off_the_backend_comes_with_import_torchbridge():
    """TORCH_DEVICE_BACKEND_AUTOLOAD=0 (README's settings): torch loads no entry point, so `engine` is no
    backend name until the script imports torchbridge, which registers it."""
    code = ("import torch.distributed as dist; print('engine' in dist.Backend.backend_list); import torchbridge; "
            "print('engine' in dist.Backend.backend_list)")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr


FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")


def launch_init_case(*args, timeout=60, **env):
    """tests/faults/fail_at_init.py under mpiexec with 3 ranks: (returncode, output, seconds from the last
    rank's call of init_process_group to the job's end: its ranks' end, where the launcher outstayed them
    in Open MPI's deadlock). A job still running at the timeout (the hang these tests guard against) is
    killed whole, ranks included, and fails the test."""
    cmd = mpiexec_command(3) + [sys.executable, os.path.join(FAULTS, "fail_at_init.py"), *args]
    shm = set(os.listdir("/dev/shm"))
    proc = run_job(cmd, timeout, {**mpi_env(), "ENGINE_TIMEOUT": "300", **env}, " ".join(args))
    ended = time.time() - proc.ranks_gone_s
    out = launcher_output(proc.stdout + proc.stderr)
    calls = [float(t) for t in re.findall(r"calls init_process_group at ([\d.]+)", out)]
    seconds = ended - max(calls) if calls else None
    print(f"{' '.join(args)}: exit {proc.returncode}, the job ended {seconds} s after the last init_process_group")
    assert set(os.listdir("/dev/shm")) <= shm, (set(os.listdir("/dev/shm")) - shm, out[-3000:])  # the MPI's too
    return proc.returncode, out, seconds


@pytest.mark.parametrize("mode,var", [("mpi-first", "RANK"), ("mpi-first", "WORLD_SIZE"), ("ds-env", "RANK"),
                                      ("engine-starts-mpi", "WORLD_SIZE")])
def test_a_rank_failing_at_init_ends_the_job_with_its_error(mode, var):
    """One rank's init_process_group fails while the others wait for it (in the engine's rendezvous over MPI,
    or in torch's store): the job ends non-zero within 20 s (not at a timeout), the error shown, and nothing is left in /dev/shm.
    With MPI already up (the script or a library started it) the failing rank aborts the job at exit instead
    of waiting in MPI_Finalize. Before MPI is up, Open MPI's launcher ends the job at its exit; MPICH's does
    not (the others wait for the rank in MPI_Init), so there the rank starts MPI and aborts the job."""
    rc, out, seconds = launch_init_case(mode, var, TEST_PORT=str(free_port()))
    wrong = "RANK=7" if var == "RANK" else "WORLD_SIZE=4"
    launcher = "Open MPI" if under_open_mpi() else "MPICH/Hydra or Intel MPI"
    assert rc != 0, out[-3000:]
    assert f"RuntimeError: {wrong} disagrees with the MPI launcher ({launcher}), which says" in out, out[-3000:]
    assert seconds is not None and seconds < 20, f"the job ended {seconds} s after init_process_group\n" + out[-3000:]
    assert "done:" not in out, out[-3000:]
    if mode != "engine-starts-mpi" or not under_open_mpi():  # the failing rank aborted the job, with code 1
        assert "engine: rank 1 exits after init_process_group failed (RuntimeError: " in out, out[-3000:]
        if under_open_mpi():   # (MPICH's launcher may end the job before the rank's report of MPI_Abort)
            assert mpi_aborted(out, 1), out[-3000:]
        elif mode == "engine-starts-mpi":   # the rank said why it starts MPI
            assert "engine: rank 1: init_process_group failed (RuntimeError: " in out, out[-3000:]
    else:  # the failing rank exited 1 before MPI started, and the launcher ended the others
        assert re.search(r"Process name: \[\S+,1\]\s+Exit code:\s+1\b", out), out[-3000:]


def test_a_rank_raising_after_init_ends_the_job():
    """An exception nothing catches on one rank, the others waiting in a collective: the rank, which would
    wait in MPI_Finalize, aborts the job at exit (the others see no lost peer: its process is alive)."""
    rc, out, seconds = launch_init_case("after-init")
    assert rc != 0, out[-3000:]
    assert "RuntimeError: rank 1 fails after init on purpose" in out, out[-3000:]
    assert "engine: rank 1 exits after an uncaught exception (RuntimeError: rank 1 fails after init on purpose)" in out
    if under_open_mpi():   # (MPICH's launcher may end the job before the rank's report of MPI_Abort)
        assert mpi_aborted(out, 1), out[-3000:]
    assert "done:" not in out and seconds < 20, out[-3000:]


def test_worlds_made_again_under_mpirun_meet_in_a_new_store_each():
    """tests/faults/reinit.py, 3 ranks: three init/destroy cycles, rank 0 destroying each world a second
    after the others. With the port of the first world kept, a rank reached rank 0's old store, still
    up, and rank 0's next store waited for it until the timeout; each world now has a port of its own."""
    proc = run_launcher(mpiexec_command(3) + [sys.executable, os.path.join(FAULTS, "reinit.py")], 120, env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    worlds = re.findall(r"world (\d) rank (\d) port (\d+) sum \[3.0, 3.0\]", proc.stdout)
    assert len(worlds) == 9, proc.stdout[-3000:]
    ports = {w: {p for w2, _, p in worlds if w2 == w} for w, _, _ in worlds}
    assert all(len(p) == 1 for p in ports.values()) and len(set.union(*ports.values())) == 3, ports


@pytest.mark.skipif(ulfm_unavailable() is not None, reason=ulfm_unavailable() or "")
@pytest.mark.parametrize("transport,n", [("shm", 3), ("mpi", 4)])
def test_a_rank_killed_under_ulfm_is_shrunk_away_and_the_job_goes_on(transport, n):
    """tests/faults/ulfm_survivors.py under `mpiexec --with-ft ulfm`: rank 1 is SIGKILLed; the others'
    next all_reduce fails naming it (EnginePeerLost), they shrink it away, run collectives and a new
    group, and exit 0 (without ULFM the launcher ends them). Over MPI at 4 ranks, rank 2's wait inside
    MPI is on live ranks only: it ends because the engine revokes a broken group's communicators, at
    once; without the revoke it waited until a peer's note of the loss in the store ended it, 2 s in
    (before the notes, until the timeout)."""
    proc = run_launcher(mpiexec_command(n)[:1] + ["--with-ft", "ulfm"] + mpiexec_command(n)[1:] +
                        [sys.executable, os.path.join(FAULTS, "ulfm_survivors.py")],
                        120, env={**mpi_env(), "ENGINE_TRANSPORT": transport})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert_rank_1_shrunk_away(out, n)
    assert "seen from its note in the store" not in out, out[-4000:]


def test_a_local_rank_numbered_by_another_layer_is_accepted_under_mpirun():
    rc, out, _ = launch_init_case("local-rank")
    assert rc == 0, out[-3000:]
    past = re.findall(r"rank (\d) is past init_process_group with LOCAL_RANK=(\d) \(launcher: (\d)\)", out)
    assert len(past) == 3 and all(local == launcher for _, local, launcher in past), out[-3000:]
    assert out.count("rank 1 done: [3.0, 3.0, 3.0]") == 1, out[-3000:]
    # one warning on each rank whose value differed (reversed numbering: all but the middle one)
    assert out.count("differs from the local rank the MPI launcher gave this process") == 2, out[-3000:]
