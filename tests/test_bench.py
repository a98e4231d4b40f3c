"""The benchmark suite itself: nccl-tests' busbw formulas, size parsing, the JSON schema, the plot,
and a tiny end-to-end run under mpiexec."""

import json
import os
import re
import subprocess
import sys

import pytest

from bench.busbw import bandwidths, busbw_factor, bytes_moved, parse_size, per_rank_count, size_sweep
from bench.report import (ROW_KEYS, backend_table, cpu_of, markdown_table, print_report, read_json, torch_layer_table,
                          validate)
from mpirun import mpi_env, mpiexec_command, run_launcher

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
    assert lines[2] == "| all_reduce | 1 KiB | in-place | 4.00 | 9.00 | 2.50 | 2.50 |"
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


def _fake_world(monkeypatch, others, mine):
    """bench.run's agreements as if among this rank (every timed() taking `mine` seconds a call) and
    ranks whose answers are `others`."""
    from bench import run
    monkeypatch.setattr(run, "agreed", lambda value, op="sum": max([value] + others) if op == "max"
                        else value + sum(others))
    monkeypatch.setattr(run, "timed", mine if callable(mine) else lambda fn, n, sync=None: mine)
    monkeypatch.setattr(run, "control", lambda: None)
    monkeypatch.setattr(run.dist, "barrier", lambda: None)
    monkeypatch.setattr(run.dist, "get_world_size", lambda: 1 + len(others))
    return run


def test_a_measurement_is_the_slowest_ranks_and_an_idle_rank_has_no_say(monkeypatch):
    """As tune's and the other scripts': a collective is done when its last rank is. Before, each rank's
    time was averaged over ranks (here 2 ms), and pingpong's unpaired rank's ~0 pulled the mean down."""
    from bench.backends import Case
    run = _fake_world(monkeypatch, [0.003], 0.001)
    assert run.measure(Case(lambda: None, None, None, None), 10, 1, 1.0) == 0.003
    run = _fake_world(monkeypatch, [0.003], 0.005)   # (an idle rank's time is never the answer, even the largest)
    assert run.measure(Case(lambda: None, None, None, None, idle=True), 10, 1, 1.0) == 0.003


def test_a_call_refused_on_one_rank_is_refused_on_every_rank_with_its_reason(monkeypatch):
    def refuses(fn, n, sync=None):
        raise ValueError("reduce op AVG is not defined for int32\nmore")
    run = _fake_world(monkeypatch, [0.002], refuses)
    monkeypatch.setattr(run.dist, "all_gather_object",
                        lambda out, mine, group=None: out.__setitem__(slice(None), [None, mine]))   # rank 1 refused
    with pytest.raises(run.Refused, match=r"^ValueError: reduce op AVG is not defined for int32 \(rank 1\)$"):
        from bench.backends import Case
        run.measure(Case(lambda: None, None, None, None), 10, 1, 1.0)


def test_each_round_rotates_the_backends_order():
    from bench.run import rotated
    keys = ["engine", "gloo", "mpi4py"]
    assert [rotated(keys, r) for r in range(4)] == [keys, ["gloo", "mpi4py", "engine"], ["mpi4py", "engine", "gloo"],
                                                    keys]
    assert rotated([], 2) == []


def _main_error(capsys, argv):
    from bench.__main__ import parse_args
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_algo_where_no_backend_can_force_it_is_refused(capsys, monkeypatch):
    """--algo forced nothing where no backend of the run takes it (the default run: engine through torch
    on the CPU), and the table read as if it had."""
    from bench.__main__ import parse_args
    monkeypatch.setattr("engine.launcher.detect_launcher", lambda: None)
    err = _main_error(capsys, ["all_reduce", "--algo", "ring"])
    assert "--algo ring: none of --backends engine,gloo can force it" in err and "engine-direct, engine-shm" in err
    err = _main_error(capsys, ["all_reduce", "--algo", "ring", "--device", "cuda", "--backends", "nccl,gloo"])
    assert "on --device cuda only engine take" in err
    assert parse_args(["all_reduce", "--algo", "ring", "--backends", "engine,engine-direct"]).algo == "ring"


def _meta(**extra):
    return dict({"world_size": 2, "oversubscribed": False, "cpu_model": "AMD EPYC 7B13", "backends": ["engine", "gloo"],
                 "command": "python -m bench", "host": "vm", "cores": 2, "torch": "2.13", "mpi4py": None,
                 "mpi_library": None, "rounds": 3, "timing": "the slowest rank's mean per call"}, **extra)


