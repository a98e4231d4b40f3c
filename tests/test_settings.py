"""The engine's settings (README's table of environment variables): each one is set by a test, and a
value the engine can't use is refused with an error that names the variable."""

import io
import json
import os
import pathlib
import re

import numpy as np
import pytest

import engine
from engine import config, failure, registry
from engine.fusion import FusedAllreduce, plan_buckets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))


def _tests_text():
    """The tests' code, without their comments (a comment naming a setting sets nothing)."""
    import tokenize
    text = []
    for folder, _, files in os.walk(HERE):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f), "rb") as src:
                    text += [tok.string for tok in tokenize.tokenize(src.readline) if tok.type != tokenize.COMMENT]
    return "\n".join(text)


def test_every_setting_in_the_readme_is_named_by_a_test():
    """A documented setting no test runs is a bug waiting. The registry's thresholds are all set by
    test_every_threshold_follows_its_variable (they are read through one class); every other setting
    must at least be named in a test (a guard for new settings: the tests below set each one)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    rows = re.findall(r"^\| (`ENGINE_[^|]*)\|", readme, re.M)
    names = {n for row in rows for n in re.findall(r"`(ENGINE_[A-Z0-9_]+)`", row)}
    assert len(names) > 30, rows   # (the table was found)
    thresholds = {t.env for t in registry.tunables()}
    tests = _tests_text()
    unset = sorted(n for n in names - thresholds if n not in tests)
    assert not unset, f"documented in README.md, named by no test: {unset}"


def test_every_setting_the_code_reads_is_in_the_readme():
    """The other way round: each ENGINE_ variable the engine's code names whole (engine/, torchbridge/,
    pyx/, setup.py) is in README.md, so no setting is read that a user can't find."""
    root = pathlib.Path(ROOT)
    sources = [p for pattern in ("engine/**/*.py", "torchbridge/*.py", "torchbridge/*.pyx", "pyx/*.pxi", "pyx/*.pyx",
                                 "pyx/*.h", "setup.py") for p in root.glob(pattern)]
    read = {n for p in sources for n in re.findall(r"[\"']ENGINE_([A-Z0-9_]+)[\"']", p.read_text())}
    assert len(read) > 30, read
    readme = (root / "README.md").read_text()
    assert sorted(f"ENGINE_{n}" for n in read if f"ENGINE_{n}" not in readme) == []


def test_every_threshold_follows_its_variable(monkeypatch):
    for t in registry.tunables():
        monkeypatch.setenv(t.env, "12K")
        assert t.value() == 12 << 10, t.env
        for bad in ("12 KiB", str(t.minimum - 1)):   # (a negative size reached the core as a bare OverflowError)
            monkeypatch.setenv(t.env, bad)
            with pytest.raises(ValueError, match=f"{t.env}='{bad}'"):
                t.value()
        monkeypatch.delenv(t.env)
        assert t.value() == t.default or registry.tuned() is not None, t.env


