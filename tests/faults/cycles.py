"""Init/destroy and reconfigure cycles in one process: what each cycle leaves open.

    python tests/faults/cycles.py RANK SIZE PORT CYCLES [shm|tcp]

Each of CYCLES init/destroy cycles makes the default group through a new TCPStore (tcp://127.0.0.1:PORT+i),
runs an all_reduce, makes a group with new_group and runs one on it, and destroys both; then one group
is reconfigured CYCLES times (identity, a fresh uuid each, an all_reduce after each). After every cycle
the process prints one line: `cycle KIND I fds N threads N tasks N rss_kib N settled_ms N` (threads:
Python's; tasks: the kernel's, native threads included; settled_ms: how long the task count was read).

CYCLES_HOLD=1: the collector is off, and the init cycles become CYCLES cycles of new_group + all_reduce +
destroy in one default group (KIND group), each destroyed group still referenced, as a caller holding
its groups keeps them: what a group holds must go when it is destroyed, not when it is collected. (A
held group keeps torch's store, so a held group of each init cycle would keep a TCPStore each.)"""

import gc
import os
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist


_lowest_tasks = {}
HOLD = os.environ.get("CYCLES_HOLD") == "1"
held = []   # (HOLD) every group made


def settled_tasks(kind):
    """The kernel's task count with threads already on their way out gone: the least of the reads over
    50 ms, and while that is above the lowest count of this kind so far, over up to 1 s. A leaked
    thread stays in every read, and the caller's comparison sees it; a thread that was exiting when the
    cycle ended (a store's, a group freed off the caller's thread) does not make a cycle look leaky.
    Returns (count, milliseconds read)."""
    start = time.monotonic()
    n = len(os.listdir("/proc/self/task"))
    while time.monotonic() < start + 0.05 or (n > _lowest_tasks.get(kind, n) and time.monotonic() < start + 1.0):
        time.sleep(0.01)
        n = min(n, len(os.listdir("/proc/self/task")))
    _lowest_tasks[kind] = min(n, _lowest_tasks.get(kind, n))
    return n, round((time.monotonic() - start) * 1000)


def usage(kind, i):
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    if not HOLD:
        gc.collect()
    if os.environ.get("CYCLES_SHOW_FDS"):
        kinds = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            kind_ = target.split(":")[0] if ":" in target else ("file" if target.startswith("/") else target)
            kinds[kind_] = kinds.get(kind_, 0) + 1
        print(f"fds {kind} {i} {sorted(kinds.items())}", flush=True)
        if os.environ.get("CYCLES_SHOW_FDS") == "2":
            socks = {}
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                for line in open(table).read().splitlines()[1:]:
                    f = line.split()
                    socks[f[9]] = (int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16), f[3])
            for fd in sorted(os.listdir("/proc/self/fd"), key=int):
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                inode = target[8:-1] if target.startswith("socket:") else None
                print("   ", fd, target, socks.get(inode, ""), flush=True)
    tasks, settled_ms = settled_tasks(kind)
    print(f"cycle {kind} {i} fds {len(os.listdir('/proc/self/fd'))} threads {threading.active_count()} "
          f"tasks {tasks} rss_kib {rss} settled_ms {settled_ms}", flush=True)


def reconfigure(pg, uuid, handles):
    if hasattr(dist, "_reconfigure"):
        dist._reconfigure(uuid, handles, group=pg, timeout=timedelta(seconds=30)).wait()
    else:
        pg.reconfigure(SimpleNamespace(uuid=uuid, handles=handles, timeout=timedelta(seconds=30))).wait()


def main():
    rank, size, cycles = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
    # one port per cycle and one for the reconfigures: a comma-separated list, or the first of consecutive ones
    ports = [int(p) for p in sys.argv[3].split(",")]
    ports = ports if len(ports) > cycles else [ports[0] + i for i in range(cycles + 1)]
    if len(sys.argv) > 5:
        os.environ["ENGINE_TRANSPORT"] = sys.argv[5]
    timeout = timedelta(seconds=30)
    if HOLD:
        gc.disable()
        dist.init_process_group("engine", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=size,
                                timeout=timeout)
        for i in range(cycles):
            sub = dist.new_group(list(range(size)))
            t = torch.full((1000,), rank + 1.0)
            dist.all_reduce(t, group=sub)
            assert t[0].item() == size * (size + 1) / 2, t[0]
            dist.destroy_process_group(sub)
            held.append(sub)
            usage("group", i)
        dist.destroy_process_group()
    for i in range(0 if HOLD else cycles):
        dist.init_process_group(os.environ.get("CYCLES_BACKEND", "engine"), init_method=f"tcp://127.0.0.1:{ports[i]}", rank=rank, world_size=size,
                                timeout=timeout)
        t = torch.full((1000,), rank + 1.0)
        dist.all_reduce(t)
        assert t[0].item() == size * (size + 1) / 2, t[0]
        sub = dist.new_group(list(range(size)))
        dist.all_reduce(t, group=sub)
        if not os.environ.get("CYCLES_KEEP_SUBGROUP"):
            dist.destroy_process_group(sub)
        dist.destroy_process_group()   # (destroys what is left: every group)
        usage("init", i)
    dist.init_process_group("engine", init_method=f"tcp://127.0.0.1:{ports[cycles]}", rank=rank, world_size=size,
                            timeout=timeout)
    pg = dist.distributed_c10d._get_default_group()
    store = dist.distributed_c10d._get_default_store()
    for i in range(cycles):
        store.set(f"handle/{i}/{rank}", pg.get_reconfigure_handle())
        handles = [store.get(f"handle/{i}/{r}").decode() for r in range(size)]
        reconfigure(pg, 5000 + i, handles)
        t = torch.full((1000,), rank + 1.0)
        dist.all_reduce(t)
        assert t[0].item() == size * (size + 1) / 2, t[0]
        usage("reconfigure", i)
    # No rank leaves before every rank counted its last cycle (a peer's exit closes its store connection);
    # rank 0, which hosts the store, leaves last, once every other rank's wait is answered: its exit
    # closed the store under a wait still being answered (a set sends and is done).
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(size)])
    if rank:
        store.set(f"through/{rank}", "1")
    else:
        store.wait([f"through/{r}" for r in range(1, size)])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
