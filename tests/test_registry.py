"""The algorithm registry (engine/registry.py) as data: its shape, forcing, tuning and the plans it
makes, without running a collective (tests/mpi/test_matrix.py runs every entry)."""

import json
import os
import subprocess
import sys

import pytest

from engine import registry, tuning
from engine.registry import EVERY, Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_collective_and_transport_ends_in_an_entry_that_takes_every_call():
    for transport in registry.TRANSPORTS:
        for coll in registry.COLLECTIVES:
            auto = [e for e in registry.entries(coll, transport) if e.auto is True]
            assert auto, (transport, coll)
            last = auto[-1]
            assert not last.needs and last.bytes_range() == (0, EVERY) and last.min_ranks == 1, last
            assert last.uneven and last.dtypes is None and last.ops is None, last


def test_entries_are_unique_and_indexed():
    keys = [e.key for e in registry.ENTRIES]
    assert len(keys) == len(set(keys))
    assert all(registry.ENTRIES[e.index] is e for e in registry.ENTRIES)


def test_the_default_plans_choose_what_docs_tuning_says():
    shm = Plan("shm", {"single_copy"})
    assert shm.choose("allreduce", 16 << 10, 2).name == "oneshot"
    assert shm.choose("allreduce", (16 << 10) + 1, 2).name == "twoshot"
    assert shm.choose("reduce", 256 << 10, 2).name == "oneshot"
    assert shm.choose("broadcast", (32 << 10) - 1, 2).name == "segment"
    assert shm.choose("broadcast", 32 << 10, 2).name == "single_copy"
    assert Plan("shm").choose("broadcast", 1 << 20, 2).name == "segment"  # no single copy: through the slots
    mpi = Plan("mpi")
    assert mpi.choose("allreduce", 1 << 10, 1).name == "native"
    assert mpi.choose("allreduce", 256 << 10, 2).name == "rdouble"
    assert mpi.choose("allreduce", (256 << 10) + 1, 2).name == "ring"
    hier = Plan("mpi", registry.hierarchy_caps("auto"))
    assert hier.choose("allreduce", 16 << 10, 4).name == "hier"
    assert hier.choose("allreduce", (16 << 10) - 1, 4).name == "rdouble"
    assert hier.choose("allgather", 1 << 20, 4, uneven=True).name == "native"
    assert Plan("mpi", registry.hierarchy_caps("leader")).choose("allreduce", 1 << 20, 4).name == "leader"


def test_every_threshold_moves_the_edge_of_the_entries_it_bounds(monkeypatch):
    """Each ENGINE_*_MIN/MAX_BYTES variable, set, is where its entries start or stop being chosen, on
    the transport and with the capabilities each entry needs (the core walks the same numbers:
    Plan.configure, checked by the matrix's test_automatic_choice_follows_the_registry). 300000 bytes
    lies above every other default edge, so no entry earlier in a list shadows the one under test."""
    moved = 300000
    monkeypatch.delenv("ENGINE_TUNING_FILE", raising=False)
    walked = set()
    for e in registry.ENTRIES:
        for side, bound in (("min", e.min_bytes), ("max", e.max_bytes)):
            if not isinstance(bound, registry.Tunable) or e.auto is False:
                continue
            caps = set(e.needs) | ({e.auto} if isinstance(e.auto, str) else set())
            monkeypatch.setenv(bound.env, str(moved))
            plan = Plan(e.transport, caps)
            outside = moved - 1 if side == "min" else moved + 1
            assert plan.choose(e.collective, moved, 4) is e, (bound.env, e.key)
            assert plan.choose(e.collective, outside, 4) is not e, (bound.env, e.key, outside)
            monkeypatch.delenv(bound.env)
            walked.add(bound.env)
    bounds = {t.env for e in registry.ENTRIES for t in (e.min_bytes, e.max_bytes) if isinstance(t, registry.Tunable)}
    assert walked == bounds and len(bounds) >= 12, sorted(bounds - walked)