def test_sizes_and_seconds_are_parsed_or_refused_by_name(monkeypatch):
    monkeypatch.setenv("ENGINE_X", "1.5M")
    assert config.env_int("ENGINE_X", 7) == 3 << 19 == config.env_int("ENGINE_X", 7, minimum=3 << 19)
    with pytest.raises(ValueError, match=r"ENGINE_X='1.5M': expected at least 1572865"):
        config.env_int("ENGINE_X", 7, minimum=(3 << 19) + 1)
    monkeypatch.setenv("ENGINE_X", "")
    assert config.env_int("ENGINE_X", 7) == 7 and config.env_duration("ENGINE_X", 2.0) == 2.0
    for spaced, value in ((" 1K ", 1024), ("64 ", 64), ("  ", 7)):   # (as the words are read: '1K ' was refused)
        monkeypatch.setenv("ENGINE_X", spaced)
        assert config.env_int("ENGINE_X", 7) == value, spaced
    for bad in ("1Mk", "2kk"):   # (one suffix: the others were stripped too, and 1Mk read as 1024)
        monkeypatch.setenv("ENGINE_X", bad)
        with pytest.raises(ValueError, match=rf"ENGINE_X='{bad}' is not a number \(sizes"):
            config.env_int("ENGINE_X", 7)
    monkeypatch.setenv("ENGINE_X", "1e20")   # (past what the compiled fields hold: it failed later, unnamed)
    with pytest.raises(ValueError, match=r"ENGINE_X='1e20': expected at most 4611686018427387904"):
        config.env_int("ENGINE_X", 7)
    monkeypatch.setenv("ENGINE_MPI_CHUNK_ELEMENTS", "3G")   # (MPI's int counts: the core's own error named no variable)
    with pytest.raises(ValueError, match=r"ENGINE_MPI_CHUNK_ELEMENTS='3G': expected at most 2147483647"):
        registry.MPI_CHUNK.value()
    for bad in ("inf", "nan", "1e400"):   # (inf reached int() as a bare OverflowError)
        monkeypatch.setenv("ENGINE_X", bad)
        with pytest.raises(ValueError, match=r"ENGINE_X=.* is not a number \(sizes"):
            config.env_int("ENGINE_X", 7)
    for ok, seconds in (("0", 0.0), ("2.5", 2.5), ("inf", float("inf"))):
        monkeypatch.setenv("ENGINE_X", ok)
        assert config.env_duration("ENGINE_X", 1.0) == seconds
    # a negative or NaN timeout would be a wait that never ends (NaN >= timeout is never true)
    for bad in ("-1", "nan", "ten", "5s"):
        monkeypatch.setenv("ENGINE_X", bad)
        with pytest.raises(ValueError, match=r"ENGINE_X=.* is not a number of seconds >= 0"):
            config.env_duration("ENGINE_X", 1.0)
    monkeypatch.setenv("ENGINE_X", "inf")
    with pytest.raises(ValueError, match=r"ENGINE_X='inf': expected at most 60 seconds"):
        config.env_duration("ENGINE_X", 1.0, maximum=60.0)
    # a count with a fraction (ENGINE_THREADS=2.9 ran 2 threads); a size's fraction of its unit is whole
    monkeypatch.setenv("ENGINE_X", "2.9")
    with pytest.raises(ValueError, match=r"ENGINE_X='2.9': expected a whole number"):
        config.env_int("ENGINE_X", 7)
    monkeypatch.setenv("ENGINE_X", "0.5K")
    assert config.env_int("ENGINE_X", 7) == 512
    # an on/off setting: ENGINE_DEBUG=false (or off, no) turned debug on
    for raw, on in (("false", False), ("Off", False), ("0", False), ("", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("ENGINE_X", raw)
        assert config.env_flag("ENGINE_X") is on, raw
    monkeypatch.setenv("ENGINE_X", "maybe")
    with pytest.raises(ValueError, match=r"ENGINE_X='maybe': expected 1 or 0"):
        config.env_flag("ENGINE_X")
    # the CUDA-only allreduce variable names NCCL's entries: shm:ring forced the CPU groups' ring
    monkeypatch.setenv("ENGINE_CUDA_ALLREDUCE_ALGO", "shm:ring")
    with pytest.raises(ValueError, match=r"ENGINE_CUDA_ALLREDUCE_ALGO='shm:ring': expected names of NCCL's"):
        registry.forced_items("allreduce")
    for named in ("ring", "nccl:ring"):   # (with or without NCCL's prefix, as docs/tuning.md writes it)
        monkeypatch.setenv("ENGINE_CUDA_ALLREDUCE_ALGO", named)
        assert registry.forced_items("allreduce") == [("nccl", "ring")]


def test_a_timeout_of_inf_waits_for_a_key_that_comes_late():
    """ENGINE_TIMEOUT=inf (no limit) reached the store's wait as timedelta(seconds=inf): its
    OverflowError read as the wait's timeout, and a group whose peers wrote their keys a moment late
    failed ('rank 1 never joined the group's bootstrap: cannot convert float infinity to integer')."""
    import threading
    import time

    import torch.distributed as dist

    from engine.bootstrap import keys_set_within, read_keys
    store = dist.HashStore()
    late = threading.Thread(target=lambda: (time.sleep(0.2), store.set("key", "v")))
    late.start()
    try:
        assert read_keys(store, ["key"], float("inf"), "a test") == ([b"v"], [], None)
    finally:
        late.join()
    for stop in (None, lambda: None):   # (one wait in the store; looks in it, a stop() asked between)
        late = threading.Thread(target=lambda: (time.sleep(0.2), store.set("arrived", "1")))
        late.start()
        try:
            assert keys_set_within(store, ["arrived"], float("inf"), stop)
        finally:
            late.join()
        store.delete_key("arrived")


@pytest.mark.parametrize("name, value", [("ENGINE_TIMEOUT", "nan"), ("ENGINE_STALL_WARNING_SECONDS", "-1"),
                                         ("ENGINE_SPIN_US", "fast"), ("ENGINE_SHM_SLOT_BYTES", "-1M"),
                                         ("ENGINE_TRACE", "/proc/no/such/folder/t.json"),
                                         ("ENGINE_DEBUG", "maybe"), ("ENGINE_CUDA_TRANSPORT", "stagd"),
                                         ("ENGINE_THREADS", "2.9"), ("ENGINE_TIMEOUT", "0"),
                                         ("ENGINE_FLIGHT_RECORDER_SIZE", "1e12"), ("ENGINE_TRANSPORT", "shmm"),
                                         ("ENGINE_HIER", "offf"), ("ENGINE_TCP_CONNECT", "eager"),
                                         ("ENGINE_INTERHOST", "ib"), ("ENGINE_SHM_PULL_PIECE_BYTES", "0")])
def test_a_group_refuses_a_setting_it_cant_use_by_name(monkeypatch, name, value):
    """At the group's creation, not later (an unwritable trace was found at exit, its timeline lost; a
    misspelt ENGINE_CUDA_TRANSPORT passed in a CPU-only job, read at the first CUDA call; a misspelt
    ENGINE_TRANSPORT passed in a group of one; ENGINE_TIMEOUT=0 timed every call out; a recorder of
    10**12 records failed in a bare MemoryError; a pull piece of 0 bytes was taken as one element)."""
    from engine.watch import _Trace
    monkeypatch.setattr(_Trace, "_instance", None)   # (the process's trace is made once)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        engine.Communicator.from_store(None, 0, 1)


@pytest.mark.parametrize("name, value, told", [("ENGINE_SOCKETS", "-1", "expected a number of sockets"),
                                               ("ENGINE_SHM_QUEUE_BYTES", "100", "is too small \\(at least 4096\\)")])
def test_a_group_refuses_a_size_it_cant_use_by_name(monkeypatch, name, value, told):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}={value}:? {told}"):
        engine.Communicator.from_store(None, 0, 1)


def test_a_single_rank_world_refuses_a_misspelt_transport(monkeypatch):
    monkeypatch.setenv("ENGINE_TRANSPORT", "tpc")
    with pytest.raises(ValueError, match="ENGINE_TRANSPORT='tpc': expected one of auto, shm, mpi, tcp"):
        engine.Communicator.single()


def test_a_store_group_and_the_world_name_what_they_cant_use(monkeypatch):
    """from_store names a misspelt transport as such (it was told 'tpc' needs an MPI launch); world()
    started alone names a WORLD_SIZE that is no number (a bare int() error), runs alone where it is
    empty, and wants a launcher where it is over 1."""
    with pytest.raises(ValueError, match=r"from_store: unknown transport 'tpc': expected one of auto, shm, tcp"):
        engine.Communicator.from_store(None, 0, 1, transport="tpc")
    with pytest.raises(ValueError, match=r"transport 'mpi' needs an MPI launch"):
        engine.Communicator.from_store(None, 0, 1, transport="mpi")
    from engine import launcher
    monkeypatch.setattr(launcher, "detect_launcher", lambda *args: None)
    monkeypatch.setattr(engine, "_world", None)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is not a number of ranks"):
        engine.world()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"engine.world\(\) needs an MPI launch"):
        engine.world()
    monkeypatch.setenv("WORLD_SIZE", "")
    alone = engine.world()
    try:
        assert alone.size == 1
    finally:
        alone.free()


