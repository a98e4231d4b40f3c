"""Groups that survive failures, at 3 ranks in torch's own multi-process harness: reconfigure (identity,
shrink of any rank, scale down to one and back, late join, split and merge, recovery after abort, a
reused uuid refused), then collectives and point-to-point on the new members, a new_group made after a
reconfigure, and abort: a call blocked on a rank that never arrives ends within a second of abort()
from another thread, queued calls with it, the abort hooks run, and get_error() reports as torch says.

The scenarios are those of torch 2.14's test/distributed/test_c10d_fault_tolerance.py (which the
closing notes run as it is, with ("engine", "cpu") added), written here for the engine's transports:
shared memory, and TCP on one host (ENGINE_TRANSPORT=tcp). On torch 2.14 the group is made as torch's
test makes it (enable_reconfigure=True, no communicator until the first reconfigure); on torch 2.13,
which has neither the flag nor dist._reconfigure, the same group is made eagerly and reconfigured
through its own method.
"""

import os
import re
import threading
import time
import unittest
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase

import torchbridge.hooks
from forked_ranks import ForkedRanks
from mpirun import run_launcher

HAS_RECONFIGURE = hasattr(dist, "_reconfigure")
TORCH = tuple(map(int, torch.__version__.split(".")[:2]))
WORLD = 3