def test_a_least_size_above_the_most_of_one_entry_is_refused_naming_both(monkeypatch):
    """ENGINE_SHM_CMA_MIN_BYTES above ENGINE_SHM_CMA_MAX_BYTES was taken, and single copy silently ran
    at no size: refused when a group's plan is made, naming both settings and the entry."""
    monkeypatch.delenv("ENGINE_TUNING_FILE", raising=False)
    monkeypatch.setenv("ENGINE_SHM_CMA_MIN_BYTES", "1M")
    monkeypatch.setenv("ENGINE_SHM_CMA_MAX_BYTES", "1K")
    with pytest.raises(ValueError, match=r"ENGINE_SHM_CMA_MIN_BYTES=1048576 is above ENGINE_SHM_CMA_MAX_BYTES=1024: "
                                         r"the shm:\w+:\w+ entry would run at no size"):
        Plan("shm", {"single_copy"})


def test_a_name_forced_for_one_transport_is_refused_on_another_unless_a_group_ran_it(monkeypatch):
    """ENGINE_ALLREDUCE_ALGO=native under mpirun: the world (MPI) runs it, and the groups a shrink or a
    split of it makes, over shared memory or TCP, failed to be made (native does not run there); they
    now keep their automatic choice. A name no group of the process ran is still refused."""
    monkeypatch.delenv("ENGINE_TUNING_FILE", raising=False)
    monkeypatch.setattr(registry, "_FORCED_RAN", set())
    monkeypatch.setenv("ENGINE_ALLREDUCE_ALGO", "native")
    with pytest.raises(ValueError, match=r"ENGINE_ALLREDUCE_ALGO=native does not run on the shm transport"):
        Plan("shm", ())
    assert Plan("mpi", ()).choose("allreduce", 4, 2).name == "native"
    assert Plan("shm", ()).choose("allreduce", 4, 2).name == "oneshot"
    monkeypatch.setenv("ENGINE_ALLREDUCE_ALGO", "oneshot")
    with pytest.raises(ValueError, match=r"ENGINE_ALLREDUCE_ALGO=oneshot does not run on the tcp transport"):
        Plan("tcp", ())


def test_auto_and_slice_make_the_same_plan():
    assert Plan("mpi", registry.hierarchy_caps("auto")).digest() == \
        Plan("mpi", registry.hierarchy_caps("slice")).digest()
    assert Plan("mpi", registry.hierarchy_caps("auto")).digest() != \
        Plan("mpi", registry.hierarchy_caps("leader")).digest()


@pytest.mark.parametrize("value, transport, want", [
    ("ring", "shm", "ring"), ("mpi:ring", "shm", "oneshot"), ("shm:twoshot,mpi:rdouble", "mpi", "rdouble"),
    ("shm:twoshot,mpi:rdouble", "shm", "twoshot"), ("ring", "nccl", "ring")])
def test_forcing_takes_the_item_of_the_groups_transport(value, transport, want):
    plan = Plan(transport, stage=True, environ={"ENGINE_ALLREDUCE_ALGO": value})
    assert plan.choose("allreduce", 8, 2, "float32", "sum").name == want


def test_a_forced_entry_keeps_the_automatic_choice_for_calls_it_does_not_take():
    plan = Plan("mpi", registry.hierarchy_caps("auto"), environ={"ENGINE_ALLGATHER_ALGO": "hier"})
    assert plan.choose("allgather", 8, 4).name == "hier"  # every size
    assert plan.choose("allgather", 8, 4, uneven=True).name == "native"


@pytest.mark.parametrize("env, message", [
    ({"ENGINE_ALLREDUCE_ALGO": "fast"}, "allreduce has no algorithm 'fast'"),
    ({"ENGINE_BROADCAST_ALGO": "ucx:segment"}, "unknown transport 'ucx'"),
    ({"ENGINE_BROADCAST_ALGO": "mpi:segment"}, "no algorithm 'segment' on the mpi transport"),
    ({"ENGINE_ALLREDUCE_ALGO": "oneshot"}, "does not run on the mpi transport"),
    ({"ENGINE_ALLREDUCE_ALGO": "hier"}, "needs hierarchy"),
    # (the second was never run)
    ({"ENGINE_ALLREDUCE_ALGO": "mpi:ring, mpi:rdouble"},
     r"two allreduce algorithms for the mpi transport \(ring, rdouble\)"),
    ({"ENGINE_ALLREDUCE_ALGO": "ring,rdouble"}, r"two allreduce algorithms for every transport \(ring, rdouble\)"),
    ({"ENGINE_ALLREDUCE_ALGO": "ring, mpi:rdouble"},
     r"two allreduce algorithms for the mpi transport \(ring, rdouble\)"),
])
def test_forcing_what_a_group_cannot_run_is_refused_by_name(env, message):
    with pytest.raises(ValueError, match=message):
        Plan("mpi", environ=env)