@pytest.mark.parametrize("value", ["-1", "100000"])
def test_a_group_refuses_a_thread_count_out_of_range(monkeypatch, value):
    """(100000 started as many spinning helpers at the first large call, and it did not end)"""
    monkeypatch.setenv("ENGINE_THREADS", value)
    with pytest.raises(ValueError, match=f"ENGINE_THREADS={value}: expected a number of threads from 1 to"):
        engine.Communicator.from_store(None, 0, 1)


def test_the_abort_grace_is_checked_before_mpi_starts_not_at_exit(monkeypatch):
    """At exit the error would skip the abort, and the job would wait for this rank in MPI_Finalize
    (time.sleep(inf) raises too); tests/test_faults.py sees a valid grace used."""
    for bad in ("-2", "inf"):
        monkeypatch.setenv("ENGINE_ABORT_GRACE_SECONDS", bad)
        with pytest.raises(ValueError, match=f"ENGINE_ABORT_GRACE_SECONDS='{bad}'"):
            failure.configure()   # (engine.mpi.load calls it before it imports mpi4py.MPI)
    monkeypatch.setenv("ENGINE_ABORT_GRACE_SECONDS", "0.5")
    failure.configure()
    assert failure._grace == [0.5]
    monkeypatch.delenv("ENGINE_ABORT_GRACE_SECONDS")
    failure.configure()