class FaultToleranceScenarios(ForkedRanks):
    transport = "shm"
    world_size = WORLD

    # -- helpers (each runs in every spawned rank) --

    def _init(self, reconfigurable=True, **kwargs):
        os.environ["ENGINE_TRANSPORT"] = self.transport
        self.store = dist.FileStore(self.file_name, self.world_size)
        if HAS_RECONFIGURE and reconfigurable:
            kwargs["enable_reconfigure"] = True
        dist.init_process_group("engine", world_size=self.world_size, rank=self.rank, store=self.store,
                                timeout=timedelta(seconds=30), **kwargs)
        self.pg = dist.distributed_c10d._get_default_group()
        self.backend = self.pg._get_backend(torch.device("cpu"))
        self.assertTrue(self.backend.supports_reconfigure)
        if HAS_RECONFIGURE:
            self.assertTrue(dist._supports_reconfigure())
            self.assertIs(dist.get_backend_impl(self.pg, torch.device("cpu")), self.backend)

    def _handle(self, pg=None):
        pg = pg or self.pg
        return dist._get_reconfigure_handle(pg) if HAS_RECONFIGURE else pg.get_reconfigure_handle()

    def _handles(self, key, pg=None):
        self.store.set(f"{key}_{self.rank}", self._handle(pg))
        return [self.store.get(f"{key}_{r}").decode() for r in range(self.world_size)]

    def _barrier(self, key, ranks=None):
        self.store.set(f"{key}_{self.rank}", "1")
        for r in range(self.world_size) if ranks is None else ranks:
            self.store.get(f"{key}_{r}")

    def _reconfigure(self, uuid, handles, pg=None):
        pg = pg or self.pg
        if HAS_RECONFIGURE:
            work = dist._reconfigure(uuid, handles, group=pg, timeout=timedelta(seconds=30))
        else:
            work = pg.reconfigure(SimpleNamespace(uuid=uuid, handles=handles, timeout=timedelta(seconds=30)))
        work.wait()

    def _reconfigured(self, name, uuid):
        self._init()
        self._reconfigure(uuid, self._handles(f"{name}_init"))
        self.assertEqual((dist.get_rank(), dist.get_world_size()), (self.rank, self.world_size))
        self.assertEqual(self.backend.communicator.transport, self.transport)
        return self._handles(f"{name}_post")

    def _sum_is(self, expected, pg=None):
        t = torch.full((5,), dist.get_rank(pg) + 1.0)
        dist.all_reduce(t, group=pg)
        self.assertEqual(t, torch.full((5,), float(expected)))

    def _finish(self, key):
        self._barrier(key)
        dist.destroy_process_group()

    # -- the scenarios --

    def test_reconfigure_then_collectives_and_messages(self):
        self._reconfigured("basic", 200)
        self._sum_is(sum(range(1, WORLD + 1)))
        rank = dist.get_rank()
        out = torch.zeros(4)
        right, left = (rank + 1) % WORLD, (rank - 1) % WORLD
        works = [self.backend.send([torch.full((4,), rank + 1.0)], right, 0), self.backend.recv([out], left, 0)]
        for w in works:
            w.wait()
        self.assertEqual(out, torch.full((4,), left + 1.0))
        gathered = torch.zeros(WORLD * 2)
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
        self.assertEqual(gathered, torch.arange(WORLD).repeat_interleave(2).float())
        self._finish("basic_done")

    def test_shrink_leaving_out_any_rank(self):
        handles = self._reconfigured("shrink", 400)
        for uuid, out in ((401, WORLD - 1), (402, 0)):
            if self.rank == out:
                continue
            survivors = [h for r, h in enumerate(handles) if r != out]
            self._reconfigure(uuid, survivors)
            self.assertEqual(dist.get_world_size(), WORLD - 1)
            self.assertEqual(dist.get_rank(), survivors.index(handles[self.rank]))
            self._sum_is(sum(range(1, WORLD)))
            t = torch.full((3,), 42.0) if dist.get_rank() == 0 else torch.zeros(3)
            dist.broadcast(t, 0)
            self.assertEqual(t, torch.full((3,), 42.0))
            self._reconfigure(uuid + 10, survivors)   # back to a state every member agrees on
        self._finish("shrink_done")

    def test_scale_down_to_one_and_back_up(self):
        self._init()
        self._reconfigure(600 + self.rank, [self._handle()])
        self.assertEqual((dist.get_rank(), dist.get_world_size()), (0, 1))
        self._sum_is(1)
        self._reconfigure(610, self._handles("scale_up"))
        self.assertEqual((dist.get_rank(), dist.get_world_size()), (self.rank, WORLD))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("scale_done")

    def test_late_join_and_split_merge(self):
        self._init()
        handles = self._handles("late_initial")
        if self.rank == 0:
            self._reconfigure(900, handles[:1])
        self._reconfigure(901, self._handles("late_all"))
        self._sum_is(sum(range(1, WORLD + 1)))
        handles = self._handles("split")
        if self.rank < 1:
            self._reconfigure(1000, handles[:1])
        else:
            self._reconfigure(1001, handles[1:])
            self._sum_is(sum(range(1, WORLD)))
        self._reconfigure(1002, self._handles("merge"))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("split_done")

    def test_a_monitored_barrier_after_a_reconfigure_waits_for_the_members_of_now(self):
        """Ranks 0 and 1 reconfigure to the two of them and pass a monitored barrier; all three then
        reconfigure back. Rank 2's first monitored barrier waits for rank 0's (whose barriers it counted
        apart: it read the pair's verdict in the store and returned at once), and every rank's next
        one passes."""
        handles = self._reconfigured("monitored", 1700)
        if self.rank < 2:
            self._reconfigure(1701, handles[:2])
            self.backend.monitored_barrier(timedelta(seconds=20))
        self._reconfigure(1702, handles)
        if self.rank == 0:
            time.sleep(0.5)                 # (rank 2 reaches the barrier first)
            self.store.set("monitored_rank0_calls", "1")
        self.backend.monitored_barrier(timedelta(seconds=20))
        if self.rank == 2:
            self.assertTrue(self.store.check(["monitored_rank0_calls"]), "rank 2 passed before rank 0 arrived")
        self.backend.monitored_barrier(timedelta(seconds=20))
        self._finish("monitored_done")

    def test_a_group_made_from_torchs_table_after_a_reconfigure_that_moved_ranks_is_refused_everywhere(self):
        """A reconfigure swaps ranks 0 and 1 (rank 2 keeps its place): a shrink, made through torch's
        table of the group's ranks, is refused at once on every member (rank 2 compared only its own
        place, went into the store and waited for the others until the group's timeout, 30 s)."""
        handles = self._reconfigured("moved", 1750)
        self._reconfigure(1751, [handles[1], handles[0], handles[2]])
        self.assertEqual(dist.get_rank(), [1, 0, 2][self.rank])
        if self.rank != 1:   # (new rank 0 is left out)
            started = time.monotonic()
            with self.assertRaisesRegex(RuntimeError, r"reconfigured to other members, which torch's table of its "
                                                      r"ranks does not know"):
                self.backend.shrink([0])
            self.assertLess(time.monotonic() - started, 5.0)
        self._sum_is(sum(range(1, WORLD + 1)))
        self._reconfigure(1752, handles)   # (every member in its place again: torch's table holds)
        if self.rank != 2:
            shrunk = self.backend.shrink([2])
            t = torch.full((3,), self.rank + 1.0)
            shrunk.allreduce([t]).wait()
            self.assertEqual(t, torch.full((3,), 3.0))
            shrunk.abort()
        self._finish("moved_done")

    def test_a_set_of_handles_orders_the_ranks_alike_everywhere(self):
        self._init()
        handles = self._handles("set")
        self._reconfigure(1500, set(handles))
        self.assertEqual(dist.get_rank(), sorted(handles).index(handles[self.rank]))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("set_done")

    def test_new_group_after_a_reconfigure(self):
        handles = self._reconfigured("sub", 1600)
        if self.rank != 1:
            self._reconfigure(1601, [handles[0], handles[2]])
        else:
            self._barrier("sub_shrunk")
            dist.destroy_process_group()
            return
        self._barrier("sub_shrunk")
        sub = dist.new_group([0, 1])   # every rank of the shrunk world
        self._sum_is(sum(range(1, 3)), pg=sub)
        dist.destroy_process_group(sub)
        dist.destroy_process_group()

    @unittest.skipIf(TORCH < (2, 15), "torch < 2.15 binds a world to an accelerator only")
    def test_new_groups_of_a_world_bound_to_a_device(self):
        """init_process_group(..., device_id=...): torch then offers new_group the world's backend to split
        from, and from torch 2.14 on puts it in the new group's backend options, which take only a C++
        Backend: every member failed (TypeError), while the rank outside went on. (torch 2.13 and 2.14
        take only an accelerator there; torch 2.15 a CPU too.)"""
        self._init(reconfigurable=False, device_id=torch.device("cpu", 0))
        self.assertEqual(self.pg.bound_device_id, torch.device("cpu", 0))
        pair = dist.new_group([0, 2])
        if self.rank == 1:
            self.assertIs(pair, dist.GroupMember.NON_GROUP_MEMBER)
        else:
            self._sum_is(1 + 2, pg=pair)
            dist.destroy_process_group(pair)
        everyone = dist.new_group(use_local_synchronization=True)
        self._sum_is(sum(range(1, WORLD + 1)), pg=everyone)
        split = dist.split_group(split_ranks=[[0, 1], [2]])
        self._sum_is(1 + 2 if self.rank < 2 else 1, pg=split)
        self._finish("bound_done")

    def test_abort_ends_a_blocked_call_within_a_second_then_reconfigure_recovers(self):
        self._reconfigured("abort", 1200)
        hooks = []
        self.backend.register_abort_hook(2, lambda: 1 / 0)   # first: reported, and the abort goes on
        self.backend.register_abort_hook(0, lambda: hooks.append(time.monotonic()))
        self.backend.register_abort_hook(1, lambda: hooks.append("unregistered"))
        self.backend.unregister_abort_hook(1)
        if self.rank != 2:   # rank 2 never joins: 0 and 1 block until another thread aborts the group
            queued = dist.all_reduce(torch.ones(3), async_op=True)
            queued_too = dist.broadcast(torch.ones(3), 0, async_op=True)
            message = dist.irecv(torch.zeros(2), src=2)
            aborted_at = []
            timer = threading.Timer(1.0, lambda: (aborted_at.append(time.monotonic()), self.backend.abort()))
            timer.start()
            started = time.monotonic()
            # Aborted here, or told first that the peer aborting at the same moment left (TCP's goodbye,
            # shared memory's left word: a rank leaving a group marks it there)
            ended_by = "aborted|left"
            with self.assertRaisesRegex(RuntimeError, ended_by):
                dist.all_reduce(torch.ones(3))
            ended = time.monotonic()
            timer.join()
            self.assertLess(ended - aborted_at[0], 1.0, f"the call ended {ended - aborted_at[0]:.3f} s after abort()")
            self.assertGreater(ended - started, 0.9)
            for work in (queued, queued_too, message):
                with self.assertRaisesRegex(RuntimeError, ended_by + "|unusable"):
                    work.wait()
            with self.assertRaisesRegex(RuntimeError, "reconfigure it with a fresh uuid"):
                dist.all_reduce(torch.ones(3))
            with self.assertRaisesRegex(RuntimeError, "was aborted"):   # (in the store, not the communicator)
                self.pg.monitored_barrier()
            # once at abort(), and once more where the peer's leaving broke the call first (torch's
            # contract: hooks may run more than once per failure); never the unregistered one
            self.assertIn(len(hooks), (1, 2))
            self.assertNotIn("unregistered", hooks)
        else:   # (aborting at once would tell the others over TCP that it left: they would fail sooner)
            time.sleep(1.5)
            self.backend.abort()
        if HAS_RECONFIGURE:
            from torch._C._distributed_c10d import ErrorType
            self.assertEqual(self.backend.get_error(), ErrorType.SUCCESS)
        self._reconfigure(1201, self._handles("abort_recover"))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("abort_done")

    def test_torchs_abort_process_group_ends_a_blocked_call_then_a_new_world_runs(self):
        """torch's own dist.distributed_c10d._abort_process_group() (experimental, documented for NCCL
        only; what a script that recovers by making its world anew calls) from another thread: the call
        blocked on a rank that never arrives ends within a second, every group is gone (a subgroup too),
        and init_process_group over a fresh store makes a world that runs."""
        os.environ["ENGINE_TRANSPORT"] = self.transport
        dist.init_process_group("engine", world_size=self.world_size, rank=self.rank, timeout=timedelta(seconds=30),
                                store=dist.FileStore(self.file_name, self.world_size))
        sub = dist.new_group([0, 1])
        self._sum_is(sum(range(1, WORLD + 1)))
        if self.rank != 2:
            aborted_at = []
            timer = threading.Timer(1.0, lambda: (aborted_at.append(time.monotonic()),
                                                  dist.distributed_c10d._abort_process_group()))
            timer.start()
            with self.assertRaisesRegex(RuntimeError, "aborted|left"):
                dist.all_reduce(torch.ones(3))
            ended = time.monotonic()
            timer.join()
            self.assertLess(ended - aborted_at[0], 1.0, f"the call ended {ended - aborted_at[0]:.3f} s after the abort")
        else:
            time.sleep(1.5)
            dist.distributed_c10d._abort_process_group()
        self.assertFalse(dist.is_initialized())
        self.assertEqual(dist.distributed_c10d._world.pg_map, {})
        if self.rank != 2:
            with self.assertRaisesRegex(RuntimeError, "aborted"):
                sub.allreduce([torch.ones(2)]).wait()
        self.store = dist.FileStore(self.file_name + ".anew", self.world_size)
        dist.init_process_group("engine", world_size=self.world_size, rank=self.rank, timeout=timedelta(seconds=30),
                                store=self.store)
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("abort_pg_done")     # (ForkedRanks removes the new store's file with the first's)

    def test_abort_ends_a_reconfigure_waiting_for_a_member_then_a_reconfigure_recovers(self):
        """A reconfigure whose member never comes (rank 2 does not call it) ends within a second of
        abort() from another thread, on the first member (waiting for hellos) and on the others
        (waiting for its answer), naming the abort; a reconfigure of every rank with a fresh uuid then
        recovers the group."""
        handles = self._reconfigured("abortrc", 1500)
        if self.rank != 2:
            aborted_at = []
            timer = threading.Timer(1.0, lambda: (aborted_at.append(time.monotonic()), self.backend.abort()))
            timer.start()
            with self.assertRaisesRegex(RuntimeError, r"reconfigure 1501 .*was aborted \(abort\(\)\) while this "
                                                      "reconfigure waited for its members"):
                self._reconfigure(1501, handles)
            ended = time.monotonic()
            timer.join()
            self.assertLess(ended - aborted_at[0], 1.0, f"the reconfigure ended {ended - aborted_at[0]:.3f} s after abort()")
        self._barrier("abortrc_observed")
        self._reconfigure(1502, self._handles("abortrc_recover"))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("abortrc_done")

    def test_abort_ends_a_reconfigure_making_its_transport_then_a_reconfigure_recovers(self):
        """Every member met, but rank 2 stalls in the new group's making after its first exchange on the
        transport (TCP: the addresses, after which the others wait in the connecting; shared memory: the
        segment's, after which they wait in the store): abort() on ranks 0 and 1, once they are past that
        exchange, ends their reconfigure within a second, naming the abort (or, on rank 1, the first
        member's), and frees what it made; a reconfigure of every rank then recovers."""
        import engine.bootstrap
        import engine.tcp
        handles = self._reconfigured("abortmk", 1510)
        module = engine.tcp if self.transport == "tcp" else engine.bootstrap
        gather, aborted_at, timers = module.gather, [], []

        def then_stall_or_abort(*args, **kwargs):
            out = gather(*args, **kwargs)
            module.gather = gather
            if self.rank == 2:
                time.sleep(2.0)
            else:
                timers.append(threading.Timer(0.3, lambda: (aborted_at.append(time.monotonic()), self.backend.abort())))
                timers[0].start()
            return out

        module.gather = then_stall_or_abort
        if self.rank == 2:
            with self.assertRaises(RuntimeError):   # (the others left: whatever this rank's making then meets)
                self._reconfigure(1511, handles)
        else:
            # (rank 1 may hear first that rank 0, the hub, aborted: its store's connection closed)
            with self.assertRaisesRegex(RuntimeError, r"reconfigure 1511 .*(was aborted \(abort\(\)\)|the hub "
                                                      r"\(.*\) closed the connection: it failed or was aborted)"):
                self._reconfigure(1511, handles)
            ended = time.monotonic()
            timers[0].join()
            self.assertLess(ended - aborted_at[0], 1.0, f"the reconfigure ended {ended - aborted_at[0]:.3f} s after abort()")
        self._barrier("abortmk_observed")
        self._reconfigure(1512, self._handles("abortmk_recover"))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("abortmk_done")

    def test_an_abort_after_the_members_met_fails_the_reconfigure_rather_than_be_lost(self):
        """abort() from another thread (torchft's timers) that lands once the members met and the new
        group was made, before the group runs on it: the reconfigure fails on that rank, naming the
        abort, and frees what it made (the group stays aborted; its calls raise); where it landed while the group
        swapped its communicator, it waits for the swap and aborts the new one. Every rank then recovers
        with a fresh uuid. (Transport-blind: shared memory only.)"""
        from engine.communicator import Communicator
        if self.transport != "shm":
            return
        handles = self._reconfigured("abortlate", 1520)
        drop_store, freed = Communicator.drop_store, []

        def then_abort(comm):   # (the last step before the group takes the new communicator)
            drop_store(comm)
            Communicator.drop_store = drop_store
            free = comm.free
            comm.free = lambda: (freed.append(comm), free())
            late = threading.Thread(target=self.backend.abort)
            late.start()
            late.join()

        if self.rank == 0:
            Communicator.drop_store = then_abort
            with self.assertRaisesRegex(RuntimeError, r"reconfigure 1521 .*process group '0' was aborted \(abort\(\)\) "
                                                      "while it was reconfigured"):
                self._reconfigure(1521, handles)
            self.assertEqual(len(freed), 1)
            with self.assertRaisesRegex(RuntimeError, "was aborted"):
                dist.all_reduce(torch.ones(2))
        else:
            self._reconfigure(1521, handles)   # (made here: its first call would find rank 0 gone)
        self._barrier("abortlate_observed")
        self._reconfigure(1522, self._handles("abortlate_recover"))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("abortlate_done")

    def test_a_reconfigure_ends_at_its_own_timeout_while_its_ranks_connect(self):
        """Every member met, but rank 2 stalls after its TCP transport is made, before it connects: the
        others' connecting ends at the reconfigure's timeout (2 s), not the group's (30 s), naming it. A
        reconfigure of every rank then recovers. (TCP only: shared memory's making waits in the
        store, which the reconfigure's deadline bounds.)"""
        import engine.tcp
        if self.transport != "tcp":
            return
        handles = self._reconfigured("connectlate", 1530)
        gather = engine.tcp.gather

        def then_stall(boot, make, what):
            out = gather(boot, make, what)
            if what == "make its end of the group's TCP transport":   # (the last exchange before connecting)
                engine.tcp.gather = gather
                time.sleep(4.0)
            return out

        opts = SimpleNamespace(uuid=1531, handles=handles, timeout=timedelta(seconds=2))
        if self.rank == 2:
            engine.tcp.gather = then_stall
            with self.assertRaises(RuntimeError):   # (the others left: whatever its making then meets)
                self.backend.reconfigure(opts)
        else:
            started = time.monotonic()
            # (or, where the other waiting member's deadline passed first and it left: that member named, by
            # the group's making or, on the hub, by the reconfigure's own connection to it)
            with self.assertRaisesRegex(RuntimeError, r"reconfigure 1531 .*(the reconfigure's timeout \(2 s\) passed "
                                                      r"while the new group was made|the hub .* ended|"
                                                      r"rank [01] \(.*\) left the group|member 1 \(.*\) closed its "
                                                      r"connection before the group was made: it gave the making up)"):
                self.backend.reconfigure(opts)
            took = time.monotonic() - started
            self.assertLess(took, 10.0, f"the reconfigure took {took:.1f} s: its connecting waited the group's timeout")
        self._barrier("connectlate_observed")
        self._reconfigure(1532, self._handles("connectlate_recover"))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("connectlate_done")

    def test_a_shrink_retried_after_a_failed_one_meets_the_others_retry(self):
        """A shrink that fails on every member (rank 0 could not read its settings, once) and is retried
        by both, rank 0 a second after rank 1: the retry meets under keys of its own, where it would read
        the failed attempt's (rank 0's old error) and fail again at once, then wait for ever. (Transport-blind:
        shared memory only.)"""
        import engine.communicator
        if self.transport != "shm":
            return
        self._reconfigured("shrinkretry", 1540)
        if self.rank == 2:   # (left out: it sits the shrinks out)
            self._finish("shrinkretry_end")
            return
        host_identity = engine.communicator.host_identity

        def fails_once():
            engine.communicator.host_identity = host_identity
            raise OSError("injected: a transient failure")

        if self.rank == 0:
            engine.communicator.host_identity = fails_once
        with self.assertRaisesRegex(RuntimeError, "injected: a transient failure"):
            self.backend.shrink([2])
        if self.rank == 0:
            time.sleep(1.0)
        shrunk = self.backend.shrink([2])
        t = torch.full((3,), self.rank + 1.0)
        shrunk.allreduce([t]).wait()
        self.assertEqual(t, torch.full((3,), 3.0))
        shrunk.abort()
        self._finish("shrinkretry_end")

    def test_a_shrink_in_a_second_world_on_the_same_store_meets_under_its_own_keys(self):
        """A world made, reconfigured and shrunk, destroyed, then made again on the same store (as
        torchrun's agent's outlives the worlds of one attempt), reconfigured and shrunk alike: the
        second shrink meets under keys of its own making (on torch 2.14, whose groups wait for their
        first reconfigure, it read the first world's: its members' addresses, long gone)."""
        for world in range(2):
            self._reconfigured(f"shrink2w{world}", 1580 + world)
            if self.rank < 2:
                shrunk = self.backend.shrink([2])
                t = torch.full((3,), self.rank + 1.0)
                shrunk.allreduce([t]).wait()
                self.assertEqual(t, torch.full((3,), 3.0))
                shrunk.abort()
            self._finish(f"shrink2w{world}_end")

    def test_abort_ends_a_shrink_waiting_for_a_member(self):
        """abort() from another thread ends a shrink that waits in the store for a member that never
        comes (rank 1 makes no shrink), within a second of the abort, naming it, where the shrink waited
        the group's timeout (30 s) in torch's store, which nothing interrupts."""
        self._reconfigured("shrinkabort", 1560)
        if self.rank == 0:
            timer = threading.Timer(1.0, self.backend.abort)
            timer.start()
            started = time.monotonic()
            with self.assertRaisesRegex(RuntimeError, r"engine shrink of process group .* without ranks \[2\]: process "
                                                      r"group .* was aborted \(abort\(\)\) while this shrink waited"):
                self.backend.shrink([2])
            took = time.monotonic() - started
            timer.join()
            self.assertLess(took, 5.0, f"the shrink took {took:.1f} s after abort() at 1 s")
        self._finish("shrinkabort_end")

    def test_a_member_coming_to_a_shrink_the_others_aborted_fails_at_once_naming_it(self):
        """Rank 0's shrink is aborted (abort() at 1 s) while it waits for rank 1, which comes 2.5 s in:
        rank 1 fails at once naming rank 0 and the abort, where it went on to the shrink's next exchange
        and waited there for rank 0 until the group's timeout, then named it as never joined."""
        self._reconfigured("shrinklate", 1570)
        if self.rank == 0:
            timer = threading.Timer(1.0, self.backend.abort)
            timer.start()
            with self.assertRaisesRegex(RuntimeError, r"was aborted \(abort\(\)\) while this shrink waited"):
                self.backend.shrink([2])
            timer.join()
        elif self.rank == 1:
            time.sleep(2.5)
            started = time.monotonic()
            with self.assertRaisesRegex(RuntimeError, r"rank 0 gave this making up before this rank came \(its making "
                                                      r"was cancelled \(process group .* was aborted \(abort\(\)\)"):
                self.backend.shrink([2])
            took = time.monotonic() - started
            self.assertLess(took, 5.0, f"the late member's shrink took {took:.1f} s")
        self._finish("shrinklate_end")

    def test_every_survivor_names_the_rank_that_aborted_not_a_peer_that_gave_up_after_it(self):
        """A rank aborts a group whose other ranks wait for it in an all_reduce, round after round. Over
        TCP a survivor that read the other survivor's goodbye first named that one alone (`rank 2 gave
        the group up while rank 1 ran this`): a probing helper's runs, 3 of 5. A goodbye now names the
        rank whose giving up it followed, and the survivor names that rank first."""
        self._init()
        for round in range(6):
            group, aborts = dist.new_group(list(range(WORLD))), round % WORLD
            self._barrier(f"named_{round}")
            if self.rank == aborts:
                time.sleep(0.2)   # (the others in the call; where they come later they fail alike at once)
                group._get_backend(torch.device("cpu")).abort()
            else:
                with self.assertRaisesRegex(RuntimeError, rf"rank {aborts} \([^)]*\) (left|gave) the group") as caught:
                    dist.all_reduce(torch.ones(1000), group=group)
                self.assertNotRegex(str(caught.exception), rf"rank [^{aborts}] \([^)]*\) gave the group up while",
                                    f"round {round}")
            dist.destroy_process_group(group)
        self._finish("named_done")

    def test_a_timed_out_call_runs_the_abort_hooks_then_reconfigure_recovers(self):
        """torch's contract for a call that times out (test_reconfigure_after_timeout, which torch runs
        on nccl2 only): the abort hooks run, get_error() says TIMEOUT, and the group refuses the next
        call when it is made, asynchronous ones included; a reconfigure recovers."""
        self._reconfigured("timeout", 1300)
        self._sum_is(sum(range(1, WORLD + 1)))
        self.backend.set_timeout(timedelta(seconds=2))
        ran = threading.Event()
        self.backend.register_abort_hook(0, ran.set)
        self.backend.register_abort_hook(1, lambda: 1 / 0)   # reported; the call still raises its own error
        if self.rank != 0:   # rank 0 never joins
            work = dist.all_reduce(torch.ones(4), async_op=True)
            self.assertTrue(ran.wait(10), "the abort hooks did not run after the call timed out")
            if HAS_RECONFIGURE:
                from torch._C._distributed_c10d import ErrorType
                self.assertEqual(self.backend.get_error(), ErrorType.TIMEOUT)
            # (its own timeout, or, over TCP, a peer's that came first: it needed that peer too)
            own_or_peers = "(Timed out after|gave the group up while rank .* its call timed out there)"
            with self.assertRaisesRegex(RuntimeError, "unusable after an earlier call timed out .*" + own_or_peers):
                dist.all_reduce(torch.ones(4), async_op=True)
            with self.assertRaisesRegex(RuntimeError, "unusable after an earlier call timed out"):
                dist.broadcast(torch.ones(4), 0)
            with self.assertRaisesRegex(RuntimeError, r"allreduce #2 of group '0' \(rank \d of 3\): Timed out after|"
                                                      r"allreduce failed: .*" + own_or_peers):
                work.wait()
        self.backend.unregister_abort_hook(0)
        self.backend.unregister_abort_hook(1)
        self.backend.set_timeout(timedelta(seconds=30))
        self._barrier("timeout_observed")
        self._reconfigure(1301, self._handles("timeout_recover"))
        self._sum_is(sum(range(1, WORLD + 1)))
        if HAS_RECONFIGURE:
            from torch._C._distributed_c10d import ErrorType
            self.assertEqual(self.backend.get_error(), ErrorType.SUCCESS)
        self._finish("timeout_done")

    def test_a_collective_mismatch_runs_the_abort_hooks_where_it_is_seen(self):
        """Rank 0 calls all_reduce where the others call broadcast: rank 0's call fails naming the
        mismatch (the others' may complete among themselves), and on each rank whose call failed the
        abort hooks run once and the group refuses the next collective; a reconfigure recovers it."""
        self._reconfigured("mismatch", 1400)
        ran = []
        self.backend.register_abort_hook(0, lambda: ran.append(time.monotonic()))
        t = torch.ones(4)
        try:
            if self.rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, 1)
            failed = False
        except RuntimeError as exc:
            self.assertRegex(str(exc), "mismatch|another collective|different collective")
            failed = True
        if self.rank == 0:
            self.assertTrue(failed, "rank 0's all_reduce met the others' broadcast and did not fail")
        self.assertEqual(len(ran), int(failed))
        if failed:
            if HAS_RECONFIGURE:
                from torch._C._distributed_c10d import ErrorType
                self.assertEqual(self.backend.get_error(), ErrorType.REMOTE_ERROR)
            with self.assertRaisesRegex(RuntimeError, "this group is unusable after"):
                dist.all_reduce(t, async_op=True)
        self.backend.unregister_abort_hook(0)
        self._barrier("mismatch_observed")
        self._reconfigure(1401, self._handles("mismatch_recover"))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("mismatch_done")

    def test_a_mismatch_seen_by_one_rank_ends_every_call_once_it_aborts(self):
        """In a reconfigured group (no store whose arrival notes would tell): rank 0 calls a 1 MB
        all_reduce where ranks 1 and 2 broadcast from rank 0 (as scripts/fault_soak.py drew it). Over
        TCP only rank 1 hears of it (rank 0's ring sends it a part of the all_reduce), while ranks 0 and
        2 wait on each other. Each rank whose call fails aborts (torchft's way): a rank whose group
        failed says so in its goodbye, and its peers' calls end within seconds, not at the group's
        timeout (30 s). On shared memory each rank sees the others' signatures at once."""
        self._reconfigured("soakmismatch", 1700)
        started = time.monotonic()
        with self.assertRaisesRegex(RuntimeError, "mismatch|another collective|gave the group up"):
            if self.rank == 0:   # (numpy's memory: torch would fill 1 MB on OpenMP threads, which hang in a
                dist.all_reduce(torch.from_numpy(np.ones(1 << 18, np.float32)))   # rank forked after they ran)
            else:
                dist.broadcast(torch.ones(42, dtype=torch.int64), 0)
        self.backend.abort()
        self.assertLess(time.monotonic() - started, 10.0)
        self._barrier("soakmismatch_observed")
        self._reconfigure(1701, self._handles("soakmismatch_recover"))
        self._sum_is(sum(range(1, WORLD + 1)))
        self._finish("soakmismatch_done")

    def test_shrink_group_leaves_out_a_live_rank_then_a_dead_one(self):
        """dist.shrink_group: of a subgroup, leaving out a rank that is idle (the group is kept on it);
        then of the world, leaving out a rank that died (os._exit, the calls in flight on the others
        failing first, a recv on one and an all_reduce on the other: each runs the abort hooks once and
        the group refuses its next collective) with SHRINK_ABORT. The ranks left out are in the middle: torch's table of the
        new group's world ranks is the engine's (torch's own takes group ranks for world ranks). The
        shrunk world serves collectives, new groups, monitored_barrier and DDP with the engine's hook."""
        self._reconfigured("shrinkg", 1700)
        sub = dist.new_group([1, 2])
        if self.rank == 2:                            # sub without its rank 0 (world rank 1, idle)
            # (flags it does not know, and another backend's options, are refused; a Backend.Options'
            # timeout is the new group's: they were not read)
            from torch._C._distributed_c10d import Backend

            class Other(Backend.Options):
                pass
            with self.assertRaisesRegex(ValueError, "shrink_flags 2 has bits the engine does not know"):
                sub.shrink([0], 2)
            with self.assertRaisesRegex(ValueError, r"pg_options is a .*Other, another backend's options"):
                dist.shrink_group([0], group=sub, pg_options=Other("engine"))
            options = Backend.Options("engine")
            options._timeout = timedelta(seconds=7)
            shrunk = dist.shrink_group([0], group=sub, pg_options=options)
            self.assertEqual(shrunk._timeout_seconds(), 7.0)
            self.assertEqual((shrunk.rank(), shrunk.size(), dist.get_rank(shrunk)), (0, 1, 0))
            self.assertEqual(dist.get_process_group_ranks(shrunk), [2])
            self.assertEqual(dist.get_backend(shrunk), "engine")
            self._sum_is(1, pg=shrunk)
            dist.destroy_process_group(shrunk)
        self._barrier("shrinkg_sub")
        self._sum_is(sum(range(1, WORLD + 1)))      # the world is untouched
        hooks = []
        self.backend.register_abort_hook(0, lambda: hooks.append(time.monotonic()))
        if self.rank == 1:
            os._exit(0)                               # dies without leaving: no goodbye, no atexit
        with self.assertRaisesRegex(RuntimeError, r"rank 1 \("):
            if self.rank == 0:    # a message from the dead rank breaks the group as a collective does
                dist.recv(torch.zeros(2), src=1)
            else:
                dist.all_reduce(torch.ones(3))
        self.assertEqual(len(hooks), 1, "the abort hooks did not run once where the lost peer broke the call")
        with self.assertRaisesRegex(RuntimeError, r"this group is unusable after a peer was lost \(.*rank 1 \("):
            dist.all_reduce(torch.ones(3), async_op=True)
        if HAS_RECONFIGURE:   # (a peer that died: whichever way the transport saw it)
            from torch._C._distributed_c10d import ErrorType
            self.assertEqual(self.backend.get_error(), ErrorType.REMOTE_ERROR)
        self.backend.unregister_abort_hook(0)
        self._barrier("shrinkg_failed", ranks=(0, 2))   # (neither leaves before the other's call failed)
        dist.shrink_group([1], shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
        self.assertEqual((dist.get_rank(), dist.get_world_size()), ([0, 2].index(self.rank), 2))
        self.assertEqual(dist.get_process_group_ranks(dist.group.WORLD), [0, 1])
        self._sum_is(1 + 2)
        out = torch.zeros(4)
        work = dist.all_gather_into_tensor(out, torch.full((2,), float(dist.get_rank())), async_op=True)
        work.wait()
        self.assertEqual(out, torch.tensor([0.0, 0.0, 1.0, 1.0]))
        for _ in range(2):   # (torch names them from 0 again, in the store where `sub` was made as "1")
            pair = dist.new_group([0, 1])
            self.assertEqual(dist.get_rank(pair), dist.get_rank())
            self._sum_is(1 + 2, pg=pair)
        dist.group.WORLD.monitored_barrier()    # (dist.monitored_barrier refuses all but Gloo on torch 2.13)
        self._ddp_trains_like_one_process()   # (torch would register a shrunk backend on the CPU as Gloo's)
        dist.destroy_process_group()

    def _ddp_trains_like_one_process(self):
        rank, size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model, alone = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
        alone.load_state_dict(model.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, torchbridge.hooks.allreduce_hook)   # (the engine behind torch's group)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, alone)]
        for step in range(3):
            batch = torch.randn(4 * size, 6, generator=torch.Generator().manual_seed(step))
            for opt, net, x in zip(opts, (ddp, alone), (batch[4 * rank:4 * rank + 4], batch)):
                opt.zero_grad()
                net(x).pow(2).mean().backward()
                opt.step()
        for mine, theirs in zip(model.parameters(), alone.parameters()):
            torch.testing.assert_close(mine, theirs)

    def test_reused_uuid_and_foreign_handles_are_refused(self):
        self._init()
        if HAS_RECONFIGURE:   # (made with enable_reconfigure=True: members come with the first reconfigure)
            with self.assertRaisesRegex(RuntimeError, "was made with enable_reconfigure=True and has no members "
                                                      r"until its first reconfigure: call dist._reconfigure"):
                dist.all_reduce(torch.ones(2))
        uuid = 1100 + self.rank
        self._reconfigure(uuid, [self._handle()])
        with self.assertRaisesRegex(RuntimeError, "already used"):
            self._reconfigure(uuid, [self._handle()])
        with self.assertRaisesRegex(ValueError, "not a reconfigure handle of backend 'engine'"):
            self._reconfigure(uuid + 10, ["gloo-handle", self._handle()])
        mine = self._handle()
        stranger = mine[:-2] + ("11" if mine.endswith("00") else "00")   # well formed, but not this process's
        with self.assertRaisesRegex(ValueError, "not among the handles"):
            self._reconfigure(uuid + 20, [stranger])
        with self.assertRaisesRegex(ValueError, "outside int64's range"):   # (was struct.error, the hub waiting)
            self.backend.reconfigure(SimpleNamespace(uuid=1 << 64, handles=[self._handle()]))
        # members passing different lists: the hub (the first handle's) refuses the member whose list is
        # not its own, and that member fails at once naming both; the hub waits its timeout for a member 1
        # with its list, and names it
        handles = self._handles("lists")
        if self.rank < 2:
            mine = handles[:2] if self.rank == 0 else handles
            expected = (r"engine reconfigure 1300 of group '0': members \[1\] \(.*\) never connected to this rank, "
                        "the hub" if self.rank == 0 else
                        r"this reconfigure's hub was given 2 handles, and another list than member 1's \(3 handles\): "
                        "every member must pass the same handles in the same order")
            start = time.monotonic()
            with self.assertRaisesRegex(RuntimeError, expected):
                self.backend.reconfigure(SimpleNamespace(uuid=1300, handles=mine, timeout=timedelta(seconds=5)))
            self.assertLess(time.monotonic() - start, 4 if self.rank == 1 else 15)   # (the refused one: not at 5 s)
        self._finish("refused_done")


class EngineShmFaultToleranceTest(FaultToleranceScenarios, MultiProcessTestCase):
    transport = "shm"


class EngineTcpFaultToleranceTest(FaultToleranceScenarios, MultiProcessTestCase):
    transport = "tcp"


def _started(fn):
    """fn() in a thread of its own, started: (the thread, [(when fn ended, what it raised or None)])."""
    outcome = []

    def run():
        try:
            fn()
            outcome.append((time.monotonic(), None))
        except Exception as exc:
            outcome.append((time.monotonic(), exc))

    side = threading.Thread(target=run)
    side.start()
    return side, outcome


def test_a_members_multi_get_sends_every_request_before_it_reads_a_reply():
    """A reconfigure's member reads an exchange's keys from the hub in one round trip: one send of every
    request, then the values in the order asked, each once the hub's side sets it (here in the other
    order); a key never set ends the read at the hub's deadline, naming the key."""
    from engine import handles

    hub_listener, member_listener = handles.Listener(), handles.Listener()
    members = [hub_listener.handle, member_listener.handle]
    met = {}
    hub_side = threading.Thread(target=lambda: met.update(hub=handles.meet(hub_listener, 5, members, 3)[0]))
    hub_side.start()
    store, index, n = handles.meet(member_listener, 5, members, 30)
    hub_side.join()
    hub = met["hub"]

    class Counted:   # the member's socket, counting its sends
        def __init__(self, sock):
            self.sock, self.sends = sock, 0

        def sendall(self, data):
            self.sends += 1
            return self.sock.sendall(data)

        def __getattr__(self, name):
            return getattr(self.sock, name)

    try:
        store.sock = Counted(store.sock)
        setter = threading.Thread(target=lambda: [hub.set(k, f"value of {k}") for k in ("c", "b", "a")])
        setter.start()
        assert store.multi_get(["a", "b", "c"]) == [b"value of a", b"value of b", b"value of c"]
        setter.join()
        assert store.sock.sends == 1
        with pytest.raises(TimeoutError, match="no member set 'never' in time"):
            store.multi_get(["a", "never"])
    finally:
        store.close(made=False)
        hub.close(time.monotonic() + 1, made=False)
        hub_listener.close()
        member_listener.close()


def test_a_handle_that_does_not_prove_its_secret_is_closed_unread():
    """The hub reads a hello's secret first and closes a connection whose secret is wrong, whatever it
    sends next; a right one for a uuid not yet reached is kept for it."""
    import socket

    from engine import handles

    listener = handles.Listener()
    addr, port, secret, _ = handles.parse_handle(listener.handle)
    try:
        bad = socket.create_connection((addr, port))
        bad.sendall(handles._HELLO.pack(handles.MAGIC, b"x" * 16, 7, 1, 2, b"d" * 32) + b"junk" * 100)
        good = socket.create_connection((addr, port))
        good.sendall(handles.member_hello(secret, 8, 1, 2, b"d" * 32))
        with pytest.raises(TimeoutError, match=r"members \[1\]"):
            listener.accept_members(7, 2, b"d" * 32, time.monotonic() + 1.5, [listener.handle, listener.handle],
                                    handles.Meeting(listener))
        bad.settimeout(5)
        try:
            assert bad.recv(1) == b""      # closed, nothing answered (or reset: what it sent was never read)
        except ConnectionResetError:
            pass
        assert 1 in listener.parked[8]     # kept for reconfigure 8
        conns = listener.accept_members(8, 2, b"d" * 32, time.monotonic() + 5, [listener.handle] * 2, handles.Meeting(listener))
        assert list(conns) == [1]
        conns[1].close()
        good.close()
        bad.close()
    finally:
        listener.close()


def test_a_member_behind_more_silent_connections_than_the_hub_keeps_is_heard():
    """MAX_PARKED + 40 connections to the hub that never say a word (a stray client), then a member's
    hello: the silent ones waiting longest make room, and the member is taken (the hub closed every new
    connection once MAX_PARKED waited: the member heard 'the hub closed the connection')."""
    import socket

    from engine import handles

    listener = handles.Listener()
    addr, port, secret, _ = handles.parse_handle(listener.handle)
    got, silent = {}, []

    def accept():
        try:
            got["conns"] = listener.accept_members(9, 2, b"d" * 32, time.monotonic() + 20, [listener.handle] * 2,
                                                   handles.Meeting(listener))
        except Exception as exc:
            got["conns"] = exc

    side = threading.Thread(target=accept)
    side.start()
    try:
        silent = [socket.create_connection((addr, port), timeout=10) for _ in range(handles.MAX_PARKED + 40)]
        good = socket.create_connection((addr, port))
        silent.append(good)
        good.sendall(handles.member_hello(secret, 9, 1, 2, b"d" * 32))
        side.join(25)
        conns = got.get("conns")
        assert isinstance(conns, dict), conns
        assert list(conns) == [1]
        conns[1].close()
    finally:
        for conn in silent:
            conn.close()
        listener.close()


@pytest.mark.skipif(not HAS_RECONFIGURE, reason="a process joins a group through reconfigure from torch 2.14")
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_process_that_replaced_a_dead_rank_meets_the_others_in_the_groups_store(transport):
    """tests/faults/replaced_rank.py: rank 2 dies and a new process takes its place through reconfigure;
    then monitored_barrier, new_group, split_group and shrink_group on the three, new_group in the
    shrunk world, and the world made again. The newcomer's making counted ahead of the others' (the
    dead rank counted too), and each call met under keys of each member's own making, or of its own
    count of worlds: every one ended at the timeout (10 s; split_group and new_group, torch's 30
    minutes). The reconfigure checks that its members share the group's store, and those calls meet
    under its membership, and the world's shrinks since, which every member names alike; it counts
    the members' makings of the world alike: each is done within seconds."""
    import sys

    script = os.path.join(os.path.dirname(__file__), "faults", "replaced_rank.py")
    proc = run_launcher([sys.executable, script, transport], 300)
    out = proc.stdout + proc.stderr
    done = re.findall(r"rank (\d) (\w+): ok", out)
    splits = TORCH >= (2, 15)   # (torch 2.14 splits no CPU group)
    calls = ("monitored_barrier", "new_group", "shrink_group", "new_group_after_shrink", "world_made_again") + (
        ("split_group",) if splits else ())
    assert sorted(done) == sorted((str(r), call) for r in range(3) for call in calls), out[-5000:]


@pytest.mark.skipif(not HAS_RECONFIGURE, reason="a process joins a group through reconfigure from torch 2.14")
def test_a_world_shrunk_then_joined_by_a_newcomer_is_made_again_in_one_making():
    """tests/faults/shrunk_then_replaced.py: ranks 0 and 1 shrink the world past dead rank 2, a new
    process joins them through reconfigure, then each makes the world again with its rank from the
    reconfigure. The shrunk world's reconfigure looked for its members' word, and counted their makings,
    in the shrink's part of the store: the newcomer's store looked unshared and the world made again
    met in two makings, each side waiting for the other until the timeout."""
    import sys

    script = os.path.join(os.path.dirname(__file__), "faults", "shrunk_then_replaced.py")
    proc = run_launcher([sys.executable, script, "shm"], 300)
    out = proc.stdout + proc.stderr
    done = re.findall(r"rank (\d) (\w+): ok", out)
    steps = [(str(r), "shrink") for r in (0, 1)] + [(str(r), s) for r in range(3) for s in ("reconfigure",
                                                                                          "world_made_again")]
    assert sorted(done) == sorted(steps), out[-5000:]


def test_a_silent_connection_closing_as_another_takes_its_place_is_not_read():
    """MAX_PARKED silent connections wait; one more comes as the one waiting longest closes, both seen in
    one select: the accept drops the oldest to make room, and its own event (its close) is not read as a
    waiting connection's (KeyError out of accept_members: any client, with no secret, failed the
    reconfigure on every member). The hellos are driven here, so that both events meet in one poll."""
    import socket

    from engine import handles

    listener = handles.Listener()
    addr, port, _, _ = handles.parse_handle(listener.handle)
    silent = []
    try:
        with handles._Hellos(listener.sock, listener.unsaid) as hellos:
            for _ in range(handles.MAX_PARKED):
                silent.append(socket.create_connection((addr, port), timeout=10))
                hellos.poll(0)   # (accepted as they come: the listen backlog holds fewer)
            deadline = time.monotonic() + 10
            while len(listener.unsaid) < handles.MAX_PARKED and time.monotonic() < deadline:
                hellos.poll(0.05)
            oldest = next(iter(listener.unsaid)).getpeername()
            silent.append(socket.create_connection((addr, port), timeout=10))
            next(s for s in silent if s.getsockname() == oldest).close()
            time.sleep(0.1)   # (both events queued before the next poll)
            assert hellos.poll(0.5) == []
            assert len(listener.unsaid) == handles.MAX_PARKED
    finally:
        for conn in silent:
            conn.close()
        listener.close()


def test_whatever_listens_at_the_hubs_address_learns_no_secret_and_is_not_believed():
    """A member connects to the hub's handle, where another process listens (one that took the port of
    a hub that ended): its hello carried the hub's secret, and whatever answered was believed (the
    store's values a group is made of). Now the hello proves the secret without it, and the member
    checks the hub's own proof before it reads an answer."""
    import socket

    from engine import handles

    listener = handles.Listener()
    stranger = socket.create_server(("127.0.0.1", 0))
    secret = os.urandom(16)
    hub = f"engine2/127.0.0.1/{stranger.getsockname()[1]}/{secret.hex()}/{handles.this_host()}"
    heard = {}

    def answer():
        conn, _ = stranger.accept()
        heard["hello"] = handles._recv_exact(conn, handles._HELLO.size, "hello")
        conn.sendall(bytes(16) + handles._REPLY.pack(handles.OK, 5) + b"30.00")   # (a forged proof, then "OK")
        heard["conn"] = conn

    side = threading.Thread(target=answer)
    side.start()
    try:
        with pytest.raises(ConnectionError, match=r"did not prove the handle's secret: it is not the hub"):
            handles.MemberStore(hub, 5, 1, 2, b"d" * 32, time.monotonic() + 5, handles.Meeting(listener))
        side.join(5)
        assert secret not in heard["hello"]
    finally:
        if "conn" in heard:
            heard["conn"].close()
        stranger.close()
        listener.close()


def test_members_of_reconfigures_the_hub_never_reached_that_gave_up_make_room_for_a_later_one():
    """MAX_PARKED members of other reconfigures (uuids the hub never reaches: each is parked for its own)
    say their hello while the hub meets reconfigure 20, and give up (they close, as a member does at its
    deadline). A member of reconfigure 22 then says its hello early, while the hub meets 21: it is parked
    for 22, and taken there. The members that gave up stayed parked until the listener closed, so in a
    long-lived process the hub closed every early member past MAX_PARKED ('the hub closed the
    connection'), and reconfigure 22 timed out."""
    import socket

    from engine import handles

    listener = handles.Listener()
    addr, port, secret, _ = handles.parse_handle(listener.handle)
    got, gone = {}, []

    def meet(uuid, seconds=20):
        try:
            got[uuid] = listener.accept_members(uuid, 2, b"d" * 32, time.monotonic() + seconds,
                                                [listener.handle] * 2, handles.Meeting(listener))
        except Exception as exc:
            got[uuid] = exc

    def hello(uuid):
        conn = socket.create_connection((addr, port), timeout=10)
        conn.sendall(handles.member_hello(secret, uuid, 1, 2, b"d" * 32))
        return conn

    try:
        side = threading.Thread(target=meet, args=(20,))
        side.start()
        gone = [hello(1000 + k) for k in range(handles.MAX_PARKED)]
        good = [hello(20)]
        side.join(25)
        assert list(got[20]) == [1], got
        assert sum(len(v) for v in listener.parked.values()) == handles.MAX_PARKED
        for conn in gone:
            conn.close()
        good += [hello(22), hello(21)]   # (22's first: read, and parked, while the hub meets 21)
        for uuid in (21, 22):
            meet(uuid, 5)
            assert isinstance(got[uuid], dict) and list(got[uuid]) == [1], (uuid, got[uuid])
        assert sum(len(v) for v in listener.parked.values()) == 0, "the parked members that gave up stayed"
    finally:
        for conn in gone + good + [c for v in got.values() if isinstance(v, dict) for c in v.values()]:
            conn.close()
        listener.close()


def test_an_abort_from_a_signal_handler_inside_the_swap_leaves_the_group_aborted():
    """abort() from a signal handler that runs in the reconfiguring thread while it swaps communicators
    (between taking the old one off and attaching the new one; the swap's lock lets it in): the
    reconfigure fails and the group stays aborted (the abort ended the stand-in, and the group then
    ran on the new communicator)."""
    import signal

    from engine.communicator import Communicator
    from torchbridge.process_group import EngineProcessGroup

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(comm, 0, 1, store=dist.HashStore(), name="g")
    detach = pg._detach

    def detach_then_signal(error, abort=True):
        taken = detach(error, abort)
        if error is None:
            signal.raise_signal(signal.SIGUSR1)
        return taken

    previous = signal.signal(signal.SIGUSR1, lambda *_: pg.abort())
    pg._detach = detach_then_signal
    try:
        with pytest.raises(RuntimeError, match=r"reconfigure 35 of group 'g': process group 'g' was aborted "
                                               r"\(abort\(\)\) while it was reconfigured"):
            pg.reconfigure(SimpleNamespace(uuid=35, handles=[pg.get_reconfigure_handle()],
                                           timeout=timedelta(seconds=30)))
        del pg._detach
        with pytest.raises(RuntimeError, match="was aborted"):
            pg.allreduce([torch.ones(3)]).wait()
        pg.reconfigure(SimpleNamespace(uuid=36, handles=[pg.get_reconfigure_handle()], timeout=timedelta(seconds=30)))
        t = torch.ones(3)
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.ones(3))
    finally:
        signal.signal(signal.SIGUSR1, previous)
        pg.shutdown()


