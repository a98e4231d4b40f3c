"""The floor of a 2-rank shared-memory allreduce on this machine: bench/two_shot_floor.c, the engine's
two-shot step protocol run by two threads of one process on two cores, with no processes, syscalls,
Python or checks in the way (float32 SUM, in place, the engine's step size). Built with the C compiler
at each run; one process, so run it between mpirun launches to compare with them:

    python -m bench floor                         # 256 KB .. 4 MB
    python -m bench floor -b 4M -e 4M --step 128K

A row: the size, the median over rounds of the slower thread's mean time per allreduce, and the
bandwidth (size / time, as the sweeps' algbw).
"""

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import engine.kernels

from .busbw import format_size, parse_size, size_sweep

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_shot_floor.c")


def build(directory):
    """The floor's executable, compiled for this CPU into directory."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("python -m bench floor needs a C compiler (cc or gcc on PATH, or CC)")
    exe = os.path.join(directory, "two_shot_floor")
    subprocess.run([cc, "-O3", "-march=native", "-pthread", "-o", exe, SOURCE], check=True)
    return exe


def measure(exe, nbytes, step, iters, rounds):
    """(median microseconds, whether the checked allreduce was right) of one size."""
    out = subprocess.run([exe, str(nbytes), str(step), str(iters), str(rounds)], capture_output=True, text=True)
    fields = out.stdout.split()
    if len(fields) != 3:
        raise RuntimeError(f"{exe} {nbytes}: exit {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return float(fields[1]), fields[2] == "OK"


def main(argv):
    from engine.registry import SHM_CHUNK
    p = argparse.ArgumentParser(prog="python -m bench floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("256K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("4M"))
    p.add_argument("-f", "--stepfactor", type=float, default=4.0)
    p.add_argument("--step", type=parse_size, default=SHM_CHUNK.value(),
                   help="bytes per step (default: the engine's, ENGINE_SHM_CHUNK_BYTES)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per size (the median is reported)")
    p.add_argument("--budget", type=float, default=0.3, help="seconds a round may take (sets the iterations)")
    args = p.parse_args(argv)
    if not 1 <= args.rounds <= 64:
        p.error("--rounds must be 1 to 64")
    if args.step < 8:
        p.error("--step must be at least 8 bytes")
    if len(os.sched_getaffinity(0)) < 2:   # its threads spin: on one core each waits out the other's slices
        sys.exit("python -m bench floor needs two cores (its two threads stand for two ranks on their own cores)")
    cpu = engine.kernels.cpu()["model"] or platform.machine()
    print(f"# two-shot floor: 2 threads of one process, float32 SUM in place, step {format_size(args.step)}, "
          f"{os.cpu_count()} cores of {cpu}; median of {args.rounds} rounds")
    print(f"# {'size':>10} {'us':>10} {'GB/s':>7} {'check':>6}")
    wrong = False
    with tempfile.TemporaryDirectory(prefix="engine-floor-") as tmp:
        exe = build(tmp)
        for nbytes in size_sweep(args.minbytes, args.maxbytes, args.stepfactor):
            nbytes = max(8, nbytes // 4 * 4)
            probe, _ = measure(exe, nbytes, args.step, 3, 1)
            iters = max(1, min(10000, int(args.budget / max(probe * 1e-6, 1e-7))))
            us, ok = measure(exe, nbytes, args.step, iters, args.rounds)
            wrong |= not ok
            print(f"  {nbytes:>10} {us:>10.2f} {nbytes / us / 1e3:>7.2f} {'OK' if ok else 'WRONG':>6}", flush=True)
    if wrong:
        sys.exit(1)
