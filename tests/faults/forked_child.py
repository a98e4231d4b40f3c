"""Processes forked from a rank (engine/forks.py), two ranks, ENGINE_TRANSPORT as set.

1. DDP trains on batches that DataLoader workers (forked while the engine's threads run) load, and
   ends with the parameters of one process trained on the full batches.
2. Each rank forks a child that tries the rank's groups: every call, blocking or not, raises naming
   the fork; it destroys its copy of the group, makes a group of its own through a store of its own
   (spawned only), and ends through the interpreter's exit (its hooks run; under MPI it leaves with
   os._exit, since a forked child must not finalize MPI). A fork of the child does the same. Then the
   ranks' own groups, the world and a subgroup, collectives and point-to-point, still give right
   results.
3. (Spawned only: a launcher would end every rank) Rank 1 forks a child that sleeps, then dies
   (SIGKILL). Rank 0's next all_reduce must end at once, naming rank 1, although the child holds
   copies of everything rank 1 had open; not when the child ends (20 s) or at the group's timeout
   (30 s).

    python tests/faults/forked_child.py          # spawns 2 ranks; prints `exit codes [0, 0]` at the end
    mpiexec -n 2 python tests/faults/forked_child.py
"""

import datetime
import multiprocessing
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients"))
import common  # noqa: E402

UNDER_MPI = "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ


def train_with_forked_loader(rank, size):
    net = DDP(common.model())
    opt = torch.optim.SGD(net.parameters(), lr=common.LR)
    shards = [common.shard(batch, rank, size) for batch in common.batches()]
    loader = DataLoader(shards, batch_size=None, num_workers=2, multiprocessing_context="fork")
    for x, y in loader:
        opt.zero_grad()
        common.loss(net, x, y).backward()
        opt.step()
    common.report("DDP with forked DataLoader workers", [p.detach() for p in net.module.parameters()])


def child_tries_the_groups(rank, sub, in_flight, depth=1):
    """In the forked child (depth 2: a fork of that child): exits 0 if every call raised naming this
    process and its parent; a call that hangs ends the child (SIGALRM) with a non-zero exit."""
    signal.alarm(30)
    failures = []
    for what, call in [("all_reduce", lambda: dist.all_reduce(torch.ones(4))),
                       ("subgroup all_reduce", lambda: dist.all_reduce(torch.ones(4), group=sub)),
                       ("async all_reduce", lambda: dist.all_reduce(torch.ones(4), async_op=True).wait()),
                       ("send", lambda: dist.send(torch.ones(4), 1 - rank)),
                       ("all_gather_object", lambda: dist.all_gather_object([None, None], rank)),
                       ("new_group", lambda: dist.new_group([0, 1])),
                       ("monitored_barrier", lambda: dist.group.WORLD.monitored_barrier()),
                       # the parent's in-flight call: it either completed before the fork, or fails here
                       ("the parent's work", in_flight.wait)]:
        try:
            call()
            if what != "the parent's work":
                failures.append(f"{what} passed")
        except Exception as exc:   # (the parent's work failed in the first fork, which a second one copied)
            said = "is a fork of pid" if what == "the parent's work" else \
                f"this process (pid {os.getpid()}) is a fork of pid {os.getppid()}"
            if said not in str(exc):
                failures.append(f"{what}: {type(exc).__name__}: {exc}")
    if depth == 1:   # a fork of this fork: its messages name it and this process
        pid = os.fork()
        if pid == 0:
            child_tries_the_groups(rank, sub, in_flight, 2)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failures.append(f"its own child exited with {status}")
    dist.destroy_process_group()   # its copy: nothing of the parent's is freed or told
    if depth == 1 and not UNDER_MPI:   # a group of its own, through a store of its own, works
        dist.init_process_group("engine", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.destroy_process_group()
        if t.tolist() != [1.0, 1.0, 1.0]:
            failures.append(f"its own group's all_reduce gave {t.tolist()}")
    print(f"rank {rank}'s {'grand' * (depth - 1)}child: {'; '.join(failures) or 'every call refused, naming the fork'}",
          flush=True)
    if UNDER_MPI or depth == 2:
        os._exit(1 if failures else 0)
    sys.exit(1 if failures else 0)


def forked_child_leaves_the_groups_alone(rank, size):
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4))
    big = torch.ones(1 << 20)
    in_flight = dist.all_reduce(big, async_op=True)
    pid = os.fork()
    if pid == 0:
        child_tries_the_groups(rank, sub, in_flight)
    in_flight.wait()
    assert big[0] == 2, big[0]
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"rank {rank}'s child exited with {status}"
    for step in range(10):
        t = torch.arange(1000, dtype=torch.float32) + rank
        dist.all_reduce(t)
        assert torch.equal(t, 2 * torch.arange(1000, dtype=torch.float32) + 1), f"step {step}: {t[:4]}"
        dist.all_reduce(t, group=sub)
        if rank == 0:
            dist.send(t, 1)
        else:
            got = torch.empty_like(t)
            dist.recv(got, 0)
            assert torch.equal(got, t), f"step {step}: recv {got[:4]}"
    print(f"rank {rank}: its groups work after its child's calls and exit", flush=True)


def dead_rank_with_a_live_child(rank, children):
    dist.barrier()
    if rank == 1:
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(20,), daemon=True)
        child.start()
        children.put(child.pid)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        print("rank 0: all_reduce passed", flush=True)
    except Exception as exc:
        print(f"rank 0 raised after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)


def worker(rank, port, children):
    import torchbridge  # noqa: F401  (registers the backend)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("engine", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    train_with_forked_loader(rank, 2)
    forked_child_leaves_the_groups_alone(rank, 2)
    dead_rank_with_a_live_child(rank, children)
    os._exit(0)


def launched():
    dist.init_process_group("engine", timeout=datetime.timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    train_with_forked_loader(rank, size)
    forked_child_leaves_the_groups_alone(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    if UNDER_MPI:
        launched()
        sys.exit(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    children = spawn.Queue()
    procs = [spawn.Process(target=worker, args=(r, port, children)) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(120)
    try:   # rank 1's child holds rank 1's end of its sentinel and this script's output open
        os.kill(children.get(timeout=10), signal.SIGKILL)
    except Exception as exc:
        print(f"rank 1's child: {exc!r}", flush=True)
    procs[1].join(120)
    print("exit codes", [p.exitcode for p in procs], flush=True)