def test_the_spin_budget_is_what_engine_spin_us_says(monkeypatch):
    """Above the default as well as below (it was once only a cap), and a polite thread (a progress
    thread overlapping compute) spins no longer than its own short budget whatever the group's."""
    import threading
    from engine import _core
    for raw, seconds in (("2000", 2e-3), ("7", 7e-6), ("0", 0.0), (None, 250e-6)):
        if raw is None:
            monkeypatch.delenv("ENGINE_SPIN_US")
        else:
            monkeypatch.setenv("ENGINE_SPIN_US", raw)
        core = engine.Communicator.from_store(None, 0, 1).core
        assert core.spin_budget == pytest.approx(seconds), raw
        polite = []

        def probe():
            _core.set_thread_polite(True)
            polite.append(core.spin_budget)
        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        assert polite[0] == pytest.approx(min(seconds, 5e-6)), raw
    monkeypatch.setenv("ENGINE_SPIN_US", "2e6")
    with pytest.raises(ValueError, match="ENGINE_SPIN_US='2e6': expected at most 1e"):
        engine.Communicator.from_store(None, 0, 1)


def test_the_flight_recorder_keeps_the_operations_it_is_told_to(monkeypatch):
    monkeypatch.setenv("ENGINE_FLIGHT_RECORDER_SIZE", "3")
    comm = engine.Communicator.from_store(None, 0, 1)
    x = np.ones(5, np.float32)
    for _ in range(7):
        comm.allreduce(x)
    out = io.StringIO()
    comm.watch.dump("asked", out=out)
    kept = re.findall(r"engine:   #(\d+) +allreduce", out.getvalue())
    assert kept == ["5", "6", "7"] and "last 3 operations" in out.getvalue(), out.getvalue()
    monkeypatch.setenv("ENGINE_FLIGHT_RECORDER_SIZE", "0")
    with pytest.raises(ValueError, match="ENGINE_FLIGHT_RECORDER_SIZE='0': expected at least 1"):
        engine.Communicator.from_store(None, 0, 1)


