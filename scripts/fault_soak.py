"""Fault soak: generations of seeded random traffic (scripts/soak.py's operations) on a group that a
fault breaks at a random moment, each generation recovered by a reconfigure; every result a call
returned checked, every failure bounded in time, nothing leaked.

    python scripts/fault_soak.py --ranks 3 --generations 200 --transport shm
    (tests/test_fault_soak.py runs short ones)

Each generation, the same on every rank (drawn from --seed):
- the members reconfigure the group (fresh uuid, handles through the job's store): every rank, or every
  rank but one that sits the generation out; an all_reduce checks the new group;
- they issue --ops random operations, about half left in flight, while one fault strikes:
  none; abort() on one rank (from a timer thread, at a random moment in the traffic), or on every rank;
  one rank stops issuing (the others time out: the group's timeout is 1 s for the generation); one rank
  issues another collective in place of the next one (a mismatch);
- a rank whose call fails aborts its group (what torchft does), which ends its peers' calls too; every
  call still in flight either fails or returns the right result;
- every member that saw a failure or a fault, and the others at random, abort before the next reconfigure.

A call that returns a wrong result, a failure that takes over --bound seconds after its cause (after
the group's timeout, for a mismatch: a collective against the others' point-to-point is seen by no
rank before; the timeout is 1 s where a rank stalls), a rank
stuck for --hang seconds (its threads' stacks are printed), a rank that dies, a growth of open file
descriptors or threads, or a file left in /dev/shm fails the soak. On torch 2.13, which has no
dist._reconfigure, the group is reconfigured through its own method.
"""

import argparse
import faulthandler
import gc
import json
import os
import random
import re
import socket
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import draw_op, open_fds  # noqa: E402

HAS_RECONFIGURE = hasattr(dist, "_reconfigure")
FAULTS = ["none", "abort_one", "abort_all", "stall", "mismatch", "sit_out"]
UUID_BASE = 1000


