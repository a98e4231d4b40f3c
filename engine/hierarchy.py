"""Hierarchical collectives for groups spanning hosts with several ranks each: shared memory inside
each host, the group's transport between hosts (the engine's TCP transport, or MPI under mpirun). The
same two levels serve a shared-memory group whose ranks sit on several sockets (NUMA nodes) of one
host: shared memory inside each socket, then shared memory across sockets, so each stage's traffic
stays on one socket's memory where it can (sockets_of: the nodes of the ranks' cores, or ENGINE_SOCKETS).
Below, "host" is the place of the first level: a host, or a socket.

Every rank carries a slice across hosts (measured better than one leader per host: docs/tuning.md), so
all the ranks' links and cores work at once:

    allreduce       local reduce_scatter (shm) -> cross allreduce of my slice (TCP or MPI, among the
                    ranks of the same local index) -> local allgather (shm)
    broadcast       cross broadcast among the root's local index -> local broadcast from it
    allgather       cross allgather among my local index -> local allgather -> reorder to rank order
    reduce_scatter  reorder -> local reduce_scatter -> cross reduce_scatter

`leader` variants (local reduce to one rank per host, an allreduce among those, local broadcast) exist
for the comparison and for ENGINE_HIER=leader. Workspaces are allocated once per group and grown.
Needs the same number of ranks on every host (otherwise the group stays flat).
"""

import collections
import glob
import os

import numpy as np

from . import _core
from .config import env_int
from .ops import ReduceOp, op_code

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


def sockets_of(everyone, nodes=None):
    """Each rank's place for a shared-memory group (everyone: every rank's (host, pid, cores)): its host,
    and where the host's ranks sit on 2+ NUMA nodes, the node its cores lie in ("host/node1"). A rank
    whose cores span nodes (not bound) leaves the group on one level (None). ENGINE_SOCKETS=N splits
    each host's ranks, in group order, into N sockets of equal size instead (tests force two sockets
    on one node so)."""
    forced = env_int("ENGINE_SOCKETS", 0)
    hosts = [h for h, _, _ in everyone]
    if forced:
        if forced < 0:
            raise ValueError(f"ENGINE_SOCKETS={forced}: expected a number of sockets (0 or unset: the machine's)")
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


def _empty_like(buf, count):
    if type(buf).__module__.split(".")[0] == "torch":
        return buf.new_empty(count)
    return np.empty(count, dtype=buf.dtype)


def _copy(dst, src):
    if hasattr(dst, "copy_"):
        dst.copy_(src)
    else:
        dst[...] = src


def _flat(buf):
    return buf.reshape(-1)


class Hierarchy:
    """The two levels of one group: `local` (this host's ranks, shared memory) and `cross` (the ranks of
    this local index on every host, TCP or MPI), with the rank maps to put blocks back in rank order.
    The core calls its reductions with SUM for AVG and divides the result itself, as for every
    algorithm (CoreComm.invoke)."""

    def __init__(self, local, cross, host_of, local_of, leaders=None):
        self.local, self.cross, self.leaders = local, cross, leaders
        self.host_of, self.local_of = host_of, local_of
        self.hosts, self.per_host = cross.size, local.size
        # place[h][i] = the global rank at host h, local index i
        self.place = [[0] * self.per_host for _ in range(self.hosts)]
        for g, (h, i) in enumerate(zip(host_of, local_of)):
            self.place[h][i] = g
        self._work = {}

    def _buffer(self, like, count, slot):
        key = (slot, str(getattr(like, "dtype", "")), type(like))
        buf = self._work.get(key)
        if buf is None or buf.shape[0] < count:
            buf = self._work[key] = _empty_like(like, max(count, 1))
        return buf[:count]

    # -- allreduce --

    def allreduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM):
        op = op_code(op)
        buf = sendbuf if recvbuf is None else recvbuf
        if recvbuf is not None:
            _copy(recvbuf, sendbuf)
        flat = _flat(buf)
        n, L = flat.shape[0], self.per_host
        counts = [_core.ring_block(n, L, i)[1] for i in range(L)]
        mine = self._buffer(flat, counts[self.local.rank], "slice")
        self.local.reduce_scatter(flat, mine, op, counts)
        self.cross.allreduce(mine, None, op)
        self.local.allgather(mine, flat, counts)
        return buf

    def allreduce_leader(self, sendbuf, recvbuf=None, op=ReduceOp.SUM):
        op = op_code(op)
        buf = sendbuf if recvbuf is None else recvbuf
        if recvbuf is not None:
            _copy(recvbuf, sendbuf)
        self.local.reduce(buf, None, op, 0)
        if self.leaders is not None:
            self.leaders.allreduce(buf, None, op)
        self.local.broadcast(buf, 0)
        return buf

    # -- broadcast --

    def broadcast(self, buf, root=0):
        h, i = self.host_of[root], self.local_of[root]
        if self.local.rank == i:
            self.cross.broadcast(buf, h)
        self.local.broadcast(buf, i)
        return buf

    # -- allgather / reduce_scatter (equal counts) --

    def allgather(self, sendbuf, recvbuf):
        n = _flat(sendbuf).shape[0]
        H, L = self.hosts, self.per_host
        across = self._buffer(_flat(sendbuf), H * n, "across")
        self.cross.allgather(sendbuf, across)                 # [h] = rank (h, my local index)
        both = self._buffer(_flat(sendbuf), L * H * n, "both")
        self.local.allgather(across, both)                    # [i][h] = rank (h, i)
        out = _flat(recvbuf)
        for i in range(L):
            for h in range(H):
                g = self.place[h][i]
                _copy(out[g * n:(g + 1) * n], both[(i * H + h) * n:(i * H + h + 1) * n])
        return recvbuf

    def reduce_scatter(self, sendbuf, recvbuf, op=ReduceOp.SUM):
        op = op_code(op)
        n = _flat(recvbuf).shape[0]
        H, L = self.hosts, self.per_host
        src = _flat(sendbuf)
        both = self._buffer(src, L * H * n, "both")
        for i in range(L):
            for h in range(H):
                g = self.place[h][i]
                _copy(both[(i * H + h) * n:(i * H + h + 1) * n], src[g * n:(g + 1) * n])
        across = self._buffer(src, H * n, "across")
        self.local.reduce_scatter(both, across, op)          # my local index's H blocks, reduced over the host
        self.cross.reduce_scatter(across, recvbuf, op)       # my block, reduced over the hosts
        return recvbuf

    def free(self):
        for comm in (self.local, self.cross, self.leaders):
            if comm is not None:
                comm.free()
