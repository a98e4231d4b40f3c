import time, torch, engine, os, sys
comm = engine.Communicator()
r = comm.rank
out = []
for n in (131072, 524288, 2097152, 8388608):   # 256 KB .. 16 MB of float16
    x = torch.randn(n).to(torch.float16); base = x.clone()
    for _ in range(5): x.copy_(base); comm.allreduce(x)
    ts = []
    for _ in range(max(10, 20000000 // (n * 2))):
        x.copy_(base); comm.barrier()
        t = time.perf_counter(); comm.allreduce(x); ts.append(time.perf_counter() - t)
    ts.sort()
    out.append(f"{n*2>>10} KB {ts[len(ts)//2]*1e6:.1f} us")
if r == 0: print(sys.argv[1], " | ".join(out))
