"""One replica group (one rank) of a torchft job over backend "engine": torchft's Manager (quorum from
the lighthouse, reconfigure of the engine group across replicas, healing of a rejoining replica) and
one of two training loops.

    python tests/faults/torchft_replica.py REPLICA LIGHTHOUSE STEPS OUT.json [ddp|hsdp] [KILL_AT]

ddp:  torchft's DistributedDataParallel and OptimizerWrapper (gradients averaged across the replicas).
      With KILL_AT, the first incarnation of this replica (TORCHFT_INCARNATION unset or 0) SIGKILLs
      itself when its step reaches KILL_AT, after writing the time to OUT.json.killed.
hsdp: the gradients are reduce-scattered across the replicas (each replica owns a shard of the flat
      parameters), each shard updated by SGD where it lives, the parameters all-gathered back: the
      sharded step torchft's Gloo group can't take (its reduce_scatter raises).

With REJOINED=PATH in the environment, a restarted incarnation creates PATH once its Manager is made,
and a replica training alone waits for PATH before its last 10 steps: the restart (its imports, its
quorum) takes seconds on a loaded machine, and the rejoin must happen before the end, whatever the
machine's speed.

OUT.json gets the parameters, the step reached, and the time of this incarnation's first committed
step (a rejoining replica's rejoin). In ddp mode each committed step is also printed ("committed step
S with N replicas"), so a test can wait for a replica to go on alone."""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, Manager
from torchft.optim import OptimizerWrapper

IN, OUT = 6, 3
BATCH = 8


def batch(step, replica):
    gen = torch.Generator().manual_seed(1000 * step + replica)
    return (torch.randn(BATCH, IN, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, OUT, generator=gen, dtype=torch.float64))


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(IN, OUT).double()


def main():
    replica, lighthouse, steps, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    mode = sys.argv[5] if len(sys.argv) > 5 else "ddp"
    kill_at = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    first_incarnation = os.environ.get("TORCHFT_INCARNATION", "0") == "0"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    kwargs = {"enable_reconfigure": True} if hasattr(dist, "_reconfigure") else {}
    dist.init_process_group("engine", store=store, rank=0, world_size=1, timeout=timedelta(seconds=20), **kwargs)
    pg = dist.group.WORLD
    net = model()

    def state_dict():
        return {"model": net.state_dict()}

    def load_state_dict(sd):
        net.load_state_dict(sd["model"])

    manager = Manager(pg=pg, min_replica_size=2 if mode == "hsdp" else 1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"replica{replica}", store_addr="127.0.0.1", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=lighthouse, timeout=timedelta(seconds=10),
                      quorum_timeout=timedelta(seconds=30), use_async_quorum=False)
    rejoined = os.environ.get("REJOINED")
    if rejoined and not first_incarnation:
        open(rejoined, "w").close()
    first_commit = None
    if mode == "ddp":
        ddp = DistributedDataParallel(manager, net)
        opt = OptimizerWrapper(manager, torch.optim.SGD(ddp.parameters(), lr=0.1))
        while manager.current_step() < steps:
            if first_incarnation and manager.current_step() == kill_at:
                with open(out + ".killed", "w") as f:
                    json.dump({"time": time.time(), "step": kill_at}, f)
                os.kill(os.getpid(), signal.SIGKILL)
            if rejoined and manager.current_step() >= steps - 10 and manager.num_participants() == 1:
                deadline = time.monotonic() + 120
                while not os.path.exists(rejoined) and time.monotonic() < deadline:
                    time.sleep(0.1)
            opt.zero_grad()   # the quorum: a rejoining replica heals here, its step becoming the others'
            step = manager.current_step()
            x, y = batch(step, replica)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()   # commits (the manager's step advances) unless a replica failed during it
            if manager.current_step() > step:
                if first_commit is None:
                    first_commit = (time.time(), step)
                print(f"committed step {step} with {manager.num_participants()} replicas", flush=True)
            # A step of real work; a replica left alone takes longer over each (the lost replica's work is
            # its own now), so the killed one comes back before this one reaches the last step.
            time.sleep(0.05 if manager.num_participants() > 1 else 0.5)
    else:
        flat_size = sum(p.numel() for p in net.parameters())
        while manager.current_step() < steps:
            step = manager.current_step()
            manager.start_quorum()
            net.zero_grad()
            x, y = batch(step, replica)
            torch.nn.functional.mse_loss(net(x), y).backward()
            n, me = manager.num_participants(), dist.get_rank(pg)
            shard = -(-flat_size // n)
            grads = torch.zeros(shard * n, dtype=torch.float64)
            grads[:flat_size] = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            mine = torch.empty(shard, dtype=torch.float64)
            dist.reduce_scatter_tensor(mine, grads, op=dist.ReduceOp.AVG, group=pg)
            params = torch.zeros(shard * n, dtype=torch.float64)
            params[:flat_size] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            updated = params[me * shard:(me + 1) * shard] - 0.1 * mine
            gathered = torch.empty(shard * n, dtype=torch.float64)
            dist.all_gather_into_tensor(gathered, updated, group=pg)
            if manager.should_commit():
                offset = 0
                with torch.no_grad():
                    for p in net.parameters():
                        p.copy_(gathered[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
                if first_commit is None:
                    first_commit = (time.time(), step)
    with open(out, "w") as f:
        json.dump({"replica": replica, "step": manager.current_step(), "first_commit": first_commit,
                   "participants": manager.num_participants(), "transport": pg.communicator.transport,
                   "params": [p.detach().reshape(-1).tolist() for p in net.parameters()]}, f)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