def test_bucket_and_direct_sizes_of_fused_allreduce(monkeypatch):
    monkeypatch.setenv("ENGINE_BUCKET_BYTES", "1K")
    monkeypatch.setenv("ENGINE_FUSION_DIRECT_BYTES", "256")
    comm = engine.Communicator.from_store(None, 0, 1)
    fused = FusedAllreduce(comm)
    assert (fused.bucket_bytes, fused.direct_bytes) == (1024, 256)
    tensors = [np.full(n, float(k), np.float32) for k, n in enumerate([60] * 6 + [64])]  # 240 B, then 256 B
    specs = [(t.size, "float32", 4, "cpu") for t in tensors]
    buckets = [b.indices for b in plan_buckets(specs, fused.bucket_bytes, direct_bytes=fused.direct_bytes)]
    assert buckets == [(0, 1, 2, 3), (4, 5), (6,)], buckets   # four fit in 1K; 256 bytes travel alone
    fused.run(tensors, engine.ReduceOp.SUM)
    for k, t in enumerate(tensors):
        assert np.all(t == k)
    monkeypatch.setenv("ENGINE_FUSION_DIRECT_BYTES", "0")   # every tensor alone: no packing
    assert FusedAllreduce(comm).direct_bytes == 0
    assert [b.indices for b in plan_buckets(specs, 1024, direct_bytes=0)] == [(k,) for k in range(7)]
    monkeypatch.setenv("ENGINE_BUCKET_BYTES", "-1")
    with pytest.raises(ValueError, match="ENGINE_BUCKET_BYTES='-1': expected at least 1"):
        FusedAllreduce(comm)
    # sizes given as arguments: checked alike, never taken for "not given" (0 read the environment)
    assert FusedAllreduce(comm, bucket_bytes=512, direct_bytes=0).sizes == (512, 0)
    assert FusedAllreduce(comm, bucket_bytes=np.int64(2048)).sizes == (2048, 0)
    with pytest.raises(ValueError, match="bucket_bytes=2048.0: expected a whole number"):   # (2048 is cached)
        FusedAllreduce(comm, bucket_bytes=2048.0)
    for given, told in (({"bucket_bytes": 0}, "bucket_bytes=0"), ({"bucket_bytes": -5}, "bucket_bytes=-5"),
                        ({"bucket_bytes": 1.5}, "bucket_bytes=1.5"), ({"direct_bytes": -1}, "direct_bytes=-1"),
                        ({"bucket_bytes": True}, "bucket_bytes=True")):
        with pytest.raises(ValueError, match=f"{told}: expected a whole number of bytes, at least"):
            FusedAllreduce(comm, **given)


def test_interhost_chooses_what_carries_a_group_between_hosts_under_mpi(monkeypatch):
    """ENGINE_INTERHOST: under an MPI launch, a group spanning hosts runs over MPI (the default) or the
    engine's TCP transport; without one, TCP whatever it says; on one host, shared memory; a value it
    can't use is refused by name. (tests/test_hosts.py runs both across namespace hosts, through the
    benchmark's engine-interhost-* backends.)"""
    from engine.bootstrap import choose_transport
    monkeypatch.delenv("ENGINE_TRANSPORT", raising=False)
    monkeypatch.delenv("ENGINE_INTERHOST", raising=False)
    assert choose_transport(None, ["a", "b"], mpi=True) == "mpi"
    for value, under_mpi in (("tcp", "tcp"), ("mpi", "mpi"), ("TCP", "tcp")):
        monkeypatch.setenv("ENGINE_INTERHOST", value)
        assert choose_transport(None, ["a", "b"], mpi=True) == under_mpi
        assert choose_transport(None, ["a", "b"], mpi=False) == "tcp"
        assert choose_transport(None, ["a", "a"], mpi=True) == "shm"
    monkeypatch.setenv("ENGINE_INTERHOST", "ib")
    with pytest.raises(ValueError, match=r"ENGINE_INTERHOST='ib': expected one of"):
        choose_transport(None, ["a", "b"], mpi=True)