def test_a_hierarchys_stages_ignore_what_they_cannot_run():
    plan = Plan("shm", stage=True, environ={"ENGINE_ALLREDUCE_ALGO": "hier", "ENGINE_BROADCAST_ALGO": "single_copy"})
    assert plan.choose("allreduce", 8, 2).name == "oneshot"
    assert plan.choose("broadcast", 1 << 20, 2).name == "segment"


def test_every_setting_is_documented_in_the_readme():
    readme = open(os.path.join(ROOT, "README.md")).read()
    for t in registry.tunables():
        assert t.env in readme, t.env
    assert "ENGINE_<COLLECTIVE>_ALGO" in readme and "ENGINE_HIER" in readme


def test_a_tuning_files_rules_and_thresholds_and_the_environment_over_both(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "rules": {"allreduce": {"shm": [
        {"algorithm": "rdouble", "min_bytes": 0, "max_bytes": 100, "min_ranks": 3, "max_ranks": 3}]}},
        "thresholds": {"ENGINE_SHM_ONESHOT_MAX_BYTES": 1000}}))
    monkeypatch.setenv("ENGINE_TUNING_FILE", str(path))
    plan = Plan("shm")
    assert plan.choose("allreduce", 100, 3).name == "rdouble"
    assert plan.choose("allreduce", 100, 2).name == "oneshot"  # another group size: the registry's rules
    assert plan.choose("allreduce", 1001, 2).name == "twoshot"  # the file's threshold
    monkeypatch.setenv("ENGINE_SHM_ONESHOT_MAX_BYTES", "2000")
    assert Plan("shm").choose("allreduce", 1001, 2).name == "oneshot"  # the environment wins


def test_point_to_point_moves_by_single_copy_only_at_the_sizes_its_first_rule_says(tmp_path, monkeypatch):
    """The shared-memory transport's single-copy range for point-to-point messages (Shm.configure, which
    the transport reads per message) is the sizes whose first sendrecv rule is single copy:
    ENGINE_SENDRECV_ALGO=queue, or a tuned queue rule, takes its sizes. (The first single-copy rule's
    own range was taken: every message of 32 KiB and up still moved by single copy.)"""
    from engine.transports import Shm
    for var in [v for v in os.environ if v.startswith("ENGINE_")]:
        monkeypatch.delenv(var)

    class Segment:
        cma, got = True, None

        def set_cma(self, enabled, lo, hi):
            self.got = (enabled, lo, hi)

    def single_copy_range():
        core = type("Core", (), {"size": 2, "seg": Segment()})()
        Shm.configure(core, Plan("shm", {"single_copy"}))
        return core.seg.got

    every = registry.EVERY
    assert single_copy_range() == (True, 32 << 10, every)
    monkeypatch.setenv("ENGINE_SENDRECV_ALGO", "queue")
    assert single_copy_range() == (True, every, 0)     # none
    monkeypatch.setenv("ENGINE_SENDRECV_ALGO", "single_copy")
    assert single_copy_range() == (True, 0, every)
    monkeypatch.delenv("ENGINE_SENDRECV_ALGO")
    for i, (rules, expected) in enumerate((
            ([{"algorithm": "queue", "max_bytes": 1 << 20}], (True, (1 << 20) + 1, every)),
            ([{"algorithm": "single_copy", "max_bytes": 1 << 20}], (True, 0, every)),   # (and the registry's above)
            ([{"algorithm": "queue", "min_bytes": 64 << 10, "max_bytes": 1 << 20}], ValueError))):
        path = tmp_path / f"tuned{i}.json"   # (a file is read once)
        path.write_text(json.dumps({"format": tuning.FORMAT, "rules": {"sendrecv": {"shm": rules}}}))
        monkeypatch.setenv("ENGINE_TUNING_FILE", str(path))
        if expected is ValueError:   # (32-64 KiB and from 1 MiB up: the transport takes one range)
            with pytest.raises(ValueError, match=r"the sendrecv rules give single copy 2 ranges of sizes"):
                single_copy_range()
        else:
            assert single_copy_range() == expected, rules