class Rank:
    def __init__(self, rank, size, port, args):
        self.rank, self.size, self.args = rank, size, args
        self.store = dist.TCPStore("127.0.0.1", port, size + 1, False, timeout=timedelta(seconds=args.hang),
                                   wait_for_workers=False)
        self.before = (open_fds(), threading.active_count() + 1)   # (+ the soak's own watchdog thread)
        kwargs = {"enable_reconfigure": True} if HAS_RECONFIGURE else {}
        dist.init_process_group("engine", store=dist.PrefixStore("world", self.store), rank=rank, world_size=size,
                                timeout=timedelta(seconds=args.hang), **kwargs)
        self.pg = dist.distributed_c10d._get_default_group()
        self.backend = self.pg._get_backend(torch.device("cpu"))
        self.stats = {"generations": 0, "checked": 0, "failed_calls": 0, "wrong": [], "errors": {},
                      "slowest_failure_s": 0.0, "fds": [], "threads": [], "faults": set()}
        self.phase = ("start", time.monotonic())
        self.lock = threading.Lock()

    # -- the generation's steps --

    def reconfigure(self, g, members):
        self.store.set(f"g{g}/handle/{self.rank}", dist._get_reconfigure_handle(self.pg) if HAS_RECONFIGURE
                       else self.pg.get_reconfigure_handle())
        handles = [self.store.get(f"g{g}/handle/{r}").decode() for r in members]
        timeout = timedelta(seconds=self.args.hang)
        if HAS_RECONFIGURE:
            dist._reconfigure(UUID_BASE + g, handles, group=self.pg, timeout=timeout).wait()
        else:
            self.pg.reconfigure(SimpleNamespace(uuid=UUID_BASE + g, handles=handles, timeout=timeout)).wait()
        assert (dist.get_rank(), dist.get_world_size()) == (members.index(self.rank), len(members))
        t = torch.full((3,), dist.get_rank() + 1.0)
        dist.all_reduce(t)
        n = len(members)
        assert torch.equal(t, torch.full((3,), n * (n + 1) / 2)), (g, t)

    def traffic(self, g, rng, fault, victim):
        """The generation's operations under its fault; returns whether this rank's group broke (a call
        of it failed, or this rank was the fault)."""
        me, n = dist.get_rank(), dist.get_world_size()
        faulted = fault == "abort_all" or (fault in ("abort_one", "stall", "mismatch") and me == victim)
        when = rng.randrange(self.args.ops)             # the op a stall or mismatch strikes at
        delay = rng.uniform(0, self.args.abort_within)   # when an abort strikes
        timer = None
        if fault in ("abort_one", "abort_all") and faulted:
            timer = threading.Timer(delay, self._abort, (g,))
            timer.start()
        pending, failed = [], False
        for i in range(self.args.ops):
            if failed:
                break
            if fault in ("stall", "mismatch") and faulted and i == when:
                self._record(g, "fault_at")
                if fault == "stall":   # the others time out (1 s), abort, and this rank aborts after them
                    time.sleep(1.5)
                    self._abort(g)
                    break
                # in place of op i (drawn and dropped, keeping the draws in step): a count nobody draws
                draw_op(rng, -1, list(range(n)), None, self.args.max_elems, "", large=0.15)
                try:
                    dist.all_reduce(torch.ones(self.args.max_elems + 17))
                except RuntimeError as exc:
                    failed = self._failed(g, exc)
                    break
                self.stats["wrong"].append(f"generation {g}: an all_reduce nobody else called returned")
                continue
            try:
                op = draw_op(rng, me, list(range(n)), None, self.args.max_elems, f"generation {g} op {i}",
                             large=0.15)
            except RuntimeError as exc:
                failed = self._failed(g, exc)
                break
            if op is not None:
                pending.append(op)
            if op is not None and not op.asynchronous:
                failed = self._drain(g, pending) or failed
        failed = self._drain(g, pending) or failed
        if timer is not None:
            timer.join()
        return failed or faulted

    def _drain(self, g, pending):
        failed = False
        for op in pending:
            try:
                for work in op.works:
                    if work is not None:   # (a blocking call's)
                        work.wait()
            except RuntimeError as exc:
                failed = self._failed(g, exc)
                continue
            problem = op.verify()
            self.stats["checked"] += 1
            if problem:
                self.stats["wrong"].append(problem)
                print(f"rank {self.rank}: WRONG {problem}", file=sys.stderr, flush=True)
        pending.clear()
        return failed

    def _failed(self, g, exc):
        """A failed call: counted by the kind of its error, timed against the fault, and the group aborted."""
        self.stats["failed_calls"] += 1
        kind = type(exc).__name__ + ": " + _gist(str(exc))
        self.stats["errors"][kind] = self.stats["errors"].get(kind, 0) + 1
        self.failures.append(time.monotonic())
        self._abort(g)
        return True

    def _abort(self, g):
        """abort() (from the main thread, or from a timer's at the same time: both may run at once)."""
        self._record(g, "abort_at")
        self.backend.abort()

    def _record(self, g, what):
        at = time.monotonic()
        with self.lock:   # (the store's client is one connection)
            key = f"g{g}/{what}/{self.rank}"
            if not self.store.check([key]):   # the first is the cause
                self.store.set(key, repr(at))

    def failure_latency(self, g, members):
        """The longest a failed call of this rank took after the earliest cause a member recorded."""
        if not self.failures:
            return 0.0
        causes = []
        for r in members:
            for what in ("abort_at", "fault_at"):
                key = f"g{g}/{what}/{r}"
                if self.store.check([key]):
                    causes.append(float(self.store.get(key).decode()))
        if not causes:
            return float("inf")   # a call failed with no fault: reported
        return min(self.failures) - min(causes) if min(causes) <= min(self.failures) else float("inf")

    # -- the soak --

    def run(self):
        args, all_ranks = self.args, list(range(self.size))
        watchdog = threading.Thread(target=self._watch, daemon=True)
        watchdog.start()
        for g in range(args.start, args.generations):
            rng = random.Random(args.seed * 100003 + g)   # the same draws on every rank
            fault = rng.choice(args.faults) if g > args.start else "none"
            victim = rng.randrange(self.size)
            abort_anyway = rng.random() < 0.5
            members = [r for r in all_ranks if not (fault == "sit_out" and r == victim)]
            self.phase = (f"generation {g} ({fault}): reconfigure", time.monotonic())
            if self.rank in members:
                self.reconfigure(g, members)
                self.backend.set_timeout(timedelta(seconds=1 if fault == "stall" else args.timeout))
                self.phase = (f"generation {g} ({fault}, victim {victim}): traffic", time.monotonic())
                self.failures = []
                broken = self.traffic(g, rng, fault if fault != "sit_out" else "none", victim)
                self.phase = (f"generation {g} ({fault}): after", time.monotonic())
                self._barrier(f"g{g}/traffic_done", members)
                latency = self.failure_latency(g, members)
                self.stats["slowest_failure_s"] = max(self.stats["slowest_failure_s"], latency)
                # A collective against the others' point-to-point is seen by no rank before the timeout.
                if latency > args.bound + (args.timeout if fault == "mismatch" else 0):
                    self.stats["wrong"].append(f"generation {g} ({fault}): a call failed {latency:.2f} s after "
                                               "its cause")
                if broken or abort_anyway:
                    self.backend.abort()
            self._barrier(f"g{g}/done", all_ranks)
            self.stats["generations"] += 1
            self.stats["faults"].add(fault)
            if args.verbose and self.rank == 0:
                print(f"generation {g}: {fault}, victim {victim}", flush=True)
            if g >= args.start + 2:
                self.stats["fds"].append(open_fds())
                self.stats["threads"].append(threading.active_count())
        dist.destroy_process_group()
        gc.collect()
        deadline = time.monotonic() + 5   # (what a group frees once its last call left, and threads ending)
        while (open_fds(), threading.active_count()) > self.before and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stats["before"], self.stats["after"] = self.before, (open_fds(), threading.active_count())
        self.stats["faults"] = sorted(self.stats["faults"])
        self.phase = ("end", time.monotonic())
        return self.stats

    def _barrier(self, key, ranks):
        self.store.set(f"{key}/{self.rank}", "1")
        self.store.wait([f"{key}/{r}" for r in ranks])

    def _watch(self):
        while True:
            time.sleep(1)
            what, since = self.phase
            if what != "end" and time.monotonic() - since > self.args.hang:
                print(f"rank {self.rank}: HANG in {what} for over {self.args.hang} s; its threads:",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr)
                os._exit(3)


