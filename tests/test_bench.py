"""The benchmark suite itself: nccl-tests' busbw formulas, size parsing, the JSON schema, the plot,
and a tiny end-to-end run under mpiexec."""

import json
import os
import re
import subprocess
import sys

import pytest

from bench.busbw import bandwidths, busbw_factor, bytes_moved, parse_size, per_rank_count, size_sweep
from bench.report import ROW_KEYS, read_json, torch_layer_table, validate
from mpirun import mpi_env, mpiexec_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("coll,n,factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 1, 0.0), ("all_gather", 4, 0.75),
    ("reduce_scatter", 3, 2 / 3), ("alltoall", 2, 0.5), ("broadcast", 8, 1.0), ("reduce", 8, 1.0),
    ("sendrecv", 2, 1.0)])
def test_busbw_factors_are_nccl_tests(coll, n, factor):
    assert busbw_factor(coll, n) == pytest.approx(factor)


def test_bandwidths_and_bytes():
    assert bandwidths("all_reduce", 1e9, 1.0, 4) == pytest.approx((1.0, 1.5))
    assert bandwidths("barrier", 0, 1e-5, 2) == (0.0, 0.0)
    # all_gather: -b/-e name the whole array; each rank sends 1/n of it
    assert per_rank_count("all_gather", 4096, 4, 4) == 256
    assert bytes_moved("all_gather", 256, 4, 4) == 4096
    assert per_rank_count("reduce_scatter", 4100, 4, 3) == 1023  # divisible in 3 blocks
    assert per_rank_count("all_reduce", 6, 4, 2) == 1


