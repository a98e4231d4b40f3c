"""torchft (torchft-nightly, on torch 2.14 and 2.15) over backend "engine": its own resize worker (three
generations of members through reconfigure_with_store, then abort and recovery), a training job of two
replica groups under torchft's Manager and lighthouse where one replica is SIGKILLed, restarted and
rejoins (healed from the other), and a sharded (HSDP-style) job whose reduce_scatter crosses the
replicas, which torchft's own Gloo group refuses. Skipped where torchft is not installed (the torch
2.13 environment); `make test` runs it in the torch 2.14 and 2.15 ones (docs/fault-tolerance.md)."""

import json
import os
import re
import subprocess
import sys
import threading

import pytest

torchft = pytest.importorskip("torchft")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mpirun import run_launcher  # noqa: E402
from torchrun import clean_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPLICA = os.path.join(HERE, "faults", "torchft_replica.py")
RESIZE = """
import torch.distributed as dist, torch.multiprocessing as mp
from torchft.reconfigure_test import _resize_worker
if __name__ == "__main__":
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_resize_worker, args=(store.port, "engine"), nprocs=3)
    print("torchft resize and recover over engine: ok")
"""


def test_torchft_resize_and_recover_over_the_engine():
    """torchft.reconfigure_test's worker with backend "engine": generations [0,1,2], [2,0], [1,2,0] through
    torchft's reconfigure_with_store (the group object and its name kept), then abort and recovery."""
    proc = run_launcher([sys.executable, "-c", RESIZE], 180, env=clean_env())
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-6000:]


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer
    servers = []

    def make(min_replicas):
        servers.append(LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000,
                                        heartbeat_timeout_ms=2000))
        return servers[-1].address()

    yield make
    for s in servers:
        s.shutdown()


def _replica(replica, address, steps, out, mode, kill_at=-1, incarnation=0, rejoined=""):
    env = clean_env(TORCHFT_INCARNATION=str(incarnation), REJOINED=rejoined)
    return subprocess.Popen([sys.executable, REPLICA, str(replica), address, str(steps), out, mode, str(kill_at)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _alone_after(proc, step):
    """Reads proc's output on a thread; the returned event is set once proc commits a step after `step`
    with no other replica. Returns (event, lines, thread)."""
    alone, lines = threading.Event(), []

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.match(r"committed step (\d+) with 1 replicas", line)
            if m and int(m.group(1)) > step:
                alone.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return alone, lines, reader


def test_a_killed_replica_is_restarted_and_rejoins(lighthouse, tmp_path):
    """Replica 1 SIGKILLs itself at step 4; replica 0 goes on alone (min_replica_size 1), replica 1 is
    started again once replica 0 has committed a step alone, heals from replica 0 and trains with it to
    step 40: both end with the same parameters."""
    address = lighthouse(1)
    outs = [str(tmp_path / f"r{i}.json") for i in range(2)]
    rejoined = str(tmp_path / "rejoined")   # (replica 0 waits for it before its last steps alone)
    first = [_replica(0, address, 40, outs[0], "ddp", rejoined=rejoined),
             _replica(1, address, 40, outs[1], "ddp", kill_at=4)]
    alone, lines, reader = _alone_after(first[0], 4)
    first[1].wait(timeout=120)
    assert first[1].returncode == -9, first[1].stdout.read()[-3000:]
    # The lighthouse gives replica 0 a quorum of its own once replica 1's heartbeat times out (2 s);
    # a restart faster than that would rejoin at the step of the kill, before anyone went on alone.
    assert alone.wait(timeout=120), "".join(lines)[-4000:]
    restarted = _replica(1, address, 40, outs[1], "ddp", incarnation=1, rejoined=rejoined)
    log1 = restarted.communicate(timeout=180)[0]
    first[0].wait(timeout=180)
    reader.join(timeout=60)
    logs = ["".join(lines), log1]
    assert first[0].returncode == 0 and restarted.returncode == 0, logs[0][-4000:] + logs[1][-4000:]
    results = [json.load(open(o)) for o in outs]
    killed = json.load(open(outs[1] + ".killed"))
    rejoin = results[1]["first_commit"]
    assert rejoin is not None and rejoin[1] > killed["step"], results[1]
    worst = max(abs(a - b) for pa, pb in zip(results[0]["params"], results[1]["params"]) for a, b in zip(pa, pb))
    print(f"killed at step {killed['step']}, rejoined at step {rejoin[1]} {rejoin[0] - killed['time']:.2f} s "
          f"after the kill; parameter difference between the replicas at step {results[0]['step']}: {worst:.3g}")
    assert results[0]["step"] == results[1]["step"] == 40
    assert worst == 0.0


def test_hsdp_reduce_scatter_across_replicas_matches_one_process(lighthouse, tmp_path):
    """Two replicas, gradients reduce-scattered across them (AVG), each shard stepped where it lives,
    parameters all-gathered: like one process on both replicas' batches, to 1e-12 (float64)."""
    from torchft.process_group import ProcessGroupGloo
    with pytest.raises(RuntimeError, match="does not support reduce_scatter"):
        ProcessGroupGloo().reduce_scatter([torch.zeros(1)], [[torch.zeros(1)]], dist.ReduceScatterOptions())
    sys.path.insert(0, os.path.join(HERE, "faults"))
    from torchft_replica import batch, model
    address = lighthouse(2)
    outs = [str(tmp_path / f"h{i}.json") for i in range(2)]
    procs = [_replica(i, address, 12, outs[i], "hsdp") for i in range(2)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-4000:] + logs[1][-4000:]
    results = [json.load(open(o)) for o in outs]
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(12):
        (x0, y0), (x1, y1) = batch(step, 0), batch(step, 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        opt.step()
    reference = [p.detach().reshape(-1).tolist() for p in net.parameters()]
    for r in results:
        assert r["participants"] == 2 and r["step"] == 12, r
        worst = max(abs(a - b) for pa, pb in zip(r["params"], reference) for a, b in zip(pa, pb))
        assert worst < 1e-12, worst
