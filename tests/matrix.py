"""The conformance matrix: every entry of the algorithm registry (engine/registry.py), forced in turn,
on every configuration the engine runs in (tests/mpi/test_matrix.py is what each rank runs):

    one host   mpiexec, 1-4 ranks: shared memory, ENGINE_TRANSPORT=mpi, ENGINE_TRANSPORT=tcp
               torchrun (no MPI), 1-4 ranks: shared memory, ENGINE_TRANSPORT=tcp
               mpiexec on shared memory: 2 ranks x 4 threads (ENGINE_THREADS), 4 ranks on two
               forced sockets (ENGINE_SOCKETS), 16 ranks
    hosts      namespace hosts (tests/hosts.py), 2x1 and 2x2, in every ENGINE_HIER mode (mpiexec); 2x2
               under a torchrun on each host (no MPI: the engine's TCP transport between them)

    python tests/matrix.py                       # every configuration; the table on stdout
    python tests/matrix.py --table docs/matrix.md
    python tests/matrix.py --only mpiexec-shm-2,hosts-2x2-leader --table docs/matrix.md --merge

Rows: the registry's entries, then the automatic choice of each collective; cells: `pass`, `-` (the
configuration can't run it: the transport differs, or it lacks what the entry needs), `FAIL`. In CI
the same file runs inside the per-configuration launches of test_mpi_suites.py, test_launchers.py
and test_hosts.py. Needs root for the namespace hosts (skipped, with the reason, otherwise).
"""

import argparse
import collections
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

RANK_FILE = os.path.join(HERE, "mpi", "test_matrix.py")
HIER_MODES = ("auto", "slice", "leader", "off")
SUITE_ENV = {"ENGINE_TIMEOUT": "20"}


def configurations():
    """(name, runner) of every configuration; runner(extra pytest args) -> (returncode, rank 0's output)."""
    import mpirun
    import torchrun
    out = []
    for n in (1, 2, 3, 4):
        for transport in ("shm", "mpi", "tcp"):
            out.append((f"mpiexec-{transport}-{n}", _launch(mpirun.run_pytest, n, ENGINE_TRANSPORT=transport)))
    for n in (1, 2, 3, 4):
        for transport in ("shm", "tcp"):
            out.append((f"torchrun-{transport}-{n}", _launch(torchrun.run_pytest, n, ENGINE_TRANSPORT=transport)))
    out.append(("mpiexec-shm-2-threads4", _launch(mpirun.run_pytest, 2, ENGINE_TRANSPORT="shm", ENGINE_THREADS="4")))
    out.append(("mpiexec-shm-4-sockets2", _launch(mpirun.run_pytest, 4, ENGINE_TRANSPORT="shm", ENGINE_SOCKETS="2")))
    out.append(("mpiexec-shm-16", _launch(mpirun.run_pytest, 16, ENGINE_TRANSPORT="shm", ENGINE_TIMEOUT="60")))
    for per_host in (1, 2):
        for mode in HIER_MODES:
            out.append((f"hosts-2x{per_host}-{mode}", _hosts(per_host, mode)))
    out.append(("hosts-2x2-torchrun", _hosts(2, "auto", torchrun=True)))
    return out


def _launch(run_pytest, n, **env):
    def run(extra):
        proc = run_pytest(n, [RANK_FILE], timeout=900, extra=extra, env={**SUITE_ENV, **env})
        return proc.returncode, proc.stdout + proc.stderr
    return run


def _hosts(per_host, mode, torchrun=False):
    def run(extra):
        from hosts import Hosts, mpirun_across, torchrun_across
        why = Hosts.unavailable()
        if why:
            return None, why
        pytest = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "--color=no", *extra,
                  RANK_FILE]
        with Hosts(2) as hosts:
            if torchrun:   # (rank 0's output: the first host's torchrun, its lines marked [default0]:)
                results = torchrun_across(hosts, per_host, pytest, timeout=900, ENGINE_HIER=mode, **SUITE_ENV)
                # (a torchrun killed past the timeout has None; one a signal ended, a negative code)
                return (0 if all(rc == 0 for rc, _ in results) else 1), results[0][1]
            proc = mpirun_across(hosts, per_host, [sys.executable, *pytest], timeout=900, ENGINE_MPI_SUITE="1",
                                 ENGINE_HIER=mode, **SUITE_ENV)
        return proc.returncode, proc.stdout + proc.stderr
    return run


