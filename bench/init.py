"""How long making a world takes: init_process_group over tcp:// (torch's TCPStore in rank 0), as
mp.spawn and mpirun make it, for each backend named, rounds alternated between them:

    python -m bench init                          # 2 ranks, engine and gloo, 10 rounds
    python -m bench init --ranks 4 --rounds 20 --late-ms 20
    python -m bench init --ranks 3 --reconfigure  # a reconfigure instead (torch 2.14 and later)

The ranks are spawned once (multiprocessing's spawn) and meet at a barrier before every round; rank 0,
which hosts the store, starts its init --late-ms after the others (a launcher's processes start
tens of milliseconds apart, and the store's host need not be first). A round: init_process_group on a
fresh port, an all_reduce checked against what each rank computes, destroy_process_group. A row: the
backend and the time from the barrier until the slowest rank's init_process_group returned (median,
least and most of the rounds), in milliseconds.

--reconfigure times how long a group takes to recover instead: each round makes the world with
enable_reconfigure=True (untimed), the ranks hand their reconfigure handles round through its store,
and the round times dist._reconfigure onto the same members under a fresh uuid (rank 0, the first
member, --late-ms late), then checks an all_reduce on the new communicator.
"""

import argparse
import multiprocessing
import os
import platform
import statistics
import sys


def _rank(rank, size, plan, late, barrier, results, reconfigure):
    import datetime
    import time
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    for round_, backend, port in plan:
        init = lambda **kw: dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,  # noqa: E731
                                                    world_size=size, timeout=timeout, **kw)
        if reconfigure:
            init(enable_reconfigure=True)
            store = dist.distributed_c10d._get_default_store()
            store.set(f"handle/{rank}", dist._get_reconfigure_handle())
            handles = [store.get(f"handle/{r}").decode() for r in range(size)]
        barrier.wait()
        start = time.monotonic()
        if rank == 0:
            time.sleep(late)
        if reconfigure:
            dist._reconfigure(round_ + 1, handles, timeout=timeout).wait()
        else:
            init()
        made = time.monotonic() - start
        t = torch.full((8,), float(rank + 1))
        dist.all_reduce(t)
        right = bool((t == size * (size + 1) / 2).all())
        dist.destroy_process_group()
        results.put((round_, backend, rank, made, right))


def main(argv):
    p = argparse.ArgumentParser(prog="python -m bench init", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10, help="rounds per backend (alternated; the median is reported)")
    p.add_argument("--backends", default="engine,gloo", help="comma-separated torch backends")
    p.add_argument("--late-ms", type=float, default=0.0, help="how much later rank 0 starts its init")
    p.add_argument("--reconfigure", action="store_true", help="time a reconfigure onto the same members instead")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if not 1 <= args.ranks <= 64 or not 1 <= args.rounds <= 1000 or not backends or not 0 <= args.late_ms <= 60000:
        p.error("--ranks 1-64, --rounds 1-1000, --late-ms 0-60000 and at least one backend")
    import torch
    import torch.distributed as dist
    import torchbridge  # noqa: F401  (registers backend "engine")
    if args.reconfigure and not hasattr(dist, "_reconfigure"):
        p.error(f"--reconfigure needs torch 2.14 or later (dist._reconfigure); this is torch {torch.__version__}")
    from torchbridge.launch import free_ports
    from engine.kernels import cpu
    ports = iter(free_ports(args.rounds * len(backends)))
    plan = [(r, b, next(ports)) for r in range(args.rounds) for b in backends]
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, plan, args.late_ms / 1e3, barrier, results,
                                             args.reconfigure), daemon=True)
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    made, wrong = {}, 0
    for _ in range(len(plan) * args.ranks):
        round_, backend, _rank_, seconds, right = _result(results, procs)
        made.setdefault((backend, round_), []).append(seconds)
        wrong += not right
    for proc in procs:
        proc.join(60)
        if proc.exitcode != 0:
            sys.exit(f"python -m bench init: a rank exited with {proc.exitcode}")
    what = "dist._reconfigure onto the same members" if args.reconfigure else "init_process_group over tcp://"
    print(f"# {what}, {args.ranks} ranks, rank 0 {args.late_ms:g} ms late, {args.rounds} rounds alternated; "
          f"{os.cpu_count()} cores of {cpu()['model'] or platform.machine()}, torch {torch.__version__}; ms until the "
          f"slowest rank's returned")
    print(f"# {'backend':>10} {'median':>8} {'least':>8} {'most':>8}")
    for backend in backends:
        slowest = [max(made[(backend, r)]) * 1e3 for r in range(args.rounds)]
        print(f"  {backend:>10} {statistics.median(slowest):>8.1f} {min(slowest):>8.1f} {max(slowest):>8.1f}")
    print(f"# Out of bounds values : {wrong}")
    if wrong:
        sys.exit(1)


def _result(results, procs):
    """The next rank's result; a rank that exited (it raised: its traceback is above) ends the run at
    once, naming it, instead of leaving the others to wait for it."""
    import queue
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            gone = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None]
            if gone:
                sys.exit(f"python -m bench init: rank {gone[0][0]} exited with {gone[0][1]} before its results "
                         "were in (its error is above)")