def test_destroying_a_group_ends_its_reconfigure_in_flight_and_it_stays_destroyed():
    """shutdown() (destroy_process_group) from another thread while the group's reconfigure waits for
    its first member: the reconfigure ends at once, saying so, and the group stays without a
    communicator (it waited for its timeout, and one that completed would have run the destroyed group
    on a new communicator)."""
    from engine import handles
    from engine.communicator import Communicator
    from torchbridge.process_group import EngineProcessGroup

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(comm, 0, 1, store=dist.HashStore(), name="g")
    hub = handles.Listener()   # (a first member that never meets: its hello waits unanswered)
    try:
        side, outcome = _started(lambda: pg.reconfigure(SimpleNamespace(
            uuid=34, handles=[hub.handle, pg.get_reconfigure_handle()], timeout=timedelta(seconds=6))))
        time.sleep(0.5)
        ended = time.monotonic()
        pg.shutdown()
        side.join(20)
        assert outcome and isinstance(outcome[0][1], RuntimeError), outcome
        assert re.search(r"reconfigure 34 of group 'g': process group 'g' was shut down \(destroy_process_group\) "
                         r"while this reconfigure waited for its members", str(outcome[0][1])), outcome
        assert outcome[0][0] - ended < 2.0, outcome
        assert pg._comm is None
    finally:
        hub.close()


