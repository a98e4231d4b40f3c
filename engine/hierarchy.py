"""Where a group's ranks sit, and the two levels made from it: the stage groups of the hierarchy
(pyx/hierarchy.pxi runs its collectives). Across hosts with the same number (2 or more) of ranks on
each: shared memory inside each host, the group's transport (TCP or MPI) between hosts. A
shared-memory group whose ranks sit on several sockets (NUMA nodes), the same number on each, gets the
same two levels with sockets for hosts, shared memory on both (sockets_of: the nodes of the ranks'
cores, or ENGINE_SOCKETS). ENGINE_HIER=off keeps every group flat.
"""

import collections
import glob
import os

from . import _core, registry
from .bootstrap import gather
from .config import env_int

NODES = "/sys/devices/system/node"


def numa_nodes(root=NODES):
    """{node: its CPUs} from sysfs ({} where the kernel shows none)."""
    out = {}
    for path in glob.glob(os.path.join(root, "node[0-9]*", "cpulist")):
        with open(path) as f:
            text = f.read().strip()
        cpus = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        out[int(os.path.basename(os.path.dirname(path))[4:])] = cpus
    return out


def forced_sockets():
    """ENGINE_SOCKETS: the sockets each host's ranks are split into (0: the machine's own)."""
    forced = env_int("ENGINE_SOCKETS", 0)
    if forced < 0:
        raise ValueError(f"ENGINE_SOCKETS={forced}: expected a number of sockets (0 or unset: the machine's)")
    return forced


def sockets_of(everyone, nodes=None):
    """Each rank's place for a shared-memory group (everyone: every rank's (host, pid, cores)): its host,
    and where the host's ranks sit on 2+ NUMA nodes, the node its cores lie in ("host/node1"). A rank
    whose cores span nodes (not bound) leaves the group on one level (None). ENGINE_SOCKETS=N splits
    each host's ranks, in group order, into N sockets of equal size instead (tests force two sockets
    on one node so)."""
    forced = forced_sockets()
    hosts = [h for h, _, _ in everyone]
    if forced:
        _, local_of, _ = topology(hosts)
        local = collections.Counter(hosts)
        return [f"{h}/socket{i * forced // local[h]}" for h, i in zip(hosts, local_of)]
    nodes = numa_nodes() if nodes is None else nodes
    if len(nodes) < 2:
        return None
    out = []
    for h, _, cores in everyone:
        homes = [n for n, cpus in nodes.items() if set(cores) <= cpus]
        if not homes:
            return None
        out.append(f"{h}/node{homes[0]}")
    return out


def topology(hosts):
    """(host index of each rank, local index of each rank, ranks per host or None when uneven)."""
    order = list(dict.fromkeys(hosts))
    host_of = [order.index(h) for h in hosts]
    local_of, seen = [], {}
    for h in host_of:
        local_of.append(seen.get(h, 0))
        seen[h] = seen.get(h, 0) + 1
    sizes = set(seen.values())
    return host_of, local_of, (sizes.pop() if len(sizes) == 1 else None)


def layout(comm, everyone):
    """(host index, local index) of each rank of group comm in its two levels, or None where it stays
    flat. everyone: every rank's (host, pid, cores), which every rank reads alike."""
    if registry.hier_mode() == "off":
        return None
    hosts = [h for h, _, _ in everyone] if comm._transport.network else sockets_of(everyone)
    if hosts is None or len(set(hosts)) < 2:
        return None
    host_of, local_of, per_host = topology(hosts)
    if not per_host or per_host < 2:
        return None
    return host_of, local_of


def build(comm, boot, shape, make_stage):
    """(the core's Hierarchy, the stage Communicators) of group comm, whose layout() is shape;
    make_stage(sub_bootstrap, transport, name) makes one stage Communicator over a split of boot."""
    host_of, local_of = shape
    me = comm.rank
    made = []

    def stage(color, key, part, transport, name):
        # Each stage is made by some ranks only; all of them learn whether every rank made its own,
        # so that a stage refused on one host (its ranks' plans differ) fails the group on every host,
        # instead of leaving the others waiting in the next split.
        def make():
            sub = boot.split(color, key, part)
            made.append(None if sub is None else make_stage(sub, transport, f"{comm.name}/{name}"))
        try:
            gather(boot, make, f"make its {part} stage")
        except BaseException:
            for s in made:
                if s is not None:
                    s.free()
            raise
        return made[-1]
    local = stage(host_of[me], local_of[me], "host", "shm", f"host{host_of[me]}")
    cross = stage(local_of[me], host_of[me], "cross", comm.transport, f"cross{local_of[me]}")
    leaders = stage(0 if local_of[me] == 0 else None, host_of[me], "leaders", comm.transport, "leaders")
    stages = tuple(s for s in (local, cross, leaders) if s is not None)
    try:
        hier = _core.Hierarchy(local.core, cross.core, host_of, local_of, leaders.core if leaders else None,
                               registry.LEADER_ENTRIES)
    except BaseException:
        for s in stages:
            s.free()
        raise
    return hier, stages