def test_the_settings_ranks_compare_are_their_transports_thresholds_forced_names_and_tuned_rules(tmp_path, monkeypatch):
    """registry.settings(transport): what engine.Communicator compares across a new group's ranks before it
    builds anything (tests/test_faults.py runs ranks that differ): the thresholds and parameters of the
    transport's entries but a rank's own (Tunable.local), what is forced on it, its tuned rules."""
    for var in [v for v in os.environ if v.startswith("ENGINE_")]:
        monkeypatch.delenv(var)
    def own(transport):
        return {t.env: t.default for e in registry.entries(transport=transport)
                for t in (e.min_bytes, e.max_bytes, *(p for _, p in e.params)) if isinstance(t, registry.Tunable)}
    base = registry.settings("shm")
    assert base == {k: v for k, v in own("shm").items() if k not in ("ENGINE_SHM_THREAD_SLICE_BYTES",
                                                                      "ENGINE_SHM_PULL_PIECE_BYTES")}
    assert "ENGINE_SHM_CHUNK_BYTES" in base and "ENGINE_TCP_TREE_MAX_BYTES" not in base
    assert "ENGINE_MPI_CHUNK_ELEMENTS" in registry.settings("mpi")
    assert "ENGINE_SHM_CHUNK_BYTES" not in registry.settings("tcp")
    monkeypatch.setenv("ENGINE_SHM_CHUNK_BYTES", "131072")
    monkeypatch.setenv("ENGINE_SHM_THREAD_SLICE_BYTES", "4096")     # a rank's own
    monkeypatch.setenv("ENGINE_ALLREDUCE_ALGO", "shm:ring, tcp:ring, rdouble")
    assert registry.settings("shm") == {**base, "ENGINE_SHM_CHUNK_BYTES": 131072,
                                        "ENGINE_ALLREDUCE_ALGO": "shm:ring,rdouble"}
    assert registry.settings("tcp")["ENGINE_ALLREDUCE_ALGO"] == "tcp:ring,rdouble"
    for var in ("ENGINE_SHM_CHUNK_BYTES", "ENGINE_SHM_THREAD_SLICE_BYTES", "ENGINE_ALLREDUCE_ALGO"):
        monkeypatch.delenv(var)
    hashes = []
    for hi in (100, 200):   # two files that differ in a shared-memory rule only, named the same
        path = tmp_path / f"{hi}" / "tuned.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"format": tuning.FORMAT, "rules": {"allreduce": {"shm": [
            {"algorithm": "rdouble", "min_bytes": 0, "max_bytes": hi, "min_ranks": 3, "max_ranks": 3}]}},
            "thresholds": {"ENGINE_SHM_ONESHOT_MAX_BYTES": 1000}}))
        monkeypatch.setenv("ENGINE_TUNING_FILE", str(path))
        got = registry.settings("shm")
        assert got["ENGINE_SHM_ONESHOT_MAX_BYTES"] == 1000
        hashes.append(got["ENGINE_TUNING_FILE"])
        assert "ENGINE_TUNING_FILE" not in registry.settings("tcp")   # no TCP rules: hosts may differ there
    assert hashes[0] != hashes[1] and all(h.startswith("rules ") for h in hashes)