def test_a_member_of_the_next_reconfigure_connecting_while_the_last_one_ends_is_kept_for_it():
    """The hub accepted a connection whose hello (for the next reconfigure) had not all come when the
    meeting it served was complete: the rest of the hello is read in the next meeting, which admits it
    (the connection was closed, and that member's reconfigure failed: "the hub closed the
    connection")."""
    import socket

    from engine import handles

    listener = handles.Listener()
    addr, port, secret, _ = handles.parse_handle(listener.handle)
    early_hello = handles.member_hello(secret, 42, 1, 2, b"e" * 32)
    try:
        early = socket.create_connection((addr, port))        # (first in the backlog: accepted first)
        early.sendall(early_hello[:10])
        member = socket.create_connection((addr, port))
        member.sendall(handles.member_hello(secret, 41, 1, 2, b"d" * 32))
        conns = listener.accept_members(41, 2, b"d" * 32, time.monotonic() + 5, [listener.handle] * 2,
                                        handles.Meeting(listener))
        assert list(conns) == [1]
        early.sendall(early_hello[10:])
        conns2 = listener.accept_members(42, 2, b"e" * 32, time.monotonic() + 3, [listener.handle] * 2,
                                         handles.Meeting(listener))
        assert list(conns2) == [1]
        for c in (conns[1], conns2[1], early, member):
            c.close()
    finally:
        listener.close()