def _gist(message):
    """An error's message without the numbers that differ between its occurrences."""
    first = message.splitlines()[0] if message else ""
    return re.sub(r"\d+(\.\d+)?", "#", first)[:160]


def rank_main(rank, size, port, args, results):
    os.environ["ENGINE_TRANSPORT"] = args.transport
    try:
        stats = Rank(rank, size, port, args).run()
    except BaseException as exc:
        import traceback
        traceback.print_exc()
        results.put((rank, {"crashed": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
    results.put((rank, stats))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--generations", type=int, default=50)
    ap.add_argument("--ops", type=int, default=24, help="operations per generation")
    ap.add_argument("--max-elems", type=int, default=1 << 18, help="the largest operation's elements")
    ap.add_argument("--abort-within", type=float, default=0.02, help="an abort strikes within this many seconds")
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", default=",".join(FAULTS), type=lambda s: s.split(","),
                    help=f"the faults drawn from (comma-separated: {', '.join(FAULTS)})")
    ap.add_argument("--start", type=int, default=0, help="the first generation (the ones before are not run)")
    ap.add_argument("--verbose", action="store_true", help="rank 0 prints each generation's fault")
    ap.add_argument("--bound", type=float, default=5.0, help="seconds a failure may take after its cause")
    ap.add_argument("--timeout", type=float, default=10.0, help="the group's timeout (1 s where a rank stalls)")
    ap.add_argument("--hang", type=float, default=60.0, help="seconds a rank may spend in one step")
    args = ap.parse_args()

    shm_before = set(os.listdir("/dev/shm"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")   # (torch is imported once, here)
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    store = dist.TCPStore("127.0.0.1", port, args.ranks + 1, True, timeout=timedelta(seconds=args.hang),
                          wait_for_workers=False)
    start = time.monotonic()
    got = {}
    while len(got) < args.ranks:
        try:
            rank, stats = results.get(timeout=1)
            got[rank] = stats
        except Exception:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
            if dead:
                time.sleep(0.5)   # (its result may still be in the queue)
                while not results.empty():
                    rank, stats = results.get()
                    got[rank] = stats
                dead = [r for r in dead if r not in got]
                if dead:
                    got.update({r: {"crashed": f"exit code {procs[r].exitcode}"} for r in dead})
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    del store
    left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    problems = []
    for r, stats in sorted(got.items()):
        if "crashed" in stats:
            problems.append(f"rank {r} crashed: {stats['crashed']}")
            continue
        problems += [f"rank {r}: {w}" for w in stats["wrong"]]
        for i, what in enumerate(("fds", "threads")):
            if stats["after"][i] > stats["before"][i]:
                problems.append(f"rank {r}: {stats['after'][i] - stats['before'][i]} {what} more after the group was "
                                f"destroyed than before it was made")
            # (a trend needs a few samples a quarter: one thread or descriptor more in the last of six samples,
            # a progress thread still ending, is no growth; the count after destroying is checked above)
            series, quarter = stats[what], len(stats[what]) // 4
            if quarter >= 4 and min(series[-quarter:]) > max(series[:quarter]):
                problems.append(f"rank {r}: {what} grew generation by generation: {series}")
    if left:
        problems.append(f"left in /dev/shm: {left}")
    ok = [s for s in got.values() if "crashed" not in s]
    summary = {"ranks": args.ranks, "transport": args.transport, "generations": args.generations, "seed": args.seed,
               "seconds": round(time.monotonic() - start, 1),
               "checked_results_all_ranks": sum(s["checked"] for s in ok),
               "failed_calls_all_ranks": sum(s["failed_calls"] for s in ok),
               "slowest_failure_s": round(max([s["slowest_failure_s"] for s in ok] or [0]), 3),
               "faults": sorted({f for s in ok for f in s["faults"]}),
               "errors": dict(sum((Counter(s["errors"]) for s in ok), Counter())),
               "problems": problems}
    print("FAULT SOAK " + json.dumps(summary), flush=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
