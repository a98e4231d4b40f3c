"""torch's collective hooks on a group on backend "engine" (torch 2.14+: ProcessGroup.register_pre_hook
and register_post_hook, and TORCH_DIST_NAN_CHECK=1, built on them), at 3 ranks in torch's own
multi-process harness, over shared memory and TCP: each c10d collective and message fires the hooks
exactly as it does on a Gloo group of the same ranks (the same names, async_op, input and output shapes, root or peer,
and op_id order), the latency path comes back once the hooks go, and the NaN check refuses a NaN
input as torch's does on its own backends."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase

import torchbridge  # noqa: F401  (registers the backend)
from forked_ranks import ForkedRanks

pytestmark = pytest.mark.skipif(not hasattr(dist.ProcessGroup, "register_pre_hook"),
                                reason="torch's collective hooks arrived in torch 2.14")
WORLD = 3


def calls(rank, size):
    """(what, call(group)): every c10d collective and message, synchronous and asynchronous, even and
    uneven, with roots and peers other than 0."""
    t = torch.ones(3, 2)
    peer_to, peer_from = (rank + 1) % size, (rank - 1) % size

    def exchange(group):
        ops = [dist.P2POp(dist.isend, torch.ones(2), peer_to, group), dist.P2POp(dist.irecv, torch.zeros(2), peer_from, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def any_source(group):
        if rank == 0:
            for _ in range(size - 1):
                dist.recv(torch.zeros(2), group=group)
        else:
            dist.send(torch.ones(2), 0, group=group)

    uneven = [r + 1 for r in range(size)]
    return [
        ("all_reduce", lambda g: dist.all_reduce(t, group=g)),
        ("all_reduce async", lambda g: dist.all_reduce(t, group=g, async_op=True).wait()),
        ("all_reduce not contiguous", lambda g: dist.all_reduce(t.t(), group=g)),
        ("all_reduce_coalesced", lambda g: dist.all_reduce_coalesced([t, torch.ones(5)], group=g)),
        ("broadcast", lambda g: dist.broadcast(t, dist.get_global_rank(g, size - 1), group=g)),
        ("reduce", lambda g: dist.reduce(t, dist.get_global_rank(g, 1), group=g)),
        ("all_gather", lambda g: dist.all_gather([torch.empty(3, 2) for _ in range(size)], t, group=g)),
        ("all_gather_into_tensor", lambda g: dist.all_gather_into_tensor(torch.empty(3 * size, 2), t, group=g)),
        ("reduce_scatter", lambda g: dist.reduce_scatter(torch.empty(2), [torch.ones(2)] * size, group=g)),
        ("reduce_scatter_tensor", lambda g: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * size), group=g)),
        ("all_to_all", lambda g: dist.all_to_all([torch.empty(2) for _ in range(size)], [torch.ones(2)] * size, group=g)),
        ("all_to_all_single", lambda g: dist.all_to_all_single(torch.empty(2 * size), torch.ones(2 * size), group=g)),
        ("all_to_all_single uneven", lambda g: dist.all_to_all_single(torch.empty(sum(uneven)), torch.ones((rank + 1) * size),
                                                                       uneven, [rank + 1] * size, group=g)),
        ("gather", lambda g: dist.gather(t, [torch.empty(3, 2) for _ in range(size)] if rank == 1 else None,
                                         dst=dist.get_global_rank(g, 1), group=g)),
        ("scatter", lambda g: dist.scatter(torch.empty(3, 2), [torch.ones(3, 2)] * size if rank == 2 else None,
                                           src=dist.get_global_rank(g, 2), group=g)),
        ("barrier", lambda g: dist.barrier(group=g)),
        ("all_gather_object", lambda g: dist.all_gather_object([None] * size, {"rank": rank}, group=g)),
        ("batch_isend_irecv", exchange),
        ("send and recv from any source", any_source),
    ]


def shapes(tensors):
    return [tuple(t.shape) for t in tensors]


class TorchHooks(ForkedRanks):
    transport = "shm"
    world_size = WORLD

    def _init(self):
        os.environ["ENGINE_TRANSPORT"] = self.transport
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("engine", world_size=self.world_size, rank=self.rank, store=store,
                                timeout=timedelta(seconds=30))
        return dist.group.WORLD, dist.new_group(backend="gloo")

    def test_every_call_fires_the_hooks_as_on_gloo(self):
        engine, gloo = self._init()
        seen = {}
        for group in (engine, gloo):
            log = seen[group] = []
            group.register_pre_hook(3, lambda a, log=log: log.append(
                ("pre", a.name, a.async_op, shapes(a.input_tensors), shapes(a.output_tensors), a.root, a.op_id)))
            group.register_pre_hook(1, lambda a, log=log: log.append(("first", a.op_id)))   # (fired in id order)
            group.register_post_hook(2, lambda a, log=log: log.append(
                ("post", a.name, a.async_op, a.work is not None, a.op_id)))
        for what, call in calls(self.rank, self.world_size):
            got = {}
            for group in (engine, gloo):
                seen[group].clear()
                call(group)
                got[group] = list(seen[group])
            # op_id counts each group's calls: compared from the first of this call's
            relative = {group: [e[:-1] + (e[-1] - events[0][-1],) for e in events] for group, events in got.items()}
            self.assertTrue(relative[engine], what)
            self.assertEqual(relative[engine], relative[gloo], what)
        self.assertIsNotNone(engine._call_hooks)
        for group in (engine, gloo):
            group.unregister_pre_hook(3)
            group.unregister_pre_hook(1)
            group.unregister_post_hook(2)
        self.assertIsNone(engine._call_hooks)
        self.assertFalse(engine._fast.hooked)   # the latency path again
        seen[engine].clear()
        dist.all_reduce(torch.ones(2))
        self.assertEqual(seen[engine], [])
        with self.assertRaisesRegex(RuntimeError, "completion hooks .* NCCL only"):
            engine._register_on_completion_hook(lambda info: None)
        if hasattr(dist.ProcessGroup, "supports_abort_hooks"):   # (torch 2.15)
            self.assertTrue(engine.supports_abort_hooks)
            self.assertFalse(engine.supports_completion_hooks)
            self.assertFalse(dist._supports_window(engine))      # (asked of the group, not raised by torch)
            with self.assertRaisesRegex(RuntimeError, "backend 'engine' has no one-sided"):
                dist._new_window(torch.zeros(2), group=engine)
        with self.assertRaisesRegex(NotImplementedError, "time estimator is not supported"):
            with dist.distributed_c10d._time_estimator(group=engine):
                pass
        dist.destroy_process_group()

    def test_the_nan_check_refuses_a_nan_input_as_torch_does(self):
        os.environ["TORCH_DIST_NAN_CHECK"] = "1"
        engine, gloo = self._init()
        nan = float("nan")
        for group in (engine, gloo):
            for dtype in (torch.float32, torch.bfloat16):
                with self.assertRaisesRegex(RuntimeError, "NaN found in input tensor"):
                    dist.all_reduce(torch.tensor([1.0, nan], dtype=dtype), group=group)
            with self.assertRaisesRegex(RuntimeError, "NaN found in input tensor"):
                dist.all_gather([torch.zeros(1) for _ in range(self.world_size)], torch.tensor([nan]), group=group)
            root = dist.get_global_rank(group, 1)   # a broadcast's tensor is its input on the root only
            if self.rank == 1:
                with self.assertRaisesRegex(RuntimeError, "NaN found in input tensor"):
                    dist.broadcast(torch.tensor([nan]), root, group=group, async_op=True)
                dist.broadcast(torch.tensor([5.0]), root, group=group, async_op=True).wait()
            else:
                t = torch.tensor([nan])
                dist.broadcast(t, root, group=group, async_op=True).wait()
                self.assertEqual(t, torch.tensor([5.0]))
            out = [torch.full((1,), nan) for _ in range(self.world_size)]   # outputs are not checked
            dist.all_gather(out, torch.tensor([float(self.rank)]), group=group)
            self.assertEqual(out, [torch.tensor([float(r)]) for r in range(self.world_size)])
            t = torch.tensor([1, 2])
            dist.all_reduce(t, group=group)
            self.assertEqual(t, torch.tensor([3, 6]))
        with self.assertRaisesRegex(RuntimeError, "NaN found in input tensor"):   # DDP's buckets' path
            engine.fused_allreduce_async([torch.tensor([nan])]).wait()
        dist.destroy_process_group()


class EngineShmTorchHooksTest(TorchHooks, MultiProcessTestCase):
    transport = "shm"


class EngineTcpTorchHooksTest(TorchHooks, MultiProcessTestCase):
    transport = "tcp"
