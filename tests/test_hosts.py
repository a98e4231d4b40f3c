"""Across hosts made from network namespaces (tests/hosts.py), one pair of hosts for the whole file:
mpirun over the two (MPI between them, shared memory inside each), a torchrun on each (the engine's TCP
transport between them, no MPI anywhere), and faults between them over TCP. Skipped, with the reason,
where namespaces can't be made."""

import os
import re
import subprocess
import sys
import time

import pytest

from engine.watch import STORE_QUERY_SECONDS
from hosts import Hosts, collect, env_launch, mpirun_across, torchrun_across
from mpirun import assert_every_rank_passed, assert_rank_1_shrunk_away, suite_report, ulfm_unavailable
from ports import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHY_NOT = Hosts.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture(scope="module")
def hosts():
    with Hosts(2) as pair:
        yield pair


# A torchrun started on each host, 2 ranks each, no MPI anywhere: shared memory inside each host, the
# engine's TCP transport between them, hierarchical. One launch runs every suite: the torch API sweep,
# the TCP transport's own suite (with flat groups of one rank per host, the shape of a 2x1 job, and of
# three ranks), DDP (eager and compiled) exact against one process, FSDP2 and the rest of torch's
# parallelism, the conformance matrix's TCP rows. At 2x1 by hand (docs/hosts.md):
#   python tests/hosts.py torchrun 2x1 -m pytest -q tests/mpi/test_torch_backend.py tests/mpi/tcp_suite.py ...
TORCHRUN_SUITES = ["test_torch_backend.py", "tcp_suite.py", "exact_training.py", "parallel_suite.py",
                   "test_matrix.py"]


def test_torch_suites_across_hosts_under_torchrun(hosts):
    paths = [os.path.join(ROOT, "tests", "mpi", f) for f in TORCHRUN_SUITES]
    results = torchrun_across(hosts, 2, ["-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", "-o",
                                         "addopts=", "--color=no", *paths], timeout=600, ENGINE_TIMEOUT="30",
                               # (the compiled DDP's graphs: 4 ranks' inductor builds took 38 s on 2 cores;
                               # tests/test_clients.py builds with inductor)
                               ENGINE_CLIENTS_COMPILE_BACKEND="aot_eager")
    text = "\n".join(out for _, out in results)
    assert all(rc == 0 for rc, _ in results), suite_report(text)
    assert_every_rank_passed(text, 4)
    assert "a TCP group's suite" not in text, text[-5000:]      # the group is on TCP,
    assert "needs hierarchy" not in text, text[-5000:]          # hierarchical,
    assert "needs ranks on two hosts" not in text, text[-5000:]  # and its flat groups span the hosts


# Faults between the hosts over the TCP transport (tests/faults/hosts_tcp.py; the ranks started with
# torch's env:// variables on each host, no launcher to outlive them): each ends in an error naming the
# rank or the address within the group's timeout + 10 s, and nothing is left in /dev/shm. The jobs
# run at once (each mostly waits for its timeout), on this file's hosts and, for each cut link, on a
# pair of its own.
FAULT_TIMEOUT = 10
FAULT_SCRIPT = os.path.join(ROOT, "tests", "faults", "hosts_tcp.py")
FAULT_WAIT = FAULT_TIMEOUT + 80     # past it a job counts as hung (its startup shares 2 cores with the others)
FAULTS = {"kill-2x1": (1, dict(FAULT="kill", FAULT_RANK="1")),
          "kill-2x2": (2, dict(FAULT="kill", FAULT_RANK="3")),
          "cut": (1, dict(FAULT="cut", FAULT_RANK="1")),
          "cut-2x2": (2, dict(FAULT="cut", FAULT_RANK="3")),
          "cut-connecting": (1, dict(FAULT="cut-connecting", FAULT_RANK="1")),
          "drop": (1, dict(FAULT="drop", FAULT_RANK="1")),
          "stall-2x2": (2, dict(FAULT="stall", FAULT_RANK="3")),
          "wrong-master-addr": (1, dict(master="10.77.0.99")),
          "master-port-in-use": (1, {})}


def _raised(text):
    return {int(r): (float(s), kind, msg) for r, s, kind, msg in
            re.findall(r"rank (-?\d+): raised after ([\d.]+) s: (\w+): (.*)", text)}