def test_the_cpu_and_the_timing_are_named_beside_the_numbers():
    import io

    from bench.plot import title
    rows = [dict(_row(name, "pingpong", t, "out-of-place"), wrong=0) for name, t in (("engine", 15.0), ("gloo", 30.0))]
    out = io.StringIO()
    print_report(rows, _meta(), out)
    head = out.getvalue().splitlines()
    assert head[1] == "# 2 ranks on vm (2 cores), AMD EPYC 7B13"
    assert head[3].startswith("# times: the slowest rank's mean per call (pingpong: per round trip;")
    assert "1 GB = 1e9 bytes" in head[4]
    assert "round trip" in out.getvalue().split("# pingpong on engine")[1].splitlines()[2]   # its time's header
    table = markdown_table(rows, "pingpong", "engine", _meta()).splitlines()
    assert table[0] == ("AMD EPYC 7B13, 2 ranks; us per round trip (a send and a recv each way), the slowest rank's "
                        "mean per call; KiB, MiB: 1024, 1024^2 bytes.")
    assert table[4] == "| 1 KiB | out-of-place | 15.00 | 30.00 | 0.500 |"
    # a JSON from before the CPU and the timing were recorded says so, rather than naming this machine's
    old = {k: v for k, v in _meta().items() if k not in ("cpu_model", "timing")}
    assert markdown_table(rows, "pingpong", "engine", old).startswith(
        "CPU not recorded, 2 ranks; us per round trip (a send and a recv each way), each rank's mean per call averaged "
        "over ranks;")
    assert title(_meta(dtype="float"), {"AMD EPYC 7B13"}) == "2 ranks, float, vm (2 cores, AMD EPYC 7B13)"


def test_a_refused_case_is_told_apart_from_one_that_does_not_exist():
    """A backend that raised building or running a case showed N/A, as where the API has no such form
    (torch's out-of-place all_reduce): its reason is kept, a footnote of the tables, and a backend that
    refused everything still has its table."""
    refusal = {"backend": "gloo", "collective": "all_reduce", "mode": "in-place", "size": 1024, "count": 256,
               "type": "int32", "redop": "avg", "root": -1, "reason": "RuntimeError: can't cast (rank 0)"}
    rows = [dict(_row("engine", "all_reduce", 9.0), count=256, type="int32", redop="avg", root=-1)]
    meta = _meta(not_run=[refusal])
    lines = backend_table(rows, "gloo", "all_reduce", meta).splitlines()
    assert lines[-2].split() == ["1024", "256", "int32", "avg", "-1", "N/A", "N/A", "[1]"]
    assert lines[-1] == "# [1] gloo refused: RuntimeError: can't cast (rank 0)"
    assert backend_table(rows, "engine", "all_reduce", meta).splitlines()[4].split()[5] == "N/A"   # no such form
    table = markdown_table(rows, "all_reduce", "engine", meta).splitlines()
    assert table[4] == "| 1 KiB | in-place | 9.00 | N/A [1] | N/A |"
    assert "- [1] gloo refused: RuntimeError: can't cast (rank 0)" in table


def test_the_table_command_reads_its_arguments_as_the_others_do(capsys):
    """`bench table --help` prints its usage (its arguments were read by hand: '--help' was a file name,
    FileNotFoundError), and a collective no sweep has is refused by name."""
    from bench.__main__ import main
    with pytest.raises(SystemExit) as done:
        main(["table", "--help"])
    assert done.value.code == 0 and "COLLECTIVE" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["table", "out.json", "allreduce"])
    assert done.value.code == 2 and "no collective allreduce" in capsys.readouterr().err


def test_sizes_are_labelled_in_binary_units():
    from bench.kernels import _size
    assert (_size(1 << 10), _size(64 << 20), _size(1000)) == ("1 KiB", "64 MiB", "1000 B")


