"""A/B, in one job, rounds interleaved: PointToPointWork's reset/wait as of 12796cf ("before": every
wait() takes the lock and asks the request) against the current ones ("after": a message finished
while posting it is complete at once, and its wait() returns without the lock). 1 KB messages, 2 ranks:
a stream of dist.send -> dist.recv, a pingpong of them, and batch_isend_irecv of one isend and one irecv.

    mpirun -n 2 python docs/results/p2p_wait/ab.py
"""
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torchbridge.work import PointToPointWork as W  # noqa: E402

BEFORE = "12796cf"   # the last commit whose wait() always took the lock


def methods_at(commit):
    """PointToPointWork's reset and wait as torchbridge/work.py had them at commit (git show)."""
    source = subprocess.run(["git", "show", f"{commit}:torchbridge/work.py"], capture_output=True, text=True,
                            check=True).stdout
    module = {"__name__": f"work_at_{commit}"}
    exec(compile(source, f"torchbridge/work.py@{commit}", "exec"), module)
    return module["PointToPointWork"].reset, module["PointToPointWork"].wait


versions = {"before": methods_at(BEFORE), "after": (W.reset, W.wait)}
dist.init_process_group(backend="engine")
r = dist.get_rank(); peer = 1 - r
eg = dist.new_group(backend="engine")
x = torch.ones(256); y = torch.empty(256)
N = 10000


def stream():
    if r == 0:
        for _ in range(N): dist.send(x, 1, group=eg)
    else:
        for _ in range(N): dist.recv(y, 0, group=eg)


def pingpong():
    for _ in range(N // 2):
        if r == 0: dist.send(x, 1, group=eg); dist.recv(y, 1, group=eg)
        else: dist.recv(y, 0, group=eg); dist.send(x, 0, group=eg)


def batch():
    for _ in range(N // 4):
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, eg), dist.P2POp(dist.irecv, y, peer, eg)]):
            w.wait()


cases = {"stream": (stream, N), "pingpong": (pingpong, N), "batch": (batch, N // 4)}
res = {(k, v): [] for k in cases for v in versions}
for _ in range(15):
    for k, (f, n) in cases.items():
        for v, (rs, wt) in versions.items():
            W.reset, W.wait = rs, wt
            dist.barrier(group=eg)
            t = time.perf_counter(); f(); dist.barrier(group=eg); res[(k, v)].append((time.perf_counter() - t) / n * 1e6)
if r == 0:
    for k in cases:
        b, a = res[(k, "before")], res[(k, "after")]
        print(f"{k}: before {statistics.median(b):.3f} after {statistics.median(a):.3f} paired diff {statistics.median([y - x for x, y in zip(b, a)]):+.3f} us")
dist.destroy_process_group()