def test_a_silent_connection_holds_up_neither_the_members_nor_abort():
    """Anything may connect to a handle's port: one that connects and says nothing, or a byte at a
    time, is read beside the members, not before them. The hub admits the member behind it at once,
    and abort() during the meet ends it within a tick, both well inside the hello's 10 s."""
    import socket

    from engine import handles

    listener = handles.Listener()
    addr, port, secret, _ = handles.parse_handle(listener.handle)
    strangers = [socket.create_connection((addr, port)) for _ in range(2)]
    try:
        strangers[1].sendall(b"E")   # (a trickle: the first byte of a hello)
        member = socket.create_connection((addr, port))
        member.sendall(handles.member_hello(secret, 9, 1, 2, b"d" * 32))
        started = time.monotonic()
        conns = listener.accept_members(9, 2, b"d" * 32, started + 30, [listener.handle] * 2, handles.Meeting(listener))
        assert list(conns) == [1] and time.monotonic() - started < 5.0
        conns[1].close()
        member.close()
        meeting = handles.Meeting(listener)
        timer = threading.Timer(0.3, meeting.cancel, ["aborted"])
        timer.start()
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="aborted"):
            listener.accept_members(10, 2, b"d" * 32, started + 30, [listener.handle] * 2, meeting)
        assert time.monotonic() - started < 5.0
        timer.join()
    finally:
        for s in strangers:
            s.close()
        listener.close()


