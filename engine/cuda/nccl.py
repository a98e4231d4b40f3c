"""One NCCL communicator (cupy.cuda.nccl.NcclCommunicator) for one group on one device, and how its
unique id reaches every rank: over the group's CPU communicator (unique_id_over), the one channel
every group has. A store would not do: a reconfigured group's members need share none, and a key
written for the group's earlier members would be read again.

Calls take pointers, counts and NCCL codes (tables.py) and enqueue on the given CUDA stream; none
blocks the host. Movement collectives send bytes (ncclInt8), so every dtype moves, complex included.
"""

import threading

from ..bootstrap import CommBootstrap, gather
from . import load_cupy
from .tables import NCCL_INT8

ABORT_LOCK_SECONDS = 0.5   # how long abort() waits for a call in progress to finish issuing


def new_unique_id():
    """ncclGetUniqueId as 128 bytes (cupy 14 returns bytes, older cupy a tuple of C chars)."""
    _, nccl = load_cupy()
    uid = nccl.get_unique_id()
    return uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)


def _for_cupy(uid, cupy):
    """The id in the form this cupy's NcclCommunicator takes: bytes from cupy 14, before that a tuple of
    (signed) C chars."""
    if int(cupy.__version__.split(".")[0]) >= 14:
        return bytes(uid)
    return tuple(b - 256 if b > 127 else b for b in uid)


UNIQUE_ID_BYTES = 128   # sizeof(ncclUniqueId)


def unique_id_over(comm, make=new_unique_id, ready=lambda: None, group=None):
    """Rank 0's ncclUniqueId (make()) on every rank, over comm (the group's engine.Communicator; a
    collective of the group); ready() on the others first (load_cupy). All or none (bootstrap.gather):
    a rank whose part fails fails the exchange on every rank, instead of leaving them in NCCL's init."""
    def mine():
        if comm.rank != 0:
            ready()
            return None
        uid = make()
        if len(uid) != UNIQUE_ID_BYTES:
            raise RuntimeError(f"ncclGetUniqueId gave {len(uid)} bytes, not {UNIQUE_ID_BYTES}: an NCCL this engine "
                               "does not know")
        return bytes(uid)
    return gather(CommBootstrap(comm, group), mine, "make NCCL's unique id")[0]


def ranks_sharing_a_device(comm, identity, group=None):
    """Whether two ranks of comm's group named the same device (identity(): a host and a GPU's uuid):
    NCCL refuses two ranks on one GPU. All or none, as unique_id_over."""
    named = gather(CommBootstrap(comm, group), identity, "name its GPU")
    return len(set(named)) < len(named)


class NcclComm:
    """ncclCommInitRank over `size` ranks on CUDA device `device`. Calls from several threads are
    serialised: NCCL needs the calls of one communicator issued in one order."""

    def __init__(self, unique_id, rank, size, device):
        cupy, nccl = load_cupy()
        self._nccl = nccl
        self.rank, self.size, self.device = rank, size, device
        self.lock = threading.RLock()
        with cupy.cuda.Device(device):
            self._comm = nccl.NcclCommunicator(size, _for_cupy(unique_id, cupy), rank)
        self.error = None  # set when the comm was aborted (timeout); every later call raises it

    def _check(self):
        if self.error is not None:
            raise self.error
        if self._comm is None:
            raise RuntimeError("the NCCL communicator was destroyed (process group shut down)")

    def _call(self, name, *args):
        with self.lock:
            self._check()
            getattr(self._comm, name)(*args)

    def allreduce(self, send, recv, count, nccl_dtype, nccl_op, stream):
        self._call("allReduce", send, recv, count, nccl_dtype, nccl_op, stream)

    def reduce(self, send, recv, count, nccl_dtype, nccl_op, root, stream):
        self._call("reduce", send, recv, count, nccl_dtype, nccl_op, root, stream)

    def reduce_scatter(self, send, recv, recv_count, nccl_dtype, nccl_op, stream):
        self._call("reduceScatter", send, recv, recv_count, nccl_dtype, nccl_op, stream)

    def broadcast(self, send, recv, nbytes, root, stream):
        self._call("broadcast", send, recv, nbytes, NCCL_INT8, root, stream)

    def allgather(self, send, recv, nbytes, stream):
        self._call("allGather", send, recv, nbytes, NCCL_INT8, stream)

    def exchange(self, sends, recvs, stream):
        """Posts, in one group call (ncclGroupStart/End), sends [(pointer, bytes, peer)] and receives
        [(pointer, bytes, peer)]: the building block of all-to-all, gather, scatter and uneven all-gather."""
        with self.lock:
            self._check()
            comm = self._comm
            self._nccl.groupStart()
            try:
                for ptr, nbytes, peer in sends:
                    if nbytes:
                        comm.send(ptr, nbytes, NCCL_INT8, peer, stream)
                for ptr, nbytes, peer in recvs:
                    if nbytes:
                        comm.recv(ptr, nbytes, NCCL_INT8, peer, stream)
            except BaseException as exc:
                # groupEnd launches what was posted: a part of the exchange, which the peers' whole
                # exchanges would wait on for good. The communicator can't be used again.
                self._nccl.groupEnd()
                self.abort(RuntimeError(f"an NCCL exchange failed part-way through posting it ({exc}); the "
                                        "communicator was aborted, since its peers wait on the whole exchange"))
                raise
            self._nccl.groupEnd()

    def check_async_error(self):
        """Raises NcclError when NCCL hit an asynchronous error (a peer vanished, a network failure).
        Asks nothing while a call holds the lock: that call may be blocked inside NCCL on a peer that
        never comes (a full launch queue, a lazy connection), and the watchdog asking here must go on to
        its deadline, whose abort ends it."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if self._comm is not None:
                self._comm.check_async_error()
        finally:
            self.lock.release()

    def abort(self, error):
        """ncclCommAbort: frees the GPU kernels waiting on peers that will never come. Under the lock when
        it comes free soon, so that no call is half-issued on the communicator it frees; a thread that
        holds it longer is stuck inside NCCL (a group call waiting on a peer), which only this abort,
        from here, ends."""
        self.error = error
        locked = self.lock.acquire(timeout=ABORT_LOCK_SECONDS)
        try:
            comm, self._comm = self._comm, None
            if comm is not None:
                comm.abort()
        finally:
            if locked:
                self.lock.release()

    def destroy(self):
        with self.lock:
            comm, self._comm = self._comm, None
            if comm is not None:
                comm.destroy()
