"""A fault between namespace hosts while the ranks all_reduce over the engine's TCP transport (launched
by tests/test_hosts.py with torchrun on each host, or plain python with env:// variables):

    FAULT=kill   rank FAULT_RANK sends itself SIGKILL at step 5
    FAULT=cut    rank FAULT_RANK sets its host's link (eth0) down at step 5
    FAULT=drop   rank FAULT_RANK's host refuses every packet it sends at step 5 (a one-way cut at the
                 host: what its peers send still arrives, unacknowledged)
    FAULT=stall  rank FAULT_RANK sleeps past the timeout at step 5 (alive: its peers time out)
    FAULT=cut-connecting  rank FAULT_RANK sets its host's link down while the group's ranks connect
                 (the init's exchange of the TCP ends done, the connections not yet made: every rank
                 waits 1 s there, and S counts from then)
    FAULT=none   only the init (a wrong MASTER_ADDR, a MASTER_PORT in use: the init must fail)

Every rank that raises prints `rank R: raised after S s: Type: message`, S counted from the fault (or
from the start of the init), on the shared clock of the namespace hosts, then `rank R: exit handlers
ran E s after it raised` (the engine's and torch's, whose waits on a store beyond a cut link must not
hold the exit)."""

import atexit
import datetime
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

FAULT = os.environ.get("FAULT", "none")
VICTIM = int(os.environ.get("FAULT_RANK", "1"))
TIMEOUT = float(os.environ.get("FAULT_TIMEOUT", "10"))
rank = int(os.environ.get("RANK", "-1"))
start = time.time()
raised_at = None


def _exit_handlers_ran():
    if raised_at is not None:
        print(f"rank {rank}: exit handlers ran {time.time() - raised_at:.1f} s after it raised", flush=True)


atexit.register(_exit_handlers_ran)   # before torch's and the engine's: it runs after theirs
if FAULT == "cut-connecting":
    import engine.tcp
    exchange = engine.tcp.gather

    def gather(boot, make, what):
        global start
        out = exchange(boot, make, what)
        if what.startswith("make its end"):   # (the last exchange before the ranks connect)
            start = time.time()
            if rank == VICTIM:
                subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
                print(f"rank {rank}: link cut while the group connects at {start:.3f}", flush=True)
            time.sleep(max(start + 1 - time.time(), 0))
        return out
    engine.tcp.gather = gather
try:
    dist.init_process_group(backend="engine", timeout=datetime.timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    t = torch.ones(1 << 16)
    for step in range(1000):
        if step == 5:
            fault_at = time.time()
            if rank == VICTIM and FAULT == "kill":
                print(f"rank {rank}: SIGKILL at step {step} at {fault_at:.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == VICTIM and FAULT == "cut":
                subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
                print(f"rank {rank}: link cut at step {step} at {fault_at:.3f}", flush=True)
            if rank == VICTIM and FAULT == "drop":
                subprocess.run(["tc", "qdisc", "add", "dev", "eth0", "root", "pfifo", "limit", "0"], check=True)
                print(f"rank {rank}: sends dropped at step {step} at {fault_at:.3f}", flush=True)
            if rank == VICTIM and FAULT == "stall":
                print(f"rank {rank}: stalls at step {step} at {fault_at:.3f}", flush=True)
                time.sleep(TIMEOUT + 5)
            start = fault_at
        dist.all_reduce(t)
        time.sleep(0.01)
    print(f"rank {rank}: finished all steps", flush=True)
except Exception as exc:
    raised_at = time.time()
    print(f"rank {rank}: raised after {time.time() - start:.1f} s: {type(exc).__name__}: {exc}".replace("\n", " "),
          flush=True)
    sys.exit(1)