def test_end_to_end_under_mpiexec_and_plot(tmp_path):
    out = tmp_path / "out.json"
    cmd = mpiexec_command(2) + [sys.executable, "-m", "bench", "all", "-b", "1K", "-e", "16K", "-f", "16",
                                "--backends", "engine,engine-direct,gloo,mpi4py,engine-group,nop,nop+direct,direct-group",
                                "-c", "1", "-n", "20", "-w", "2",
                                "--rounds", "1", "--json", str(out)]
    proc = run_launcher(cmd, 240, env=mpi_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert "FAILED" not in proc.stdout
    assert "# Avg bus bandwidth" in proc.stdout and "engine/gloo" in proc.stdout
    doc = read_json(out)
    meta = doc["meta"]
    assert cpu_of(meta) in proc.stdout.splitlines()[1] and meta["timing"] == "the slowest rank's mean per call"
    assert meta["not_run"] == [] and all(r["algorithm"] is None for r in doc["rows"])   # no --algo: none forced
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
    table = subprocess.run([sys.executable, "-m", "bench", "table", str(out), "pingpong"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and cpu_of(meta) in table.stdout and "per round trip" in table.stdout, table.stderr


def _bench(nranks, *argv):
    return run_launcher(mpiexec_command(nranks) + [sys.executable, "-m", "bench", *argv], 240, env=mpi_env(), cwd=ROOT)


def test_refusals_at_run_time_are_recorded_and_the_sweep_goes_on(tmp_path):
    """int32 AVG, which the engine and Gloo refuse when called: each refusal a footnote with its reason
    and the sweep on to the other collectives, where the first ended the run. 3 ranks: pingpong's
    unpaired rank idles, its time no part of the round trip's."""
    out = tmp_path / "out.json"
    proc = _bench(3, "all", "-b", "1K", "-e", "1K", "-d", "int32", "-o", "avg", "--backends", "engine-direct,gloo",
                  "--rounds", "2", "-n", "5", "-w", "1", "--budget", "0.05", "-c", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# [1] engine-direct refused: ValueError: reduce op AVG is not defined for int32" in proc.stdout
    doc = read_json(out)
    refused = {(x["backend"], x["collective"], x["mode"]) for x in doc["meta"]["not_run"]}
    assert {("engine-direct", c, "out-of-place") for c in ("all_reduce", "reduce_scatter", "reduce")} <= refused
    assert ("gloo", "all_reduce", "in-place") in refused
    assert {r["collective"] for r in doc["rows"]} == {"all_gather", "broadcast", "alltoall", "sendrecv", "pingpong",
                                                     "barrier"}
    assert all(r["wrong"] == 0 for r in doc["rows"] if r["collective"] != "barrier")
    pingpong = [r for r in doc["rows"] if r["collective"] == "pingpong"]
    assert len(pingpong) == 2 and all(0 < r["time_us"] < 1e6 for r in pingpong)
    assert "round trip" in proc.stdout.split("# pingpong on engine-direct")[1].splitlines()[2]


def test_algo_is_recorded_per_row_and_refused_where_a_backend_cannot_run_it(tmp_path):
    out = tmp_path / "out.json"
    proc = _bench(2, "all_reduce", "-b", "1K", "-e", "1K", "--backends", "engine,engine-direct", "--algo", "ring",
                  "--rounds", "1", "-n", "5", "-w", "1", "-c", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    forced = {(r["backend"], r["algorithm"]) for r in read_json(out)["rows"]}
    assert forced == {("engine", None), ("engine-direct", "ring")}   # engine through torch on the CPU can't take it
    assert "no torch layer, 2 ranks, allreduce algorithm ring forced" in proc.stdout
    # native is MPI's own allreduce: shared memory has none, where the direct calls ran their own before
    proc = _bench(2, "all_reduce", "-b", "1K", "-e", "1K", "--backends", "engine-direct,gloo", "--algo", "native")
    assert proc.returncode != 0 and "--algo native: backend engine-direct's group (shm) has no allreduce entry " \
        "'native'" in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]


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
    out = run_launcher([sys.executable, "-m", "bench", "init", "--ranks", "3", "--rounds", "2", "--late-ms", "5",
                        "--backends", "engine,gloo"], 300, cwd=ROOT)
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
    out = run_launcher([sys.executable, "-m", "bench", "init", "--ranks", "2", "--rounds", "1", "--reconfigure"], 300,
                       cwd=ROOT)
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
    out = run_launcher([sys.executable, "-m", "bench", "init", "--ranks", "2", "--rounds", "1", "--backends",
                        "engine,nosuch"], 120, cwd=ROOT)
    assert out.returncode == 1 and re.search(r"python -m bench init: rank [01] exited with 1 before its results were "
                                             r"in \(its error is above\)", out.stderr), out.stderr[-3000:]
