"""Communicator: collectives and point-to-point on any CPU buffer, over one MPI group.

Buffers are numpy arrays, torch CPU tensors, bytearrays or DLPack objects, read without copies.
Output arguments are written in place; a missing recvbuf means "in place on sendbuf" where MPI
allows it. All MPI calls and kernels run without the GIL.
"""

from mpi4py import MPI

from . import _core
from .algorithms import AllreduceSelector
from .config import env_int
from .ops import ReduceOp, op_code

ANY_SOURCE = -1
ANY_TAG = -1


class Communicator:
    """A group of ranks. Wraps a Dup of `comm` (MPI.COMM_WORLD by default): the engine's traffic never
    mixes with the caller's. Three private communicators keep native collectives, the engine's own
    algorithms and user point-to-point apart, so a user's ANY_TAG receive never sees ring messages."""

    def __init__(self, comm=None, *, ring_segment_bytes=None, _owned=None):
        base = comm if comm is not None else MPI.COMM_WORLD
        self._comms = [base.Dup() if _owned is None else _owned, base.Dup(), base.Dup()]
        for c in self._comms:
            c.Set_errhandler(MPI.ERRORS_RETURN)
        seg = ring_segment_bytes or env_int("ENGINE_RING_SEGMENT_BYTES", 512 << 10)
        self._core = _core.CoreComm(*self._comms, seg)
        self._selector = AllreduceSelector()
        self.rank = self._core.rank
        self.size = self._core.size

    @property
    def mpi_comm(self):
        """The MPI communicator of the native collectives (a Dup of the one given)."""
        return self._comms[0]

    def __repr__(self):
        return f"<engine.Communicator rank {self.rank} of {self.size}>"

    # -- groups --

    def subgroup(self, ranks):
        """A Communicator over `ranks` (ranks of this group, in the new group's order). Collective over
        the members only (MPI_Comm_create_group): ranks outside must not call it."""
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"subgroup ranks must be a non-empty list without duplicates, got {ranks}")
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ValueError(f"subgroup ranks {bad} are out of range for a group of size {self.size}")
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in subgroup {ranks}; only members call subgroup()")
        coll = self._comms[0]
        group = coll.Get_group().Incl(ranks)
        try:
            sub = coll.Create_group(group, tag=0)
        finally:
            group.Free()
        return Communicator(sub, ring_segment_bytes=self._core.ring_segment_bytes, _owned=sub)

    def free(self):
        """Releases the MPI communicators; the object is unusable afterwards."""
        self._core = None
        for c in self._comms:
            if c != MPI.COMM_NULL:
                c.Free()
        self._comms = []

    # -- collectives --

    def allreduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM, *, algorithm=None):
        """recvbuf = op(sendbuf of all ranks); in place on sendbuf when recvbuf is None.

        algorithm: None (ENGINE_ALLREDUCE_ALGO, else the size rules), 'auto', 'native', 'ring', 'rdouble'.
        """
        count, itemsize, _ = _core.message_shape(sendbuf)
        name = self._selector.choose(count * itemsize, count, self.size, algorithm)
        self._core.allreduce(sendbuf, recvbuf, op_code(op), _core.ALGORITHM_CODES[name])
        return recvbuf if recvbuf is not None else sendbuf

    def algorithm_for(self, nbytes, count=None):
        """The allreduce algorithm the rules pick for a message of nbytes (for benchmarks and tests)."""
        return self._selector.choose(nbytes, nbytes if count is None else count, self.size)

    def broadcast(self, buf, root=0):
        self._core.broadcast(buf, root)
        return buf

    def reduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM, root=0):
        """On root: recvbuf (or sendbuf, in place) = op(sendbuf of all ranks)."""
        self._core.reduce(sendbuf, recvbuf, op_code(op), root)
        return recvbuf if recvbuf is not None else sendbuf

    def allgather(self, sendbuf, recvbuf, counts=None):
        """recvbuf = concat(sendbuf of ranks 0..n-1); counts: elements per rank when they differ."""
        self._core.allgather(sendbuf, recvbuf, counts)
        return recvbuf

    def gather(self, sendbuf, recvbuf=None, root=0, counts=None):
        self._core.gather(sendbuf, recvbuf, root, counts)
        return recvbuf

    def scatter(self, sendbuf, recvbuf, root=0, counts=None):
        self._core.scatter(sendbuf, recvbuf, root, counts)
        return recvbuf

    def reduce_scatter(self, sendbuf, recvbuf, op=ReduceOp.SUM, counts=None):
        """recvbuf = this rank's block of op(sendbuf of all ranks); counts: block sizes when uneven."""
        self._core.reduce_scatter(sendbuf, recvbuf, op_code(op), counts)
        return recvbuf

    def alltoall(self, sendbuf, recvbuf, send_counts=None, recv_counts=None):
        self._core.alltoall(sendbuf, recvbuf, send_counts, recv_counts)
        return recvbuf

    def barrier(self):
        self._core.barrier()

    # -- point to point --

    def send(self, buf, dest, tag=0):
        self._core.send(buf, dest, tag)

    def recv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        """Returns (source, tag, count) of the message received; source/tag None or -1 mean any."""
        return self._core.recv(buf, _any(source), _any(tag))

    def isend(self, buf, dest, tag=0):
        """Returns a Request: .wait(), .test()."""
        return self._core.isend(buf, dest, tag)

    def irecv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        """Returns a Request whose .wait() gives (source, tag, count)."""
        return self._core.irecv(buf, _any(source), _any(tag))


def _any(x):
    return -1 if x is None else x