def test_a_member_hears_the_first_members_reason_naming_who_never_came():
    """Member 2 of 3 never comes. Member 1 started first, so its deadline falls before the hub's: it
    still waits for the hub's answer, which names member 2, rather than blame the hub for not answering."""
    from engine import handles

    listeners = [handles.Listener() for _ in range(3)]
    members = [lst.handle for lst in listeners]
    outcome = {}

    def member():
        try:
            handles.meet(listeners[1], 11, members, 1.0)
        except Exception as exc:
            outcome["member"] = f"{type(exc).__name__}: {exc}"

    side = threading.Thread(target=member)
    side.start()
    time.sleep(0.3)
    try:
        with pytest.raises(TimeoutError, match=r"members \[2\]"):
            handles.meet(listeners[0], 11, members, 1.0)
        side.join(10)
        assert re.search(r"ConnectionError: the hub \(.*\) ended this reconfigure: members \[2\] .*never "
                         r"connected", outcome["member"]), outcome
    finally:
        for lst in listeners:
            lst.close()


def test_a_member_whose_deadline_comes_first_waits_for_the_first_members_verdict():
    """Member 1's timeout (1 s) ends before the first member's (6 s), which makes its end slowly (2 s):
    member 1 says it is done and waits for the verdict to the first member's deadline, which the hub
    told it, so both succeed (it gave up at its own deadline and failed alone, the hub succeeding: a
    split outcome)."""
    from engine import handles

    listeners = [handles.Listener() for _ in range(2)]
    members = [lst.handle for lst in listeners]
    outcome = {}

    def member():
        try:
            store, _, _ = handles.meet(listeners[1], 12, members, 1.0)
            store.close(made=True)
            outcome["member"] = "ok"
        except Exception as exc:
            outcome["member"] = f"{type(exc).__name__}: {exc}"

    side = threading.Thread(target=member)
    side.start()
    try:
        store, _, _ = handles.meet(listeners[0], 12, members, 6.0)
        time.sleep(2.0)   # (its end made slowly)
        store.close(time.monotonic() + 4.0)
        side.join(10)
        assert outcome == {"member": "ok"}, outcome
    finally:
        for lst in listeners:
            lst.close()


