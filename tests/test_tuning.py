"""The tuner (python -m bench tune) and the tuning file the engine reads at start (ENGINE_TUNING_FILE)."""

import json
import os
import sys

import pytest

from bench.tune import rules_from
from engine import registry
from mpirun import mpi_env, mpiexec_command, run_launcher
from torchrun import clean_env, torchrun_command

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EVERY = 1 << 62


def test_rules_join_sizes_with_the_same_winner_and_split_halfway():
    t = {1024: {"oneshot": 1, "twoshot": 2}, 4096: {"oneshot": 1, "twoshot": 3},
         16384: {"oneshot": 5, "twoshot": 4}, 65536: {"oneshot": 9, "twoshot": 4}}
    rules = rules_from(t, 3, ["oneshot", "twoshot"])
    assert rules == [{"algorithm": "oneshot", "min_bytes": 0, "max_bytes": 8192, "min_ranks": 3, "max_ranks": 3},
                     {"algorithm": "twoshot", "min_bytes": 8193, "max_bytes": EVERY, "min_ranks": 3, "max_ranks": 3}]


def write(tmp_path, doc):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("doc, message", [
    ({"allreduce": {}}, "not an engine tuning file"),
    ({"format": "engine-tuning/1", "allreduce": {"shm": [{"algorithm": "native"}]}}, "does not run on the shm"),
    ({"format": "engine-tuning/1", "allreduce": {"udp": []}}, "unknown transport 'udp'"),
    ({"format": "engine-tuning/2", "rules": {"allreduce": {"mpi": [{"algorithm": "ring", "min_bytes": -1}]}}},
     r"allreduce.mpi\[0\]: min_bytes must be an integer 0..4611686018427387904, not -1"),
    ({"format": "engine-tuning/2", "rules": {"allreduce": {"mpi": [{"algorithm": "ring", "min_bytes": 2 ** 70}]}}},
     r"allreduce.mpi\[0\]: min_bytes must be an integer 0..4611686018427387904, not 1180591620717411303424"),
    ({"format": "engine-tuning/2", "rules": {"allreduce": {"mpi": [{"algorithm": "ring", "max_ranks": 2 ** 64}]}}},
     r"allreduce.mpi\[0\]: max_ranks must be an integer 0..4611686018427387904, not 18446744073709551616"),
    ({"format": "engine-tuning/2", "rules": {"allreduce": {"mpi": [{"algorithm": "ring", "min_ranks": True}]}}},
     r"allreduce.mpi\[0\]: min_ranks must be an integer 0..4611686018427387904, not True"),
    ({"format": "engine-tuning/2", "rules": {"allreduce": {"mpi": [{"algorithm": "ring", "min_bytes": 9,
                                                                     "max_bytes": 8}]}}}, "empty range"),
    ({"format": "engine-tuning/2", "rules": {"allreduce": {"shm": [{"algorithm": "ring"}] * 33}}}, "at most 32 rules"),
    ({"format": "engine-tuning/2", "rules": {"scan": {"shm": []}}}, "unknown collective 'scan'"),
    ({"format": "engine-tuning/2", "rules": {"broadcast": {"shm": [{"algorithm": "oneshot"}]}}},
     "its broadcast runs .*single_copy, segment"),
    ({"format": "engine-tuning/2", "thresholds": {"ENGINE_SHM_ONESHOT_MAX": 5}}, "unknown threshold"),
    ({"format": "engine-tuning/2", "rules": {"gather": {"shm": [{"algorithm": "linear", "max_bytes": 1000}]}}},
     r"gather.shm: a gather rule can't depend on the call's size"),
    ({"format": "engine-tuning/2", "rules": {"scatter": {"tcp": [{"algorithm": "linear", "min_bytes": 8}]}}},
     r"scatter.tcp: a scatter rule can't depend on the call's size"),
    ({"format": "engine-tuning/2", "thresholds": {"ENGINE_SHM_ONESHOT_MAX_BYTES": -5}},
     "threshold ENGINE_SHM_ONESHOT_MAX_BYTES must be an integer 0..4611686018427387904, not -5"),
    ({"format": "engine-tuning/2", "thresholds": {"ENGINE_SHM_ONESHOT_MAX_BYTES": True}},
     "threshold ENGINE_SHM_ONESHOT_MAX_BYTES must be an integer 0..4611686018427387904, not True"),
    ({"format": "engine-tuning/2", "thresholds": {"ENGINE_RING_SEGMENT_BYTES": 8}}, "must be 16..4611686018427387904, not 8"),
])
def test_a_bad_tuning_file_is_named_with_what_is_wrong(tmp_path, doc, message):
    with pytest.raises(ValueError, match=message):
        registry.tuned(write(tmp_path, doc))