def test_plans_that_differ_are_told_by_the_rules_one_rank_walks_and_the_other_does_not(monkeypatch):
    """Ranks whose plans differ (one with threads: ENGINE_THREADS) are refused naming each collective
    whose rules differ and only those rules, where the error held both plans whole (2.5 KB), the one
    rule that differed buried among the rest."""
    for var in [v for v in os.environ if v.startswith("ENGINE_")]:
        monkeypatch.delenv(var)
    plain = Plan("shm", {"single_copy"}, stage=False, alone=False).digest()[1]
    monkeypatch.setenv("ENGINE_THREADS", "2")
    threaded = Plan("shm", {"single_copy", "threads"}, stage=False, alone=False).digest()[1]
    monkeypatch.delenv("ENGINE_THREADS")
    monkeypatch.setenv("ENGINE_SHM_ONESHOT_MAX_BYTES", "1024")
    lower = Plan("shm", {"single_copy"}, stage=False, alone=False).digest()[1]
    told = registry.plan_difference([threaded, plain, plain], 0, 2)
    assert told == ("allreduce: rank 0 walks twoshot_threads[262144,any,1,any], rank 2 does not; "
                    "reduce: rank 0 walks twoshot_threads[262144,any,1,any], rank 2 does not"), told
    assert registry.plan_difference([plain, threaded], 0, 1).startswith("allreduce: rank 1 walks twoshot_threads[")
    assert registry.plan_difference([plain, lower], 0, 1) == ("allreduce: rank 0 walks oneshot[0,16384,1,any] where "
                                                              "rank 1 walks oneshot[0,1024,1,any]")
    assert registry.plan_difference([plain, plain], 0, 1) == ""
    assert registry.plan_difference(["allreduce=a[0,1,1,any],b[0,any,1,any]", "allreduce=b[0,any,1,any],a[0,1,1,any]"],
                                    0, 1) == ("allreduce: rank 0 walks a[0,1,1,any], b[0,any,1,any] in this order, "
                                              "rank 1 b[0,any,1,any], a[0,1,1,any]")


def test_version_1_files_are_still_read(tmp_path, monkeypatch):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": "engine-tuning/1", "allreduce": {"mpi": [{"algorithm": "ring"}]},
                                "hierarchical_allreduce_min_bytes": 4096}))
    monkeypatch.setenv("ENGINE_TUNING_FILE", str(path))
    plan = Plan("mpi", registry.hierarchy_caps("auto"))
    assert plan.choose("allreduce", 1, 4).name == "ring"
    assert registry.HIER_MIN["allreduce"].value() == 4096


def test_core_masks_say_what_an_entry_takes():
    dtypes, ops = registry.entry("nccl", "allreduce", "nccl").masks()
    assert dtypes == (1 << len(registry.DTYPE_NAMES)) - 1 and ops >> registry.OPBITS["none"] & 1


def test_the_docs_table_is_the_registry():
    doc = open(os.path.join(ROOT, "docs", "algorithms.md")).read()
    assert registry.markdown() in doc, "docs/algorithms.md's table differs from engine/registry.py: paste " \
        "registry.markdown() there"


def test_threads_share_the_hosts_cores_the_same_way_on_every_rank(monkeypatch):
    """The threaded entries need "threads": each rank of a host having 2+ cores of its share, read only
    from what every rank sees (the same rules everywhere); ENGINE_THREADS forces a count."""
    import torch

    from engine.launcher import LAUNCHERS
    from engine.transports import forced_threads, threads
    for var in ("ENGINE_THREADS", "LOCAL_WORLD_SIZE", *(name for launcher in LAUNCHERS for name in launcher[1:])):
        monkeypatch.delenv(var, raising=False)
    eight = frozenset(range(8))
    two_ranks = [("h", 1, eight), ("h", 2, eight)]
    assert threads(two_ranks, 0, forced_threads()) == (min(4, torch.get_num_threads()), True)
    # a subgroup of 2 of the job's 8 processes on this host: each rank takes 8 / 8 cores, not 8 / 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert threads(two_ranks, 0, forced_threads()) == (1, True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")     # (never fewer than the group's own ranks)
    assert threads(two_ranks, 0, forced_threads()) == (min(4, torch.get_num_threads()), True)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert threads(two_ranks, 0, forced_threads()) == (min(2, torch.get_num_threads()), True)
    for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var)
    assert threads([("h", r, frozenset({0, 1})) for r in range(4)], 1, forced_threads()) == (1, False)   # oversubscribed
    assert threads([("h", 1, frozenset({0})), ("h", 2, frozenset({1}))], 0, forced_threads()) == (1, False)  # bound to a core each
    # at most torch's intra-op threads, which OMP_NUM_THREADS (or MKL_NUM_THREADS) sets where torch loads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert threads(two_ranks, 0, forced_threads()) == (3, True)
    finally:
        torch.set_num_threads(before)
    code = ("import torch; from engine.transports import threads; "
            "print(threads([('h', 1, frozenset(range(8))), ('h', 2, frozenset(range(8)))], 0, 0)[0])")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):   # (torch caps either at the machine's cores)
        got = subprocess.run([sys.executable, "-c", code], env={**env, var: "1"}, capture_output=True, text=True,
                             check=True, timeout=120).stdout.split()
        assert got == ["1"], (var, got)
    monkeypatch.setenv("ENGINE_THREADS", "3")
    assert threads([("h", 1, frozenset({0}))], 0, forced_threads()) == (3, True)
    monkeypatch.setenv("ENGINE_THREADS", "-1")
    with pytest.raises(ValueError, match="ENGINE_THREADS"):
        forced_threads()


