# 2 ranks: float16 AVG (and SUM for reference) in place through engine.Communicator.allreduce, median per size.
# PYTHONPATH=<the build> mpirun -n 2 --bind-to none python allreduce_float16_avg_script.py LABEL
import sys, time
import torch
import engine

comm = engine.Communicator()
for op in (engine.ReduceOp.AVG, engine.ReduceOp.SUM):
    out = []
    for n in (8192, 131072, 524288, 2097152, 8388608):   # 16 KB .. 16 MB of float16
        x = torch.randn(n).to(torch.float16); base = x.clone()
        for _ in range(5): x.copy_(base); comm.allreduce(x, op=op)
        ts = []
        for _ in range(max(10, 20000000 // (n * 2))):
            x.copy_(base); comm.barrier()
            t = time.perf_counter(); comm.allreduce(x, op=op); ts.append(time.perf_counter() - t)
        ts.sort()
        out.append(f"{n*2>>10} KB {ts[len(ts)//2]*1e6:.1f} us")
    if comm.rank == 0: print(sys.argv[1], op.name, " | ".join(out), flush=True)