def test_abort_ends_a_members_connect_to_a_first_member_that_never_answers():
    """The first member's host drops the connection's SYNs (gone, or a full backlog as here): abort()
    (listener.interrupt) ends the member's connect within a tick, not at the reconfigure's timeout."""
    import socket

    from engine import handles

    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    gone.listen(0)
    filler = []
    for _ in range(3):   # (the backlog full: further SYNs are dropped, and a connect waits on)
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(gone.getsockname())
        filler.append(s)
    first = f"engine2/127.0.0.1/{gone.getsockname()[1]}/{'00' * 16}/{handles.this_host()}"
    listener = handles.Listener()
    try:
        side, outcome = _started(lambda: handles.meet(listener, 31, [first, listener.handle], 30))
        time.sleep(0.5)
        assert not outcome, outcome
        aborted = time.monotonic()
        listener.interrupt("aborted while connecting")
        side.join(10)
        assert outcome and isinstance(outcome[0][1], ConnectionError), outcome
        assert str(outcome[0][1]) == "aborted while connecting" and outcome[0][0] - aborted < 1.0, outcome
    finally:
        listener.interrupt("test over")
        side.join(40)
        listener.close()
        for s in filler + [gone]:
            s.close()


def test_an_abort_before_the_reconfigures_meeting_began_still_ends_it_at_once(monkeypatch):
    """abort() from another thread after a reconfigure began but before its meeting could hear of it
    (here while its handles are read) ends it at once: it waited for a member that never came until
    its timeout, and only then said it was aborted."""
    from engine import handles
    from engine.communicator import Communicator
    from torchbridge.process_group import EngineProcessGroup

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(comm, 0, 1, store=dist.HashStore(), name="g")
    stranger = handles.Listener()   # (a member that never comes)
    read = handles.order
    monkeypatch.setattr(handles, "order", lambda hs: (pg.abort(), read(hs))[1])
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"reconfigure 32 of group 'g': process group 'g' was aborted "
                                               r"\(abort\(\)\) while this reconfigure waited for its members"):
            pg.reconfigure(SimpleNamespace(uuid=32, handles=[pg.get_reconfigure_handle(), stranger.handle],
                                           timeout=timedelta(seconds=6)))
        assert time.monotonic() - started < 3.0
        monkeypatch.setattr(handles, "order", read)
        pg.reconfigure(SimpleNamespace(uuid=33, handles=[pg.get_reconfigure_handle()], timeout=timedelta(seconds=30)))
        t = torch.ones(3)
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.ones(3))
    finally:
        stranger.close()
        pg.shutdown()


