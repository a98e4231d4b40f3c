"""Microbenchmarks in nccl-tests' and OSU's conventions. Installed with the engine as engine.bench
(`python -m engine.bench`, or the `engine-bench` command); `python -m bench` in the checkout.

    mpirun -n 2 python -m engine.bench all_reduce -b 1K -e 64M -f 4 --backends engine,gloo,mpi4py -c 1 --json out.json
    torchrun --nproc-per-node 2 -m engine.bench all -b 1K -e 64M -f 4
    python -m engine.bench plot out.json -o out.png
    mpirun -n 2 python -m engine.bench tune -o tuning.json    # a tuning file for ENGINE_TUNING_FILE
    python -m engine.bench table out.json                     # Markdown tables of a run
    python -m engine.bench kernels                            # the kernels' GB/s against memcpy, per ISA
    python -m engine.bench floor                              # a bare 2-thread two-shot: this machine's floor
    python -m engine.bench init                               # how long init_process_group takes, engine vs Gloo
"""

import argparse
import sys

from .backends import ALGO_BACKENDS, BACKENDS, CUDA_BACKENDS, DTYPES, OPS
from .busbw import COLLECTIVES, parse_size


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collective", choices=COLLECTIVES + ("all",))
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest size (K/M/G)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), help="largest size (K/M/G)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplier between rows")
    p.add_argument("-n", "--iters", type=int, default=None, help="iterations (default: OSU's 1000 up to 8 KB, 100 above)")
    p.add_argument("-w", "--warmup", type=int, default=None, help="warm-up iterations (default: 100 / 10)")
    p.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float")
    p.add_argument("-o", "--op", choices=OPS, default="sum")
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("-c", "--check", type=int, default=0, help="1: verify results at every size, count wrong elements")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated, from {', '.join(BACKENDS)}; the first is compared with the others "
                        f"(default: engine,gloo,mpi4py under mpirun, engine,gloo under torchrun; engine,nccl on "
                        f"cuda)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the tensors live: cuda compares the engine (NCCL) with torch's nccl backend")
    from engine import registry
    cpu_algos = {e.name for t in ("shm", "mpi", "tcp") for e in registry.entries("allreduce", t)}
    cuda_algos = {e.name for e in registry.entries("allreduce", "nccl")}
    p.add_argument("--algo", default=None, choices=sorted(cpu_algos | cuda_algos),
                   help="force the engine's allreduce entry (engine/registry.py, docs/algorithms.md): on the CPU for "
                        f"{', '.join(ALGO_BACKENDS['cpu'])} (refused where their transport lacks it), on CUDA "
                        "for engine; at least one of --backends must take it")
    p.add_argument("--json", default=None, help="write every row and the run's metadata here")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size (the median is reported)")
    p.add_argument("--budget", type=float, default=0.3,
                   help="seconds one measurement may take: fewer iterations for slow backends")
    args = p.parse_args(argv)
    from engine.launcher import detect_launcher
    default = "engine,nccl" if args.device == "cuda" else \
        ("engine,gloo,mpi4py" if detect_launcher() else "engine,gloo")  # mpi4py needs an MPI launch
    args.backends = [b.strip() for b in (args.backends or default).split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {', '.join(bad)}; choose from {', '.join(BACKENDS)}")
    allowed = CUDA_BACKENDS if args.device == "cuda" else tuple(b for b in BACKENDS if b != "nccl")
    wrong = [b for b in args.backends if b not in allowed]
    if wrong:
        p.error(f"backend(s) {', '.join(wrong)} do not run with --device {args.device}; choose from {', '.join(allowed)}")
    if args.algo and args.algo not in (cuda_algos if args.device == "cuda" else cpu_algos):
        p.error(f"--algo {args.algo} is not an algorithm of --device {args.device}")
    takers = ALGO_BACKENDS[args.device]
    if args.algo and not set(args.backends) & set(takers):
        # else it would be measured as if forced and force nothing
        p.error(f"--algo {args.algo}: none of --backends {','.join(args.backends)} can force it; on --device "
                f"{args.device} only {', '.join(takers)} take an allreduce algorithm")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def parse_plot_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench plot")
    p.add_argument("files", nargs="+")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--collective", default=None, choices=COLLECTIVES)
    return p.parse_args(argv)


def parse_table_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench table", description="Markdown tables of a run, as in "
                                "BENCHMARKS.md: one per collective, the first backend as the baseline")
    p.add_argument("file", help="a sweep's --json output")
    p.add_argument("collectives", nargs="*", metavar="COLLECTIVE",
                   help=f"the collectives to print, of {', '.join(COLLECTIVES)} (default: every one in the file)")
    a = p.parse_args(argv)
    unknown = [c for c in a.collectives if c not in COLLECTIVES]
    if unknown:
        p.error(f"no collective {', '.join(unknown)}: choose of {', '.join(COLLECTIVES)}")
    return a


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        from .plot import plot
        a = parse_plot_args(argv[1:])
        print(plot(a.files, a.output, a.collective))
        return
    if argv[:1] == ["table"]:
        from .report import markdown_table, read_json
        a = parse_table_args(argv[1:])
        doc = read_json(a.file)
        for coll in a.collectives or list(dict.fromkeys(r["collective"] for r in doc["rows"])):
            print(f"### {coll}\n\n{markdown_table(doc['rows'], coll, doc['meta']['backends'][0], doc['meta'])}\n")
        return
    if argv[:1] == ["kernels"]:
        from .kernels import main as kernels
        return kernels(argv[1:])
    if argv[:1] == ["floor"]:
        from .floor import main as floor
        return floor(argv[1:])
    if argv[:1] == ["init"]:
        from .init import main as init
        return init(argv[1:])
    if argv[:1] == ["tune"]:
        from .tune import main as tune
        return tune(argv[1:])
    args = parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("the benchmark needs torch: pip install 'engine[bench]' (torch 2.1 to 2.13 and matplotlib)")
    from . import report, run  # imports torch (and MPI, under mpirun) only when a sweep runs
    collectives = [c for c in COLLECTIVES] if args.collective == "all" else [args.collective]
    rows, meta = run.sweep(args, collectives)
    if meta.get("rank", 0) == 0:
        report.print_report(rows, meta, sys.stdout)
        if args.json:
            report.write_json(args.json, rows, meta)
            print(f"# wrote {args.json}")
        if any(r["wrong"] > 0 for r in rows):
            sys.exit(1)


if __name__ == "__main__":
    main()