def test_a_transport_the_group_cannot_use_is_refused_by_name(monkeypatch):
    """ENGINE_TRANSPORT=shm on a group spanning hosts names the hosts; =mpi on a group made without an
    MPI launch says so; both name the values that work. Asked for where it can run, each is used."""
    from engine.bootstrap import choose_transport
    monkeypatch.delenv("ENGINE_INTERHOST", raising=False)
    hosts = ["node-a/boot/ns", "node-b/boot/ns", "node-a/boot/ns"]
    with pytest.raises(ValueError, match=r"ENGINE_TRANSPORT=shm needs every rank of the group on one host, "
                                         r"but it spans node-a, node-b: use ENGINE_TRANSPORT=auto, tcp or mpi"):
        choose_transport("shm", hosts)
    for where in (hosts, hosts[:1]):
        with pytest.raises(ValueError, match=r"ENGINE_TRANSPORT=mpi needs an MPI launch \(mpirun\); this group "
                                             r"was made without one .* use ENGINE_TRANSPORT=auto"):
            choose_transport("mpi", where, mpi=False)
        assert choose_transport("mpi", where, mpi=True) == "mpi"
        assert choose_transport("tcp", where, mpi=False) == "tcp"
    assert choose_transport("shm", hosts[:1], mpi=False) == "shm"
    monkeypatch.setenv("ENGINE_TRANSPORT", "shm")   # the variable, where the group's call names none
    with pytest.raises(ValueError, match="ENGINE_TRANSPORT=shm needs every rank"):
        choose_transport(None, hosts)


def test_a_trace_file_is_named_per_rank_in_either_form(tmp_path, monkeypatch):
    """ENGINE_TRACE: `{rank}` in the name is replaced by the rank; else `.rank<r>` goes before the
    extension (`.json` where the name has none). The file is made when the group is (its folder can be
    written), and filled at exit."""
    from engine import forks
    from engine.watch import _Trace
    monkeypatch.setattr(forks, "at_exit", lambda fn, *args: None)   # (these write now, not at this process's exit)
    named = {given: _Trace(str(tmp_path / given), 3).path for given in ("t-{rank}.json", "t.json", "t")}
    assert named == {"t-{rank}.json": str(tmp_path / "t-3.json"), "t.json": str(tmp_path / "t.rank3.json"),
                     "t": str(tmp_path / "t.rank3.json")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t-3.json", "t.rank3.json"]
    trace = _Trace(str(tmp_path / "w-{rank}.json"), 1)
    trace.write()
    assert json.loads((tmp_path / "w-1.json").read_text())["traceEvents"][0]["args"] == {"name": "rank 1"}
    assert (tmp_path / "w-1.json").stat().st_mode & 0o777 == 0o600   # (a timeline of the job: its user's)
    (tmp_path / "m.rank2.json").write_text("old")   # (one made before, readable by all: its mode was kept)
    os.chmod(tmp_path / "m.rank2.json", 0o644)
    _Trace(str(tmp_path / "m.json"), 2)
    assert (tmp_path / "m.rank2.json").stat().st_mode & 0o777 == 0o600
    os.mkfifo(tmp_path / "f.rank2.json")   # (a FIFO with no reader blocked the open for ever)
    with pytest.raises(ValueError, match=r"f\.rank2\.json' \(.*not a plain file"):
        _Trace(str(tmp_path / "f.json"), 2)
    # A link in its place (a shared folder: another user's) is not followed; its target stays as it was.
    (tmp_path / "target").write_text("theirs")
    (tmp_path / "l.rank2.json").symlink_to(tmp_path / "target")
    monkeypatch.setenv("ENGINE_TRACE", str(tmp_path / "l.json"))
    with pytest.raises(ValueError, match=r"can't write this rank's trace .*l\.rank2\.json' \(a symbolic link"):
        _Trace(str(tmp_path / "l.json"), 2)
    assert (tmp_path / "target").read_text() == "theirs"
    if os.geteuid() == 0:   # (a file another user made there: not written into)
        (tmp_path / "o.rank2.json").write_text("theirs")
        os.chown(tmp_path / "o.rank2.json", 65534, 65534)
        with pytest.raises(ValueError, match=r"o\.rank2\.json' \(.*another user owns this file"):
            _Trace(str(tmp_path / "o.json"), 2)
        assert (tmp_path / "o.rank2.json").read_text() == "theirs"