def _shm():
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="module")
def faults(hosts):
    """({fault: (what each rank raised, output, ranks still running at FAULT_WAIT)}, what the jobs left in
    /dev/shm, {fault: its MASTER_PORT})."""
    before = _shm()
    ports = dict(zip(FAULTS, free_ports(len(FAULTS))))
    with Hosts(2) as cut_pair, Hosts(2) as cut_pair_2x2, Hosts(2) as cut_connecting, Hosts(2) as drop_pair:
        own = {"cut": cut_pair, "cut-2x2": cut_pair_2x2, "cut-connecting": cut_connecting, "drop": drop_pair}
        squatter = hosts.popen(0, [sys.executable, "-c", "import socket, sys, time\n"
                                   "s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen()\n"
                                   "print('listening', flush=True); time.sleep(600)",
                                   str(ports["master-port-in-use"])], stdout=subprocess.PIPE, text=True)
        try:
            assert squatter.stdout.readline().strip() == "listening"
            start = time.monotonic()
            jobs = {name: env_launch(own.get(name, hosts), per_host, [sys.executable, FAULT_SCRIPT],
                                     port=ports[name], FAULT_TIMEOUT=str(FAULT_TIMEOUT), **env)
                    for name, (per_host, env) in FAULTS.items()}
            results = {}
            for name, procs in jobs.items():
                got = collect(procs, max(start + FAULT_WAIT - time.monotonic(), 1))
                text = "\n".join(out for _, out in got)
                results[name] = (_raised(text), text, [r for r, (rc, _) in enumerate(got) if rc is None])
        finally:
            squatter.kill()
            squatter.wait()
    return results, _shm() - before, ports


def _fault(faults, name):
    results, leftover, _ = faults
    raised, text, hung = results[name]
    assert not hung, f"ranks {hung} hung past {FAULT_WAIT} s: " + text[-5000:]
    assert not leftover, leftover
    exits = {int(r): float(s) for r, s in re.findall(r"rank (-?\d+): exit handlers ran ([\d.]+) s after it raised", text)}
    for rank, (seconds, kind, msg) in raised.items():
        assert seconds < FAULT_TIMEOUT + 10, text[-5000:]
        # the exit waits for the store queries of a timeout's report for STORE_QUERY_SECONDS in all
        assert exits[rank] < STORE_QUERY_SECONDS + 3, (rank, exits, text[-5000:])
    return raised, text


@pytest.mark.parametrize("per_host", [1, 2])
def test_a_rank_killed_on_one_host_is_named_at_once(faults, per_host):
    victim = 2 * per_host - 1
    raised, text = _fault(faults, f"kill-2x{per_host}")
    assert "SIGKILL at step 5" in text, text[-3000:]
    assert sorted(raised) == [r for r in range(2 * per_host) if r != victim], text[-5000:]
    for rank, (seconds, kind, msg) in raised.items():
        assert victim in _named(msg, 2 * per_host), (rank, msg)   # (each names the victim)


def _named(msg, size):
    """The ranks of group '0' (of `size`) that an error names. A stage of the hierarchy names its ranks
    in the stage, saying which ranks of the group those are (a TCP stage in each name too), and a rank
    lost in another stage as the group's (where a peer gave the group up over it: rank 0 of a 2x2 group
    whose rank 3 was killed, from rank 2)."""
    stage = re.search(r"\[a stage of group '0': its ranks [\d, ]+ are ranks ([\d, ]+) there\]", msg)
    whole = [int(w) for w in stage[1].split(", ")] if stage else list(range(size))
    named = {int(w) if w else whole[int(q)] for q, w in
             re.findall(r"rank (\d+) \((?:pid|h\w+(?:, rank (\d+) of group)?)", msg)}
    return named | {int(w) for w in re.findall(r"rank (\d+) of group '0' was lost", msg)}