@pytest.mark.parametrize("request_", ["get", "check", "done"])
def test_a_request_announcing_bytes_it_does_not_carry_fails_the_meeting(request_):
    """A member's get, check or done that announces bytes of value (or done, of key) it does not
    carry: those bytes were read as the next request (a get announcing 9 bytes that were a set of 'x'
    stored 'x'). The meeting fails, naming the request, and nothing after it is read."""
    import socket

    from engine import handles

    listener = handles.Listener()
    ours, member = socket.socketpair()
    try:
        store = handles.HubStore({1: ours}, time.monotonic() + 5, handles.Meeting(listener, b"d" * 32),
                                 [listener.handle, listener.handle])
        store.set("k", b"v")
        op, key = {"get": (handles.OP_GET, b"k"), "check": (handles.OP_CHECK, b"k"),
                   "done": (handles.OP_DONE, b"")}[request_]
        smuggled = handles._REQ.pack(handles.OP_SET, 1, 3) + b"x" + b"EVL"
        member.sendall(handles._REQ.pack(op, len(key), len(smuggled) - (op == handles.OP_DONE)) + key + smuggled)
        deadline = time.monotonic() + 5
        while store.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "announces" in (store.error or ""), store.error
        assert "x" not in store.data
    finally:
        member.close()
        ours.close()
        listener.close()


def test_an_abort_landing_while_the_hub_is_made_is_heard_rather_than_raise(monkeypatch):
    """abort() from another thread lands while the first member makes its hub (the meeting told the hub
    before the hub could fail: AttributeError out of abort(), and nothing aborted). The meeting holds
    the abort, which the making reads once the hub is made."""
    from engine import handles

    listener = handles.Listener()
    meeting = handles.Meeting(listener)
    real = threading.Condition

    def condition(*args):
        meeting.cancel("aborted")   # (abort(), from another thread, at this moment)
        return real(*args)

    monkeypatch.setattr(handles, "threading", SimpleNamespace(Condition=condition, Thread=threading.Thread))
    try:
        store = handles.HubStore({}, time.monotonic() + 5, meeting, [listener.handle])
        assert meeting.cancelled == "aborted"
        store.fail(meeting.cancelled)
        assert store.error == "aborted"
    finally:
        listener.close()


def test_an_abort_before_the_shrinks_wait_began_still_ends_it_at_once(monkeypatch):
    """abort() from another thread after a shrink began but before its wait for the members could hear
    of it (here while it checks torch's table of ranks) ends it at once: it waited for a member that
    never came (rank 1 of 3 makes no shrink) until its timeout. An abort() before the shrink was
    called does not end it (a shrink after an abort is how a group is remade)."""
    from engine.communicator import Communicator
    from torchbridge.process_group import EngineProcessGroup

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(comm, 0, 3, timeout=timedelta(seconds=6), store=dist.HashStore(), name="g")
    pg.abort()   # (before: no effect on the shrink below)
    check = pg._check_torch_knows_members

    def aborted_meanwhile(*args):
        aborter = threading.Thread(target=pg.abort)
        aborter.start()
        aborter.join()
        return check(*args)

    monkeypatch.setattr(pg, "_check_torch_knows_members", aborted_meanwhile)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"engine shrink of process group 'g' without ranks \[2\]: process group "
                                               r"'g' was aborted \(abort\(\)\) as this shrink began"):
            pg.shrink([2])
        assert time.monotonic() - started < 3.0
    finally:
        pg.shutdown()


@pytest.mark.parametrize("when", ["waiting", "before the wait"])
def test_abort_ends_a_split_waiting_for_a_member(monkeypatch, when):
    """abort() from another thread ends a split_group that waits in the store for a member that never
    comes (rank 2 of 3 makes no split), at once, naming the abort: it waited the group's timeout (here
    6 s), which abort() did not end; also where the abort lands after the split took the group's
    communicator but before its wait could hear of it (while it reads the group's timeout)."""
    from engine.communicator import Communicator
    from torchbridge.process_group import EngineProcessGroup

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(comm, 0, 3, timeout=timedelta(seconds=6), store=dist.HashStore(), name="g")
    if when == "waiting":
        timer = threading.Timer(0.5, pg.abort)
        timer.start()
        expected = "while this split waited for its members"
    else:
        seconds = pg._timeout_seconds

        def aborted_meanwhile():
            aborter = threading.Thread(target=pg.abort)
            aborter.start()
            aborter.join()
            return seconds()
        monkeypatch.setattr(pg, "_timeout_seconds", aborted_meanwhile)
        expected = "as this split began"
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"engine split of process group 'g' into ranks \[0, 2\]: process group "
                                               rf"'g' was aborted \(abort\(\)\) {expected}"):
            pg.split_group([0, 2])
        assert time.monotonic() - started < 3.0
    finally:
        if when == "waiting":
            timer.join()
        pg.shutdown()


def test_the_hub_is_the_first_member_other_hosts_reach_and_another_hosts_loopback_is_not_probed():
    """The hub of a reconfigure is the first member whose handle's address is not loopback (a host whose
    MASTER_ADDR is localhost hands out loopback handles; tests/test_hosts.py meets across hosts so); a
    loopback handle of another host refusing here proves nothing (this host's own loopback answered),
    one of this host refusing is a process that ended."""
    import socket

    from engine import handles

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()   # (nothing listens there now)
    here = [f"engine2/127.0.0.1/{p}/{'00' * 16}/{handles.this_host()}" for p in (port, port + 1)]
    there = f"engine2/10.0.0.2/{port}/{'00' * 16}/another-host"
    assert handles.hub_of(here) == 0
    assert handles.hub_of(here + [there]) == 2 and handles.hub_of([there] + here) == 0
    assert handles._refuses(here[0])
    assert not handles._refuses(f"engine2/127.0.0.1/{port}/{'00' * 16}/another-host")


def test_a_group_made_with_a_device_id_is_bound_to_it():
    """init_process_group("engine", device_id=torch.device("cuda", i)): torch calls
    eager_connect_single_device on a backend that splits (this one: AttributeError, the group not made)
    and binds the device on a ProcessGroup it then drops for this one (bound_device_id stayed None:
    split_group said "No device associated with the default pg"). Such a world's new_group never splits
    the engine group (torch 2.14 on put it in options that take only a C++ Backend, torch 2.13 asked the
    ranks outside to join the split): this, on every torch; torch 2.15, which binds a world to the CPU
    too, makes the groups in FaultToleranceScenarios.test_new_groups_of_a_world_bound_to_a_device."""
    from engine.communicator import Communicator
    from torchbridge.process_group import EngineProcessGroup

    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(comm, 0, 1, store=dist.HashStore(), name="g")
    try:
        assert pg.supports_splitting and pg.bound_device_id is None
        pg.eager_connect_single_device(torch.device("cuda", 0))
        assert pg.bound_device_id == torch.device("cuda", 0)
        pg.eager_connect_single_device(torch.device("cpu", 0))   # (torch asks the bound device's backend)
        split_source = dist.distributed_c10d._get_split_source
        assert split_source(*((pg, "engine") if TORCH >= (2, 15) else (pg,))) is None
    finally:
        pg.shutdown()


def test_a_handle_without_master_addr_names_the_route_to_the_groups_store(monkeypatch):
    """init_method="tcp://host:port" (no MASTER_ADDR): a group's reconfigure handle listens on the route
    to its TCPStore's host, as its TCP transport does, not on the hostname's address (which may be a
    network the other hosts don't reach)."""
    from engine import handles
    from engine.communicator import Communicator
    from torchbridge.process_group import EngineProcessGroup

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("ENGINE_SOCKET_IFNAME", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    comm = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(comm, 0, 1, store=dist.PrefixStore("g", store), name="g", listen=True)
    try:
        assert handles.parse_handle(pg.get_reconfigure_handle())[0] == "127.0.0.1", pg.get_reconfigure_handle()
        assert pg._listener.how == "the route to the store's host 127.0.0.1 (no MASTER_ADDR)"
    finally:
        pg.shutdown()