_RESULT = re.compile(r"^(?:\[1,0\]<stdout>:\s*|\[default0\]:)?(PASSED|SKIPPED|FAILED|ERROR)\s+(?:\[\d+\]\s+)?"
                     r"\S*test_matrix\.py(?::\d+)?(?:::(\w+)\[([^\]]+)\])?")


def outcomes(output):
    """{row id: outcome} from rank 0's `pytest -rA` summary (SKIPPED lines of -rA name no test id:
    rows without a PASSED or FAILED line are the skipped ones)."""
    got = {}
    for line in output.splitlines():
        m = _RESULT.match(line.strip())
        if m and m.group(3):
            got[m.group(3)] = m.group(1)
    return got


def rows():
    from engine import registry
    auto = sorted(c for c in registry.COLLECTIVES if c != "sendrecv")
    return [e.key for e in registry.ENTRIES] + auto


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", help="write the Markdown table here (else stdout)")
    p.add_argument("--only", help="comma-separated configuration names")
    p.add_argument("--merge", action="store_true", help="keep the other configurations' columns of --table's file")
    args = p.parse_args(argv)
    configs = [(n, r) for n, r in configurations() if not args.only or n in args.only.split(",")]
    results, times, failed = {}, {}, []
    for i, (name, run) in enumerate(configs):
        start = time.monotonic()
        rc, out = run(["-rA"])
        times[name] = time.monotonic() - start
        if rc is None:
            results[name] = None
            print(f"[{i + 1}/{len(configs)}] {name}: skipped ({out})", flush=True)
            continue
        results[name] = outcomes(out)
        if rc != 0:
            failed.append(name)
            print(out[-6000:], file=sys.stderr)
        counts = collections.Counter(results[name].values())
        print(f"[{i + 1}/{len(configs)}] {name}: exit {rc}, {dict(counts)} in {times[name]:.0f} s", flush=True)
    if args.merge and args.table and os.path.exists(args.table):
        configs, results, times = merged(args.table, configs, results, times)
    table = render(configs, results, times)
    if args.table:
        with open(args.table, "w") as f:
            f.write(table)
    else:
        print(table)
    return 1 if failed else 0


def merged(path, configs, results, times):
    """The configurations of the table at path with those just run put in (replaced or appended): the
    old columns' cells as they were, rows the old table lacked `-` there (a new entry: its skips)."""
    with open(path) as f:
        lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in f if line.startswith("|")]
    names = lines[0][1:]
    cells = {line[0]: line[1:] for line in lines[2:]}
    back = {"pass": "PASSED", "FAIL": "FAILED"}
    old = {}
    for i, n in enumerate(names):
        got = {}
        for label, row in cells.items():
            if label != "seconds" and row[i] in back:
                got[label.replace(" (automatic choice)", "")] = back[row[i]]
        old[n] = (got, float(cells["seconds"][i]) if "seconds" in cells else 0.0)
    ran = dict(configs)
    out_configs = [(n, ran.get(n)) for n in names] + [(n, r) for n, r in configs if n not in names]
    for n in names:
        if n not in ran:
            results[n], times[n] = old[n]
    return out_configs, results, times


def render(configs, results, times):
    names = [n for n, _ in configs]
    lines = ["| entry | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for row in rows():
        label = row if ":" in row else f"{row} (automatic choice)"
        cells = []
        for n in names:
            r = results.get(n)
            cells.append("n/a" if r is None else {"PASSED": "pass", "FAILED": "FAIL", "ERROR": "FAIL"}.get(
                r.get(row if ":" in row else f"{row}"), "-"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| seconds | " + " | ".join(f"{times[n]:.0f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
