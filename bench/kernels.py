"""GB/s of the engine's element-wise kernels against memcpy of the same bytes, on one core, for each
instruction set this CPU runs (rounds interleaved, medians):

    python -m bench kernels                      # 64 KB, 1 MB, 16 MB; every ISA
    python -m bench kernels -b 16M -e 16M --isa avx2
    python -m bench kernels -b 64M -e 64M --threads 1,2   # the threaded collectives' split (engine.kernels)

A row's size is the bytes the kernel writes (a reduction's output, a cast's float32 side; KiB, MiB: 1024,
1024^2 bytes); GB/s is that size over the time (1 GB = 1e9 bytes), and "x memcpy" the kernel's time over
memcpy's (glibc, through ctypes, the same Python call overhead as the kernels'). With --threads, the bf16
and fp32 sums and a copy also run split over that many threads
(engine.kernels.reduce_into/copy_into(threads=N): the team a threaded collective's steps use). Every
buffer comes from torch's allocator.
"""

import argparse
import ctypes
import statistics
import time

import torch

import engine
import engine.kernels

from .busbw import parse_size, size_sweep

# (label, dtype the size counts, run(size) -> callable)
REDUCTIONS = [("sum", torch.bfloat16), ("sum", torch.float16), ("sum", torch.float32), ("sum", torch.float64),
              ("sum", torch.int32), ("max", torch.bfloat16), ("max", torch.float32)]
HALVES = [torch.bfloat16, torch.float16]  # the 16-bit floats: AVG's division, and their casts with float32


def _data(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 100
    return x.to(dtype) if dtype.is_floating_point else x.to(torch.int32)


THREADED = [torch.bfloat16, torch.float32]  # the sums that also run split over threads (--threads)


def cases(nbytes, threads=(1,)):
    """{label: callable} for one size; buffers made once."""
    out = {}
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 255)
    out["memcpy"] = lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    for op, dtype in REDUCTIONS:
        n = nbytes // torch.empty(0, dtype=dtype).element_size()
        a, b = _data(n, dtype, 1), _data(n, dtype, 2)
        if op == "sum":  # keep the values bounded across repeated in-place sums
            b.zero_()
        out[f"{op} {str(dtype)[6:]}, in place"] = (lambda a=a, b=b, op=op: engine.reduce_into(a, a, b, op))
        for k in threads:
            if k > 1 and op == "sum" and dtype in THREADED:
                out[f"{op} {str(dtype)[6:]}, in place, {k} threads"] = (
                    lambda a=a, b=b, k=k: engine.kernels.reduce_into(a, a, b, "sum", threads=k))
    for dtype in HALVES:  # (divided by 1, so repeated calls keep the values)
        x = _data(nbytes // 2, dtype, 4)
        out[f"divide {str(dtype)[6:]} (AVG), in place"] = lambda x=x: engine.scale(x, 1.0, divide=True)
    for k in threads:
        if k > 1:
            out[f"copy, {k} threads"] = lambda k=k: engine.kernels.copy_into(dst, src, threads=k)
    for dtype in HALVES:
        n = nbytes // 4
        wide, narrow = _data(n, torch.float32, 3), torch.empty(n, dtype=dtype)
        name = str(dtype)[6:]
        out[f"float32 -> {name} (pack)"] = (lambda w=wide, s=narrow: engine.pack([w], s))
        out[f"{name} -> float32 (unpack)"] = (lambda w=wide, s=narrow: engine.unpack(s, [w]))
    return out


def measure(fn, budget):
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(3, int(budget / once))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main(argv):
    p = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("64K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-f", "--stepfactor", type=float, default=16.0)
    p.add_argument("--isa", default="all", help="all, or one of " + ", ".join(engine.kernels.isas()))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.05, help="seconds per measurement")
    p.add_argument("--threads", default="1", help="comma-separated thread counts for the sums and a copy (1,2)")
    args = p.parse_args(argv)
    threads = sorted({int(k) for k in args.threads.split(",")})
    isas = engine.kernels.isas() if args.isa == "all" else (args.isa,)
    torch.set_num_threads(1)
    previous = engine.kernels.isa()
    print(f"# engine kernels vs memcpy (one thread), {engine.kernels.cpu()['model']}, torch {torch.__version__}; "
          f"ISAs this CPU runs: {', '.join(engine.kernels.isas())}; median of {args.rounds} interleaved rounds; "
          "1 GB = 1e9 bytes")
    print("| size | kernel | " + " | ".join(f"{isa} GB/s | x memcpy" for isa in isas) + " |")
    print("| --- | --- | " + " | ".join("--- | ---" for _ in isas) + " |")
    try:
        for nbytes in size_sweep(args.minbytes, args.maxbytes, args.stepfactor):
            made = cases(nbytes, threads)
            samples = {(isa, k): [] for isa in isas for k in made}
            for _ in range(args.rounds):
                for isa in isas:
                    engine.kernels.use_isa(isa)
                    for k, fn in made.items():
                        samples[(isa, k)].append(measure(fn, args.budget))
            med = {key: statistics.median(v) for key, v in samples.items()}
            for k in made:
                cols = []
                for isa in isas:
                    t = med[(isa, k)]
                    cols.append(f"{nbytes / t / 1e9:.1f} | {t / med[(isa, 'memcpy')]:.2f}")
                print(f"| {_size(nbytes)} | {k} | " + " | ".join(cols) + " |", flush=True)
    finally:
        engine.kernels.use_isa(previous)


def _size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
