"""Communicator: collectives and point-to-point on any CPU buffer, over one MPI group.

Buffers are numpy arrays, torch CPU tensors, bytearrays or DLPack objects, read without copies.
Output arguments are written in place; a missing recvbuf means "in place on sendbuf" where MPI
allows it. All MPI calls and kernels run without the GIL. Every operation is numbered and recorded
by the communicator's Watch (engine/watch.py): timeouts, stall warnings, flight recorder, trace;
with ENGINE_DEBUG=1 each collective's signature is compared across ranks before it runs.
"""

import os

import numpy as np
from mpi4py import MPI

from . import _core
from .algorithms import AllreduceSelector
from .config import env_int
from .ops import ReduceOp, op_code
from .watch import Watch

ANY_SOURCE = -1
ANY_TAG = -1
_OP_IDS = {name: i for i, name in enumerate(
    ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall", "barrier"))}
_SIG_LEN = 12  # op, dtype, count, root, reduce op, seq, ndim, 5 dims


def debug_enabled():
    return os.environ.get("ENGINE_DEBUG", "") not in ("", "0") or \
        os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


class Communicator:
    """A group of ranks. Wraps a Dup of `comm` (MPI.COMM_WORLD by default): the engine's traffic never
    mixes with the caller's. Three private communicators keep native collectives, the engine's own
    algorithms and user point-to-point apart, so a user's ANY_TAG receive never sees ring messages.

    timeout: seconds an operation may take (default ENGINE_TIMEOUT, else 1800). store: a key-value
    store shared by the ranks (torch's Store API: set/check), used to name the ranks that did not
    arrive when an operation times out. name: the group's name in messages and traces.
    """

    def __init__(self, comm=None, *, ring_segment_bytes=None, timeout=None, store=None, name="world",
                 _owned=None):
        base = comm if comm is not None else MPI.COMM_WORLD
        self._comms = [base.Dup() if _owned is None else _owned, base.Dup(), base.Dup()]
        for c in self._comms:
            c.Set_errhandler(MPI.ERRORS_RETURN)
        seg = ring_segment_bytes or env_int("ENGINE_RING_SEGMENT_BYTES", 512 << 10)
        self._core = _core.CoreComm(*self._comms, seg)
        chunk = env_int("ENGINE_MPI_CHUNK_ELEMENTS", 0)
        if chunk:
            self._core.set_chunk(chunk)
        self._selector = AllreduceSelector()
        self.rank = self._core.rank
        self.size = self._core.size
        self.name = name
        self.watch = Watch(name, self.rank, self.size, timeout, store)
        self._core.set_watch(self.watch, self.watch.interval)
        self._debug = debug_enabled()

    @property
    def mpi_comm(self):
        """The MPI communicator of the native collectives (a Dup of the one given)."""
        return self._comms[0]

    def __repr__(self):
        return f"<engine.Communicator {self.name!r} rank {self.rank} of {self.size}>"

    # -- groups --

    def subgroup(self, ranks, *, name=None, store=None):
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
        return Communicator(sub, ring_segment_bytes=self._core.ring_segment_bytes, timeout=self.watch.timeout,
                            store=store, name=name or f"{self.name}/{'-'.join(map(str, ranks))}", _owned=sub)

    def free(self):
        """Releases the MPI communicators; the object is unusable afterwards."""
        self._core = None
        for c in self._comms:
            if c != MPI.COMM_NULL:
                c.Free()
        self._comms = []

    # -- bracketing --

    def _run(self, op, buf, native, fn, *args, algorithm=None, root=-1, redop=-1, info=None):
        if info is None:
            info = _core.message_shape(buf) if buf is not None else (0, 0, None)
        if self._debug:
            self._check_signature(op, buf, info, root, redop)
        rec = self.watch.begin(op, info[0], info[2], algorithm, native)
        try:
            fn(*args)
        except BaseException as exc:
            self.watch.end(rec, exc)
            raise
        self.watch.end(rec)

    def _check_signature(self, op, buf, info, root, redop):
        """Debug mode: every rank's (op, dtype, count, shape, root, reduce op, seq) compared before the op."""
        shape = tuple(getattr(buf, "shape", ()) or ())[:5]
        sig = np.full(_SIG_LEN, -1, np.int64)
        dtype_code = _core.DTYPE_NAMES.index(info[2]) if info[2] else -1
        sig[:7] = (_OP_IDS.get(op, 99), dtype_code, info[0], root, redop if isinstance(redop, int) else 100,
                   self.watch.seq + 1, len(shape))
        sig[7:7 + len(shape)] = shape
        everyone = np.empty(_SIG_LEN * self.size, np.int64)
        rec = self.watch.begin(f"{op} signature check", _SIG_LEN, "int64", None, False, numbered=False)
        try:
            self._core.allgather_watched(sig, everyone)
        except BaseException as exc:
            self.watch.end(rec, exc)
            raise
        self.watch.end(rec)
        rows = everyone.reshape(self.size, _SIG_LEN)
        if (rows == rows[0]).all():
            return
        names = {v: k for k, v in _OP_IDS.items()}

        def describe(row):
            nd = int(row[6])
            return (f"{names.get(int(row[0]), 'op ' + str(row[0]))} #{int(row[5])} with {int(row[2])} "
                    f"{_core.DTYPE_NAMES[int(row[1])] if row[1] >= 0 else '-'} elements"
                    + (f" shape {tuple(int(x) for x in row[7:7 + nd])}" if nd else "")
                    + (f" root {int(row[3])}" if row[3] >= 0 else "")
                    + (f" op {ReduceOp(int(row[4])).name}" if 0 <= row[4] < len(ReduceOp) else ""))

        groups = {}
        for r in range(self.size):
            groups.setdefault(describe(rows[r]), []).append(r)
        detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d}" for d, rs in groups.items())
        raise self.watch.mismatch(f"collective mismatch in group {self.name!r}: {detail}")

    # -- collectives --

    def allreduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM, *, algorithm=None):
        """recvbuf = op(sendbuf of all ranks); in place on sendbuf when recvbuf is None.

        algorithm: None (ENGINE_ALLREDUCE_ALGO, else the size rules), 'auto', 'native', 'ring', 'rdouble'.
        """
        info = _core.message_shape(sendbuf)
        name = self._selector.choose(info[0] * info[1], info[0], self.size, algorithm)
        code = op_code(op)
        self._run("allreduce", sendbuf, name == "native", self._core.allreduce, sendbuf, recvbuf, code,
                  _core.ALGORITHM_CODES[name], algorithm=name, redop=code, info=info)
        return recvbuf if recvbuf is not None else sendbuf

    def algorithm_for(self, nbytes, count=None):
        """The allreduce algorithm the rules pick for a message of nbytes (for benchmarks and tests)."""
        return self._selector.choose(nbytes, nbytes if count is None else count, self.size)

    def broadcast(self, buf, root=0):
        self._run("broadcast", buf, True, self._core.broadcast, buf, root, root=root)
        return buf

    def reduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM, root=0):
        """On root: recvbuf (or sendbuf, in place) = op(sendbuf of all ranks)."""
        code = op_code(op)
        self._run("reduce", sendbuf, True, self._core.reduce, sendbuf, recvbuf, code, root, root=root, redop=code)
        return recvbuf if recvbuf is not None else sendbuf

    def allgather(self, sendbuf, recvbuf, counts=None):
        """recvbuf = concat(sendbuf of ranks 0..n-1); counts: elements per rank when they differ."""
        self._run("allgather", sendbuf, True, self._core.allgather, sendbuf, recvbuf, counts)
        return recvbuf

    def gather(self, sendbuf, recvbuf=None, root=0, counts=None):
        self._run("gather", sendbuf, True, self._core.gather, sendbuf, recvbuf, root, counts, root=root)
        return recvbuf

    def scatter(self, sendbuf, recvbuf, root=0, counts=None):
        self._run("scatter", recvbuf, True, self._core.scatter, sendbuf, recvbuf, root, counts, root=root)
        return recvbuf

    def reduce_scatter(self, sendbuf, recvbuf, op=ReduceOp.SUM, counts=None):
        """recvbuf = this rank's block of op(sendbuf of all ranks); counts: block sizes when uneven."""
        code = op_code(op)
        self._run("reduce_scatter", sendbuf, True, self._core.reduce_scatter, sendbuf, recvbuf, code, counts,
                  redop=code)
        return recvbuf

    def alltoall(self, sendbuf, recvbuf, send_counts=None, recv_counts=None):
        self._run("alltoall", sendbuf, True, self._core.alltoall, sendbuf, recvbuf, send_counts, recv_counts)
        return recvbuf

    def barrier(self):
        self._run("barrier", None, True, self._core.barrier)

    # -- point to point (not numbered: they need not match across all ranks) --

    def send(self, buf, dest, tag=0):
        self._core.send(buf, dest, tag, self.watch.peer_hook("send", dest, tag))

    def recv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        """Returns (source, tag, count) of the message received; source/tag None or -1 mean any."""
        return self._core.recv(buf, _any(source), _any(tag), self.watch.peer_hook("recv", source, tag))

    def isend(self, buf, dest, tag=0):
        """Returns a Request: .wait(), .test()."""
        return self._core.isend(buf, dest, tag, self.watch.peer_hook("isend", dest, tag))

    def irecv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        """Returns a Request whose .wait() gives (source, tag, count)."""
        return self._core.irecv(buf, _any(source), _any(tag), self.watch.peer_hook("irecv", source, tag))


def _any(x):
    return -1 if x is None else x