def test_a_missing_tuning_file_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="engine.bench tune"):
        registry.tuned(str(tmp_path / "nope.json"))


# Two ranks allreduce 1 KB and 1 MB with a trace on; the trace names the algorithm each call ran. (numpy
# buffers: the registry's choice is the engine's, and a rank spared torch's import starts in a fraction.)
TRACED = """
import numpy, engine
c = engine.world()
for n in (256, 1 << 18):
    x = numpy.ones(n, dtype=numpy.float32)
    c.allreduce(x)
    assert bool((x == c.size).all())
"""


def traced_algorithms(tmp_path, nranks, **env):
    trace = tmp_path / "trace.json"
    proc = run_launcher(mpiexec_command(nranks) + [sys.executable, "-c", TRACED],
                        120, env={**mpi_env(), "ENGINE_TRACE": str(trace), **env}, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = json.loads((tmp_path / "trace.rank0.json").read_text())["traceEvents"]
    return [(e["args"]["count"], e["args"]["algorithm"]) for e in events if e["name"] == "allreduce"]


def test_the_tuners_file_changes_the_algorithm_in_the_trace(tmp_path):
    out = tmp_path / "tuned.json"
    proc = run_launcher(mpiexec_command(2) + [sys.executable, "-m", "bench", "tune", "-o", str(out), "-b", "1K",
                                              "-e", "1M", "-f", "32", "--rounds", "1", "--budget", "0.02"],
                        180, env=mpi_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["timings_us"]) == {"1024", "32768", "1048576"}
    rules = doc["rules"]["allreduce"]["shm"]
    assert rules[0]["min_bytes"] == 0 and rules[-1]["max_bytes"] == EVERY
    assert registry.tuned(str(out))["rules"]["allreduce", "shm"]  # the engine reads what the tuner wrote

    assert traced_algorithms(tmp_path, 2) == [(256, "oneshot"), (1 << 18, "twoshot")]  # the built-in rules
    # A file as the tuner writes it, saying the ring wins up to 64 KB and recursive doubling above, at 2 ranks.
    forced = {"format": "engine-tuning/1", "allreduce": {"shm": [
        {"algorithm": "ring", "min_bytes": 0, "max_bytes": 65536, "min_ranks": 2, "max_ranks": 2},
        {"algorithm": "rdouble", "min_bytes": 65537, "max_bytes": EVERY, "min_ranks": 2, "max_ranks": 2}]}}
    path = write(tmp_path, forced)
    assert traced_algorithms(tmp_path, 2, ENGINE_TUNING_FILE=path) == [(256, "ring"), (1 << 18, "rdouble")]
    # Rules for 2 ranks leave a 3-rank group on the defaults.
    assert traced_algorithms(tmp_path, 3, ENGINE_TUNING_FILE=path) == [(256, "oneshot"), (1 << 18, "twoshot")]


def test_the_tuner_runs_under_torchrun_without_mpi(tmp_path):
    """Without an MPI launch the tuner's group meets through torch's store and times shared memory."""
    out = tmp_path / "tuned.json"
    proc = run_launcher(torchrun_command(2) + ["-m", "bench", "tune", "-o", str(out), "-b", "1K", "-e", "64K", "-f",
                                               "64", "--rounds", "1", "--budget", "0.02"],
                        180, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["measured_on"]["transport"] == "shm" and doc["measured_on"]["ranks"] == 2
    assert set(doc["timings_us"]) == {"1024", "65536"} and registry.tuned(str(out))["rules"]["allreduce", "shm"]


class _SpinRecorder:
    spin = None

    def set_spin(self, microseconds):
        self.spin = microseconds


@pytest.mark.parametrize("ranks, cores, network, spins", [
    (2, 2, False, True),     # two ranks on two cores over shared memory: spinning measured faster
    (3, 3, False, False),    # ranks fill the cores: launcher and helpers would have none but a spinner's
    (16, 16, False, False),
    (8, 16, False, True),    # a spare core for each rank's helpers
    (2, 2, True, False),     # the kernel's network processing needs a core
    (3, 2, False, False),    # oversubscribed
    (1, 1, False, True),
])
def test_waits_spin_only_where_no_peer_needs_the_core(monkeypatch, ranks, cores, network, spins):
    from engine.communicator import _polite_waits
    monkeypatch.delenv("ENGINE_SPIN_US", raising=False)
    everyone = [("host", r, frozenset(range(cores))) for r in range(ranks)] + [("other", 0, frozenset({0}))]
    core = _SpinRecorder()
    _polite_waits(core, network, everyone, 0)
    assert (core.spin is None) == spins
    monkeypatch.setenv("ENGINE_SPIN_US", "7")
    _polite_waits(core, network, everyone, 0)
    assert core.spin == 7.0


def _uneven_calls(rank, path, tuning, out):
    import numpy as np
    import torch.distributed as dist
    import engine
    os.environ.update(ENGINE_TUNING_FILE=tuning, ENGINE_TRANSPORT="shm", ENGINE_TIMEOUT="5")
    try:
        comm = engine.Communicator.from_store(dist.FileStore(path, 2), rank, 2, name="uneven")
        counts = [2048, 100]   # (rank 0's part above the rules' 4096 bytes, rank 1's below)
        mine = np.full(counts[rank], rank + 1.0, np.float32)
        whole = np.concatenate([np.full(n, r + 1.0, np.float32) for r, n in enumerate(counts)])
        got = np.zeros(sum(counts), np.float32)
        comm.allgather(mine, got, counts)
        assert np.array_equal(got, whole), "allgather"
        got[:] = 0
        comm.gather(mine, got if rank == 1 else None, root=1, counts=counts)
        assert rank != 1 or np.array_equal(got, whole), "gather"
        part = np.zeros(counts[rank], np.float32)
        comm.scatter(whole if rank == 0 else None, part, root=0, counts=counts)
        assert np.array_equal(part, whole[sum(counts[:rank]):][:counts[rank]]), "scatter"
        comm.reduce_scatter(whole, part, counts=counts)
        assert np.array_equal(part, 2 * whole[sum(counts[:rank]):][:counts[rank]]), "reduce_scatter"
        sends = [[2048, 2048], [100, 100]][rank]   # (rank r sends blocks of counts[r] to each rank)
        received = np.zeros(sum(counts), np.float32)
        comm.alltoall(np.full(sum(sends), rank + 1.0, np.float32), received, sends, counts)
        assert np.array_equal(received, whole), "alltoall"
        comm.free()
        out.put((rank, "ok"))
    except BaseException as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def test_uneven_calls_pick_the_same_rule_on_every_rank(tmp_path):
    """Rules whose byte ranges split the parts of an uneven call (ENGINE_TUNING_FILE: the point-to-point
    algorithms up to 4 KiB over shared memory): every rank picks its rule from the largest part, which
    all know, not from its own, where rank 0 would run one algorithm and rank 1 another, and both time
    out. An uneven alltoall, whose sizes no rank knows whole, runs the rule for the largest calls.
    (Size-split gather and scatter rules are refused: off the root, torch gives no counts.)"""
    import multiprocessing as mp
    small = {"min_bytes": 0, "max_bytes": 4096}
    tuning = write(tmp_path, {"format": "engine-tuning/2", "rules": {
        "allgather": {"shm": [{"algorithm": "ring", **small}]},
        "gather": {"shm": [{"algorithm": "linear"}]},
        "scatter": {"shm": [{"algorithm": "linear"}]},
        "reduce_scatter": {"shm": [{"algorithm": "ring", **small}]},
        "alltoall": {"shm": [{"algorithm": "pairwise", **small}]}}})
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_uneven_calls, args=(r, str(tmp_path / "store"), tuning, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == [(0, "ok"), (1, "ok")], results


def test_a_tuning_file_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    """ENGINE_TUNING_FILE naming a FIFO blocked the group's making for good (its open waits for a
    writer), and /dev/zero read until killed: each is refused at once, naming the setting."""
    from engine import tuning
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        with pytest.raises(ValueError, match=rf"ENGINE_TUNING_FILE={path}: not a regular file"):
            tuning.parse(str(path))