@pytest.mark.skipif(ulfm_unavailable() is not None, reason=ulfm_unavailable() or "")
def test_a_rank_killed_under_ulfm_mpirun_across_hosts_is_shrunk_away(hosts):
    """tests/faults/ulfm_survivors.py, 2 hosts x 2 ranks under `mpirun --with-ft ulfm` (MPI between
    the hosts): rank 1 is SIGKILLed; ranks 0, 2 and 3 raise EnginePeerLost (rank 2, whose wait inside
    MPI was on live ranks only, through the revoke of the broken group's communicators, or, where the
    revoke left its posted send pending, through a peer's note of the loss in the store), shrink it
    away, go on across the hosts over TCP and exit 0."""
    proc = mpirun_across(hosts, 2, ["--with-ft", "ulfm", sys.executable,
                                    os.path.join(ROOT, "tests", "faults", "ulfm_survivors.py")], timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert_rank_1_shrunk_away(out, 4)


def test_a_stage_of_the_hierarchy_names_its_ranks_in_the_whole_group_too(faults):
    """Rank 3 (host 1's second) stalls past the timeout in a hierarchical all_reduce; its peers time out
    in the stages (each host's over shared memory, those across the hosts over TCP), whose errors name
    the stages' own ranks. Each says which those are in the group: the stage across hosts said "rank 1
    did not arrive" of rank 3, with nothing to say so."""
    raised, text = _fault(faults, "stall-2x2")
    assert "stalls at step 5" in text, text[-3000:]
    assert {0, 1, 2} <= set(raised), text[-5000:]   # (and rank 3, once it wakes to a group given up)
    for rank, (_, _, msg) in raised.items():
        stage = re.search(r"group '0/(host|cross)(\d)'", msg)
        if stage:
            members = {"host": [2 * int(stage[2]), 2 * int(stage[2]) + 1], "cross": [int(stage[2]), 2 + int(stage[2])]}
            note = f"[a stage of group '0': its ranks 0, 1 are ranks {', '.join(map(str, members[stage[1]]))} there]"
            assert note in msg, (rank, msg)
    assert "are ranks 1, 3 there]" in raised[1][2], raised[1][2]   # (its stage across the hosts waits on rank 3)


def test_the_link_cut_ends_in_an_error_naming_the_peer_on_both_hosts(faults):
    raised, text = _fault(faults, "cut")
    assert "link cut at step 5" in text, text[-3000:]
    assert sorted(raised) == [0, 1], text[-5000:]
    # each side names the other: the one that still reaches the store from its arrival notes and from the
    # transport, the cut-off one (its store out of reach) from the transport: whom its wait was on
    assert "rank 1 did not arrive" in raised[0][2] and "waits on rank 1 (" in raised[0][2], raised[0][2]
    assert "waits on rank 0 (" in raised[1][2], raised[1][2]


def test_a_host_whose_sends_are_dropped_names_its_peer_as_timed_out_here_and_the_peer_names_it(faults):
    """Rank 1's host refuses every packet it sends (tc pfifo limit 0 on its link: a one-way cut at the
    host): its kernel gives the connection to rank 0 up after net.ipv4.tcp_retries2 refused sends (15 in a
    fresh namespace: 7.9 s, within the 10 s timeout), and rank 1 says so, naming rank 0 as beyond a cut
    link, not as a peer that closed its connection; rank 0, whose data still arrives, times out naming
    rank 1."""
    raised, text = _fault(faults, "drop")
    assert "sends dropped at step 5" in text, text[-3000:]
    assert sorted(raised) == [0, 1], text[-5000:]
    assert raised[1][1] == "EnginePeerLost", raised[1]
    assert "the connection to rank 0 (" in raised[1][2] and "timed out here" in raised[1][2], raised[1][2]
    assert "rank 1 did not arrive" in raised[0][2] and "waits on rank 1 (" in raised[0][2], raised[0][2]


def test_a_link_cut_between_hosts_of_two_ranks_each_ends_every_rank_naming_a_rank_beyond_it(faults):
    """Rank 3 sets host 1's link down: the hierarchy's stage across the hosts breaks on both sides (its
    shared-memory stages stay whole), and every rank ends within the timeout naming a rank on the other
    host, as the group's or by its stage note; none hangs, nothing is left in /dev/shm."""
    raised, text = _fault(faults, "cut-2x2")
    assert "link cut at step 5" in text, text[-3000:]
    assert sorted(raised) == [0, 1, 2, 3], text[-5000:]
    for rank, (seconds, kind, msg) in raised.items():
        assert _named(msg, 4) & ({2, 3} if rank < 2 else {0, 1}), (rank, msg)


def test_a_link_cut_while_the_group_connects_ends_within_the_timeout_naming_the_peer(faults):
    """Rank 1 sets its host's link down after the init's last exchange, before the ranks connect: each
    fails to connect within the timeout, naming the other, and raises then (the cut-off one, whose
    store is beyond the cut, once its part of the next exchange has waited 5 s more for the store).
    Each waited another whole timeout in that exchange first, for the other's part (20 and 25 s)."""
    raised, text = _fault(faults, "cut-connecting")
    assert "link cut while the group connects" in text, text[-3000:]
    assert sorted(raised) == [0, 1], text[-5000:]
    for rank, (seconds, kind, msg) in raised.items():
        assert f"could not connect to rank {1 - rank} (" in msg, (rank, msg)
        assert seconds < FAULT_TIMEOUT + (3 if rank == 0 else STORE_QUERY_SECONDS + 3), (rank, seconds, msg)


def test_a_wrong_master_addr_fails_naming_it(faults):
    raised, text = _fault(faults, "wrong-master-addr")
    assert sorted(raised) == [0, 1], text[-5000:]
    for rank, (seconds, kind, msg) in raised.items():
        assert "10.77.0.99" in msg, text[-5000:]


def test_a_master_port_in_use_fails_naming_it_on_every_rank(faults):
    raised, text = _fault(faults, "master-port-in-use")
    port = faults[2]["master-port-in-use"]
    assert sorted(raised) == [0, 1], text[-5000:]
    # rank 0 can't start the store there; rank 1 reached the squatter, which never answers as the store
    assert "address already in use" in raised[0][2].lower() and str(port) in raised[0][2], raised[0]
    assert f"MASTER_PORT={port}" in raised[1][2] and "got no answer" in raised[1][2], raised[1]


# One mpirun per shape runs the examples and the benchmark, one after another in each process
# (tests/scripts.py): check_collectives (every c10d collective against references each rank computes),
# ddp_exact (DDP across the hosts trains exactly like one process on the full batch) and the benchmark,
# every result checked; at 2x2 the benchmark also runs the groups whose hosts talk over the engine's TCP
# and over MPI (ENGINE_INTERHOST) side by side, as the comparison does.
EXAMPLES = {"check_collectives.py": "ALL PASS: 16 collectives on {n} ranks, transport mpi",
            "ddp_exact.py": "DDP over {n} processes (mpi), 20 steps"}
BENCH_BACKENDS = {1: "engine,gloo,mpi4py", 2: "engine,engine-interhost-tcp,engine-interhost-mpi,gloo,mpi4py"}


@pytest.mark.parametrize("per_host", [1, 2])
def test_examples_and_bench_across_hosts(hosts, per_host):
    scripts = []
    for example in EXAMPLES:
        scripts += [os.path.join(ROOT, "examples", example), "--"]
    scripts += ["-m", "bench", "all_reduce", "-b", "1K", "-e", "4M", "-f", "64", "--backends", BENCH_BACKENDS[per_host],
                "-c", "1", "--rounds", "1", "--budget", "0.05"]
    proc = mpirun_across(hosts, per_host, [sys.executable, os.path.join(ROOT, "tests", "scripts.py"), *scripts],
                         timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    for line in EXAMPLES.values():
        assert line.format(n=2 * per_host) in proc.stdout, proc.stdout[-3000:]
    backends = BENCH_BACKENDS[per_host].split(",")
    wrong = re.findall(r"# Out of bounds values : (\d+)", proc.stdout)
    assert wrong == ["0"] * len(backends) and "FAILED" not in proc.stdout, proc.stdout[-3000:]
    for backend in backends:
        assert f"# all_reduce on {backend}:" in proc.stdout, (backend, proc.stdout[-3000:])


# The conformance matrix's rows across hosts (tests/mpi/test_matrix.py): every MPI entry forced in
# turn, the hierarchical ones where hosts have two ranks; the automatic choice in the ENGINE_HIER modes
# that make different plans (auto and slice make the same one: tests/test_registry.py; `python
# tests/matrix.py` runs all, off included: a flat group, as 2x1 is here and mpiexec's 4 ranks are on one host).
MATRIX_CONFIGS = [(1, "auto"), (2, "auto"), (2, "leader")]


@pytest.mark.parametrize("per_host,mode", MATRIX_CONFIGS, ids=[f"2x{n}-{m}" for n, m in MATRIX_CONFIGS])
def test_conformance_matrix_across_hosts(hosts, per_host, mode):
    """Every entry forced, at 2x1 and 2x2; in leader mode (which differs from auto only in the automatic
    choice) the automatic choice alone."""
    from matrix import RANK_FILE, outcomes
    only = ["-k", "automatic or transport"] if mode == "leader" else []
    proc = mpirun_across(hosts, per_host, [sys.executable, "-m", "pytest", "-q", "-x", "-rA", "-p",
                                           "no:cacheprovider", "-o", "addopts=", "--color=no", *only, RANK_FILE],
                         timeout=600, ENGINE_TIMEOUT="30", ENGINE_MPI_SUITE="1", ENGINE_HIER=mode)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    from engine import registry
    got = outcomes(proc.stdout)
    hierarchical = {e.key for e in registry.ENTRIES if "hierarchy" in e.needs and e.transport == "mpi"}
    assert set(got.values()) == {"PASSED"}, got
    assert (hierarchical <= set(got)) == (per_host == 2 and mode == "auto"), got


@pytest.mark.parametrize("master", ["localhost", "127.0.0.1"])
def test_a_loopback_master_addr_on_the_rendezvous_host_is_not_given_to_the_other_hosts(hosts, master):
    """MASTER_ADDR=localhost on the rendezvous host's ranks (Kubernetes' PyTorchJob sets it so on its
    master), or 127.0.0.1 (torchrun's default --master-addr there), the other host's ranks meeting at
    its address: every collective over TCP between the hosts, host 0's ranks listening on an address
    host 1 reaches (they listened on loopback, and host 1's connections were refused by its own)."""
    from hosts import env_launch_across
    results = env_launch_across(hosts, 1, [sys.executable, os.path.join(ROOT, "examples", "check_collectives.py")],
                                timeout=120, master=[master, hosts.addrs[0]], ENGINE_TIMEOUT="20")
    text = "\n".join(out for _, out in results)
    assert all(rc == 0 for rc, _ in results), suite_report(text)
    assert "ALL PASS: 16 collectives on 2 ranks, transport tcp" in text, text[-3000:]


# torch's tcp:// rendezvous (or a TCPStore passed as store=), no MASTER_ADDR: the host the store meets at
URL_INIT = """
import os, torch, torch.distributed as dist
url = "tcp://%s:%s" % (os.environ.pop("MASTER_ADDR"), os.environ.pop("MASTER_PORT"))
dist.init_process_group("engine", init_method=url, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
t = torch.full((5,), dist.get_rank() + 1.0)
dist.all_reduce(t)
assert t.tolist() == [3.0] * 5, t
print("rank %d: summed over %s" % (dist.get_rank(), dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))._comm.transport))
dist.destroy_process_group()
"""


def test_a_tcp_url_rendezvous_without_master_addr_listens_on_the_route_to_the_stores_host(hosts):
    """init_method="tcp://host0:port", no MASTER_ADDR: the TCP transport listens on the route to the
    store's host, as to MASTER_ADDR; it listened on the hostname's address, which here is a decoy no
    other host reaches (tests/hosts.py), as on hosts with several networks."""
    from hosts import env_launch_across
    results = env_launch_across(hosts, 1, [sys.executable, "-c", URL_INIT], timeout=120, ENGINE_TIMEOUT="20")
    text = "\n".join(out for _, out in results)
    assert all(rc == 0 for rc, _ in results), suite_report(text)
    assert sorted(re.findall(r"rank (\d): summed over tcp", text)) == ["0", "1"], text[-3000:]


@pytest.mark.parametrize("per_host", [1, 2])
def test_abort_then_reconfigure_across_hosts_under_torchrun(hosts, per_host):
    """Across the two hosts over TCP (flat at 2x1, hierarchical at 2x2): the last rank never joins an
    all_reduce, abort() from another thread ends the others' call within 1 s, and a reconfigure of every
    rank (the members meeting through their handles, no store) gives a group over TCP that sums right.
    At 2x1 host 0's torchrun has torchrun's default --master-addr, 127.0.0.1: its rank's handle names
    a loopback address, which host 1 can't reach (host 1's rank is the hub), and its TCP end listens
    again where host 1 reaches it."""
    script = os.path.join(ROOT, "tests", "faults", "abort_blocked.py")
    results = torchrun_across(hosts, per_host, [script], timeout=180,
                              master=["127.0.0.1", hosts.addrs[0]] if per_host == 1 else None)
    text = "\n".join(out for _, out in results)
    assert all(rc == 0 for rc, _ in results), text[-8000:]
    ended = re.findall(r"abort: rank (\d+) all_reduce over (\w+) ended (\S+) s after abort\(\) \(thread\): (\w+)", text)
    assert sorted(int(r) for r, *_ in ended) == list(range(2 * per_host - 1)), text[-5000:]
    print(f"2x{per_host}: abort ended the blocked all_reduce after", ", ".join(f"rank {r}: {s} s" for r, _, s, _ in ended))
    assert all(float(s) < 1.0 and over == "tcp" for _, over, s, _ in ended), ended
    assert text.count("reconfigured after abort over tcp: all_reduce right") == 2 * per_host, text[-5000:]