@pytest.mark.parametrize("text,value", [("8", 8), ("1K", 1024), ("1k", 1024), ("64M", 64 << 20), ("1G", 1 << 30),
                                        ("1.5K", 1536), ("0", 0)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "12Q", "-4K", "K"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="bad size"):
        parse_size(bad)


def test_size_sweep():
    assert size_sweep(8, 64 << 20, 4)[:3] == [8, 32, 128]
    assert size_sweep(8, 64 << 20, 4)[-1] == 32 << 20
    assert size_sweep(1, 3, 1.5) == [1, 2, 3]
    with pytest.raises(ValueError):
        size_sweep(8, 4, 2)


def test_json_schema_validation():
    row = {k: 0 for k in ROW_KEYS}
    validate({"schema": 1, "meta": {}, "rows": [row]})
    with pytest.raises(ValueError, match="lacks busbw"):
        validate({"schema": 1, "meta": {}, "rows": [{k: 0 for k in ROW_KEYS if k != "busbw"}]})
    with pytest.raises(ValueError, match="not an engine bench JSON"):
        validate({"rows": []})


def _row(backend, collective, time_us, mode="in-place", size=1024):
    return dict({k: 0 for k in ROW_KEYS}, backend=backend, collective=collective, time_us=time_us, mode=mode,
                size=size)


def test_torch_layer_table_splits_a_call():
    rows = [_row("engine", "all_reduce", 9.0), _row("nop", "all_reduce", 4.0), _row("engine-direct", "all_reduce", 2.5),
            _row("engine", "pingpong", 15.0, "out-of-place"), _row("nop", "pingpong", 8.0, "out-of-place"),
            _row("engine-direct", "pingpong", 3.0, "out-of-place"), _row("engine", "barrier", 4.0, "out-of-place", 0)]
    lines = torch_layer_table(rows).splitlines()
    assert lines[0].count("|") == 8 and "nop+direct" not in lines[0]
    assert lines[2] == "| all_reduce | 1 KB | in-place | 4.00 | 9.00 | 2.50 | 2.50 |"
    assert lines[3].endswith("| 2.00 |")       # pingpong: (15 - 8 - 3) over its two calls
    assert len(lines) == 4                     # barrier: no nop or direct row to set it against
    # nop+direct, timed as one call, adds a column: the torch call minus it
    rows += [_row("nop+direct", "all_reduce", 8.5), _row("engine-group", "all_reduce", 8.75)]
    lines = torch_layer_table(rows).splitlines()
    assert lines[0].endswith("| nop+direct | (engine - (nop+direct)) per call |")
    assert lines[2].endswith("| 2.50 | 8.50 | 0.50 |") and lines[3].endswith("| 2.00 |  |  |")
    assert torch_layer_table(rows, "engine-group").splitlines()[2].endswith("| 2.25 | 8.50 | 0.25 |")
    # so does direct-group, after it, whichever order the rows come in
    rows.insert(0, _row("direct-group", "pingpong", 13.0, "out-of-place"))
    lines = torch_layer_table(rows).splitlines()
    assert lines[0].endswith("| nop+direct | (engine - (nop+direct)) per call | direct-group | "
                             "(engine - (direct-group)) per call |")
    assert lines[2].endswith("| 8.50 | 0.50 |  |  |") and lines[3].endswith("|  |  | 13.00 | 1.00 |")
    assert torch_layer_table([_row("gloo", "all_reduce", 1.0)]) == ""


def test_end_to_end_under_mpiexec_and_plot(tmp_path):
    out = tmp_path / "out.json"
    cmd = mpiexec_command(2) + [sys.executable, "-m", "bench", "all", "-b", "1K", "-e", "16K", "-f", "16",
                                "--backends", "engine,engine-direct,gloo,mpi4py,engine-group,nop,nop+direct,direct-group",
                                "-c", "1", "-n", "20", "-w", "2",
                                "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert "FAILED" not in proc.stdout
    assert "# Avg bus bandwidth" in proc.stdout and "engine/gloo" in proc.stdout
    doc = read_json(out)
    meta = doc["meta"]
    assert meta["world_size"] == 2 and meta["cores"] >= 1
    assert meta["cpu_model"] and isinstance(meta["cpu_flags"], list)   # the thresholds differ per CPU
    assert any(name in meta["mpi_library"] for name in ("Open MPI", "MPICH", "Intel"))
    collectives = {r["collective"] for r in doc["rows"]}
    assert collectives == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall",
                           "sendrecv", "pingpong", "barrier"}
    assert all(r["wrong"] == (-1 if r["backend"] == "nop" else 0) for r in doc["rows"])  # nop moves nothing
    assert {r["backend"] for r in doc["rows"]} == {"engine", "engine-direct", "gloo", "mpi4py", "engine-group", "nop",
                                                 "nop+direct", "direct-group"}
    # direct-group: every collective the engine-group has, but sendrecv (its sends block)
    grouped = {(r["collective"], r["size"], r["mode"]) for r in doc["rows"] if r["backend"] == "engine-group"}
    direct = {(r["collective"], r["size"], r["mode"]) for r in doc["rows"] if r["backend"] == "direct-group"}
    assert direct == {key for key in grouped if key[0] != "sendrecv"}
    assert ("# the torch layer's cost (us): engine-group - nop - engine-direct, and engine-group - (nop+direct), "
            "and engine-group - (direct-group)") in proc.stdout
    png = tmp_path / "out.png"
    plot = subprocess.run([sys.executable, "-m", "bench", "plot", str(out), "-o", str(png)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert png.stat().st_size > 10000
    json.loads(out.read_text())  # plain JSON for other tools


def test_two_shot_floor_builds_runs_and_checks_its_result():
    """python -m bench floor: its C program compiled here, an odd count and a step that doesn't divide
    the size, the one checked allreduce right."""
    out = subprocess.run([sys.executable, "-m", "bench", "floor", "-b", "1004", "-e", "64K", "-f", "64",
                          "--step", "24K", "--rounds", "3", "--budget", "0.01"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [1004, 64256] and all(r[3] == "OK" and float(r[1]) > 0 for r in rows)


def test_init_times_each_backends_world_making_with_its_result_checked():
    """python -m bench init: 3 spawned ranks make a world over tcp:// on each backend in turn, each
    round's all_reduce checked; one row a backend."""
    out = subprocess.run([sys.executable, "-m", "bench", "init", "--ranks", "3", "--rounds", "2", "--late-ms", "5", "--backends",
                          "engine,gloo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if not line.startswith("#")]
    assert [r[0] for r in rows] == ["engine", "gloo"], out.stdout
    assert all(0 < float(r[2]) <= float(r[1]) <= float(r[3]) for r in rows), out.stdout
    assert "# Out of bounds values : 0" in out.stdout


def test_init_times_a_reconfigure_where_torch_has_one():
    """python -m bench init --reconfigure: on a torch with dist._reconfigure (2.14 and later) 2 ranks
    reconfigure each backend's world onto the same members, the round's all_reduce checked; on an
    older torch it refuses, naming the need."""
    import torch.distributed as dist
    out = subprocess.run([sys.executable, "-m", "bench", "init", "--ranks", "2", "--rounds", "1", "--reconfigure"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    if hasattr(dist, "_reconfigure"):
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert out.stdout.startswith("# dist._reconfigure onto the same members, 2 ranks"), out.stdout
        rows = [line.split() for line in out.stdout.splitlines() if not line.startswith("#")]
        assert [r[0] for r in rows] == ["engine", "gloo"], out.stdout
        assert all(0 < float(r[2]) <= float(r[1]) <= float(r[3]) for r in rows), out.stdout
        assert "# Out of bounds values : 0" in out.stdout
    else:
        assert out.returncode == 2 and "--reconfigure needs torch 2.14 or later" in out.stderr, out.stderr


def test_init_names_a_rank_that_exits():
    """A rank that exits (here: a backend torch doesn't know) ends python -m bench init at once, naming
    it, where the others' results were awaited for minutes."""
    out = subprocess.run([sys.executable, "-m", "bench", "init", "--ranks", "2", "--rounds", "1", "--backends",
                          "engine,nosuch"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and re.search(r"python -m bench init: rank [01] exited with 1 before its results were "
                                             r"in \(its error is above\)", out.stderr), out.stderr[-3000:]