def test_forcing_a_threaded_entry_without_threads_says_how_to_get_them():
    with pytest.raises(ValueError, match="ENGINE_THREADS=N"):
        Plan("shm", {"single_copy"}, environ={"ENGINE_ALLREDUCE_ALGO": "shm:twoshot_threads"})
    plan = Plan("shm", {"single_copy", "threads"})
    least = registry.SHM_THREADS_MIN.default
    assert plan.choose("allreduce", least, 2).name == "twoshot_threads"
    assert plan.choose("allreduce", least - 1, 2).name == "twoshot"


def test_sockets_come_from_the_numa_nodes_of_the_ranks_cores_or_engine_sockets(tmp_path, monkeypatch):
    from engine.hierarchy import numa_nodes, sockets_of, topology
    for node, cpus in ((0, "0-1,4\n"), (1, "2-3,5-6\n")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus)
    nodes = numa_nodes(str(tmp_path))
    assert nodes == {0: {0, 1, 4}, 1: {2, 3, 5, 6}}
    monkeypatch.delenv("ENGINE_SOCKETS", raising=False)
    bound = [("h", 1, {0}), ("h", 2, {4}), ("h", 3, {2, 3}), ("h", 4, {6})]
    assert sockets_of(bound, nodes) == ["h/node0", "h/node0", "h/node1", "h/node1"]
    assert sockets_of(bound[:3] + [("h", 4, {1, 2})], nodes) is None    # a rank spanning nodes: one level
    assert sockets_of(bound, {0: set(range(8))}) is None                  # one node
    monkeypatch.setenv("ENGINE_SOCKETS", "2")
    unbound = [("h", r, set(range(8))) for r in range(4)] + [("g", 9, {0}), ("g", 8, {0})]
    assert sockets_of(unbound, {0: set(range(8))}) == ["h/socket0", "h/socket0", "h/socket1", "h/socket1",
                                                       "g/socket0", "g/socket1"]
    # N that does not split a host's ranks evenly: sockets of unequal sizes, where layout() stays flat
    three = sockets_of(unbound[:3], {0: set(range(8))})
    assert three == ["h/socket0", "h/socket0", "h/socket1"] and topology(three)[2] is None
    assert topology(sockets_of(unbound[:4], {0: set(range(8))}))[2] == 2


def test_the_shm_core_implements_every_shm_entry():
    """Every shm entry's implementation code is one the compiled core says it runs (Impl codes and the
    core's count of them agree)."""
    import engine
    core = engine.Communicator.from_store(None, 0, 1).core
    assert {e.impl for e in registry.entries(transport="shm")} <= core.impls, core.impls


def test_a_group_of_one_takes_a_forced_entry_it_lacks_what_for(monkeypatch):
    """ENGINE_ALLGATHER_ALGO=single_copy, which a group of two without single copy refuses, is taken by
    a group of one (its calls move nothing, whatever entry they name: the script that forces it at
    two ranks runs at one, or with subgroups of one; it refused the group)."""
    env = {"ENGINE_ALLGATHER_ALGO": "single_copy"}
    with pytest.raises(ValueError, match="needs single_copy, which this shm group lacks"):
        Plan("shm", environ=env)
    assert Plan("shm", alone=True, environ=env).choose("allgather", 1 << 20, 1).name == "segment"
    monkeypatch.setenv("ENGINE_ALLGATHER_ALGO", "single_copy")
    import numpy as np
    import engine
    comm = engine.Communicator.single()
    out = np.zeros(3, np.float32)
    comm.allgather(np.arange(3, dtype=np.float32), out)
    assert out.tolist() == [0, 1, 2]
    comm.free()
