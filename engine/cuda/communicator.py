"""CudaCommunicator: the engine's collectives on CUDA buffers over one NCCL communicator.

Every call enqueues on the CUDA stream it is given and returns at once: it never blocks the host
(the torch bridge passes torch's current stream and ties its Work to a CUDA event). Allreduce goes
through the algorithm registry (engine.registry, transport "nccl"): ncclAllReduce, or the
engine's ring (ring.py) for what NCCL does not reduce, or when forced. Scratch memory comes from
cupy's stream-ordered pool: reused across calls, never freed while the stream still needs it.
"""

from .. import forks, registry
from .._core import Impl, alltoall_table, avg_spread, count_table
from ..ops import ReduceOp, op_code
from .buffers import device_message
from .kernels import GpuKernels
from .nccl import NcclComm
from .ring import CudaRingAllreduce
from .tables import check_reduction, nccl_reduction

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: unified addressing works out the direction


def _same_dtype(send, recv, what):
    if send != recv:
        raise TypeError(f"{what}: send buffer is {send} but receive buffer is {recv}; they must have the same dtype")


class CudaCommunicator:
    def __init__(self, unique_id, rank, size, device):
        self.comm = NcclComm(unique_id, rank, size, device)
        self.rank, self.size, self.device = rank, size, device
        self.kernels = GpuKernels.on(device)
        self._cupy = self.kernels._cupy
        self._ring = CudaRingAllreduce(self.comm, self.kernels)
        self._plan = registry.Plan("nccl", stage=True)
        self._orphaned = None
        forks.track(self)

    # -- helpers --

    def _message(self, buf):
        msg = device_message(buf)
        if msg[4] is not None and msg[4] != self.device:
            raise ValueError(f"this group's NCCL communicator is on cuda:{self.device}, the tensor on cuda:{msg[4]}: "
                             f"one process drives one GPU (torch.cuda.set_device(local_rank) before the first "
                             f"collective)")
        return msg

    def _output(self, recvbuf, dtype, what):
        """recvbuf's (pointer, count), of the input's dtype, as the CPU core checks: NCCL writes the
        input's dtype, which a narrower output would not hold."""
        ptr, count, _, rdtype, _ = self._message(recvbuf)
        _same_dtype(dtype, rdtype, what)
        return ptr, count

    def _scratch(self, nbytes, stream):
        cp = self._cupy
        with cp.cuda.Device(self.device), self.kernels._stream(stream):
            return cp.empty(max(nbytes, 1), dtype=cp.uint8)

    def _copy(self, dst, src, nbytes, stream):
        if nbytes and dst != src:
            # (on the group's device: torch's default stream is handle 0, which means the current device's)
            with self._cupy.cuda.Device(self.device):
                self._cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream)

    # -- reductions --

    def allreduce(self, buf, op=ReduceOp.SUM, *, stream, algorithm=None):
        """In place. algorithm: None (the registry decides), "nccl" or "ring"."""
        ptr, count, itemsize, dtype, _ = self._message(buf)
        self._allreduce(ptr, count, itemsize, dtype, op_code(op), stream, algorithm)
        return buf

    def _choose(self, collective, nbytes, dtype, op, uneven=False, algorithm=None):
        """The registry entry this call runs (algorithm: a name of one, as the tests force it)."""
        name = ReduceOp(op).name.lower() if isinstance(op, int) else None
        if algorithm is not None:
            chosen = registry.entry("nccl", collective, algorithm)
        else:
            chosen = self._plan.choose(collective, nbytes, self.size, dtype, name, uneven)
        if chosen is None or not chosen.takes_call(dtype, name):
            raise TypeError(f"no GPU {collective} algorithm takes {dtype} with {name or 'this op'}"
                            + (f" (ENGINE_{collective.upper()}_ALGO forces {chosen.name})" if chosen else ""))
        return chosen

    def _allreduce(self, ptr, count, itemsize, dtype, op, stream, algorithm=None):
        check_reduction(dtype, op)
        if count == 0:  # nothing to move; NCCL would see a null pointer
            return
        if self._choose("allreduce", count * itemsize, dtype, op, algorithm=algorithm).impl == Impl.NATIVE:
            self.comm.allreduce(ptr, ptr, count, *nccl_reduction(dtype, op), stream)
            return
        self._ring_allreduce(ptr, count, itemsize, dtype, op, stream)

    def _ring_allreduce(self, ptr, count, itemsize, dtype, op, stream):
        """The engine's ring, in place. AVG divides as the CPU core's does (pyx/dtypes.pxi avg_before):
        the inputs by a power of two before the sum, the sum by what is left, so it can't overflow."""
        scratch = self._scratch(-(-count // self.size) * itemsize, stream)
        spread = avg_spread(self.size) if op == ReduceOp.AVG else 1.0
        if spread != 1.0:
            self.kernels.scale(ptr, count, dtype, 1.0 / spread, stream)
        self._ring.run(ptr, count, itemsize, dtype, ReduceOp.SUM if op == ReduceOp.AVG else op,
                       scratch.data.ptr, stream)
        if op == ReduceOp.AVG and spread != self.size:
            self.kernels.scale(ptr, count, dtype, self.size / spread, stream, divide=True)

    def reduce(self, sendbuf, recvbuf, op, root, *, stream):
        """recvbuf on root = op over ranks of sendbuf (recvbuf may be sendbuf; ignored off the root)."""
        sptr, count, itemsize, dtype, _ = self._message(sendbuf)
        rptr = self._output(recvbuf, dtype, "reduce")[0] if recvbuf is not None and self.rank == root else sptr
        code = op_code(op)
        check_reduction(dtype, code)
        if count == 0:
            return
        if self._choose("reduce", count * itemsize, dtype, code).impl == Impl.NATIVE:
            self.comm.reduce(sptr, rptr, count, *nccl_reduction(dtype, code), root, stream)
            return
        tmp = self._scratch(count * itemsize, stream)  # our ring reduces everywhere; the root keeps it
        self._copy(tmp.data.ptr, sptr, count * itemsize, stream)
        self._ring_allreduce(tmp.data.ptr, count, itemsize, dtype, code, stream)
        if self.rank == root:
            self._copy(rptr, tmp.data.ptr, count * itemsize, stream)

    def reduce_scatter(self, sendbuf, recvbuf, op=ReduceOp.SUM, counts=None, *, stream):
        """recvbuf = this rank's block of op over ranks of sendbuf; blocks even, or `counts` elements each."""
        sptr, total, itemsize, dtype, _ = self._message(sendbuf)
        rptr, rcount = self._output(recvbuf, dtype, "reduce_scatter")
        code = op_code(op)
        check_reduction(dtype, code)
        counts, displs = count_table(self.size, self.rank, counts, rcount, "recvbuf", total, "sendbuf",
                                     "reduce_scatter")
        uneven = len(set(counts)) > 1
        if total == 0:
            return
        if self._choose("reduce_scatter", rcount * itemsize, dtype, code, uneven).impl == Impl.NATIVE:
            self.comm.reduce_scatter(sptr, rptr, rcount, *nccl_reduction(dtype, code), stream)
            return
        tmp = self._scratch(total * itemsize, stream)  # uneven or NCCL-less op: allreduce, keep our block
        self._copy(tmp.data.ptr, sptr, total * itemsize, stream)
        self._allreduce(tmp.data.ptr, total, itemsize, dtype, code, stream)
        self._copy(rptr, tmp.data.ptr + displs[self.rank] * itemsize, rcount * itemsize, stream)

    # -- data movement --

    def broadcast(self, buf, root, *, stream):
        ptr, count, itemsize, _, _ = self._message(buf)
        if count == 0:
            return buf
        self.comm.broadcast(ptr, ptr, count * itemsize, root, stream)
        return buf

    def allgather(self, sendbuf, recvbuf, counts=None, *, stream):
        """recvbuf = concat over ranks of sendbuf; `counts` elements per rank when uneven."""
        sptr, scount, itemsize, dtype, _ = self._message(sendbuf)
        rptr, rcount = self._output(recvbuf, dtype, "allgather")
        counts, displs = count_table(self.size, self.rank, counts, scount, "sendbuf", rcount, "recvbuf", "allgather")
        uneven = len(set(counts)) > 1
        if rcount == 0:
            return
        if self._choose("allgather", scount * itemsize, None, None, uneven).impl == Impl.NATIVE:
            self.comm.allgather(sptr, rptr, scount * itemsize, stream)
            return
        offs = [d * itemsize for d in displs]
        self._exchange_with_self(sptr, rptr + offs[self.rank], scount * itemsize,
                                 [(sptr, scount * itemsize, p) for p in self._peers()],
                                 [(rptr + offs[p], counts[p] * itemsize, p) for p in self._peers()], stream)

    def alltoall(self, sendbuf, recvbuf, send_counts=None, recv_counts=None, *, stream):
        sptr, scount, itemsize, dtype, _ = self._message(sendbuf)
        rptr, rcount = self._output(recvbuf, dtype, "alltoall")
        send_counts, so, recv_counts, ro = alltoall_table(self.size, self.rank, send_counts, scount, recv_counts, rcount)
        so, ro = [d * itemsize for d in so], [d * itemsize for d in ro]
        me = self.rank   # (alltoall_table checked this rank's piece to itself against its piece from itself)
        self._exchange_with_self(sptr + so[me], rptr + ro[me], send_counts[me] * itemsize,
                                 [(sptr + so[p], send_counts[p] * itemsize, p) for p in self._peers()],
                                 [(rptr + ro[p], recv_counts[p] * itemsize, p) for p in self._peers()], stream)

    def gather(self, sendbuf, recvbuf, root, counts=None, *, stream):
        sptr, scount, itemsize, dtype, _ = self._message(sendbuf)
        if self.rank != root:
            self.comm.exchange([(sptr, scount * itemsize, root)], [], stream)
            return
        rptr, rcount = self._output(recvbuf, dtype, "gather")
        counts, displs = count_table(self.size, self.rank, counts, scount, "sendbuf", rcount, "recvbuf", "gather")
        offs = [d * itemsize for d in displs]
        self._exchange_with_self(sptr, rptr + offs[root], scount * itemsize, [],
                                 [(rptr + offs[p], counts[p] * itemsize, p) for p in self._peers()], stream)

    def scatter(self, sendbuf, recvbuf, root, counts=None, *, stream):
        rptr, rcount, itemsize, dtype, _ = self._message(recvbuf)
        if self.rank != root:
            self.comm.exchange([], [(rptr, rcount * itemsize, root)], stream)
            return
        sptr, scount, _, sdtype, _ = self._message(sendbuf)
        _same_dtype(sdtype, dtype, "scatter")
        counts, displs = count_table(self.size, self.rank, counts, rcount, "recvbuf", scount, "sendbuf", "scatter")
        offs = [d * itemsize for d in displs]
        self._exchange_with_self(sptr + offs[root], rptr, rcount * itemsize,
                                 [(sptr + offs[p], counts[p] * itemsize, p) for p in self._peers()], [], stream)

    def sendrecv(self, sends, recvs, *, stream):
        """Sends [(buffer, peer)] and receives [(buffer, peer)] posted in one NCCL group call, so
        that two ranks sending to each other first do not wait on each other."""
        def wire(pairs):
            out = []
            for buf, peer in pairs:
                ptr, count, itemsize, _, _ = self._message(buf)
                out.append((ptr, count * itemsize, peer))
            return out
        self.comm.exchange(wire(sends), wire(recvs), stream)

    def barrier(self, *, stream):
        """An allreduce of one element: every rank's stream passes it only when all have enqueued it."""
        tmp = self._scratch(4, stream)
        self.comm.allreduce(tmp.data.ptr, tmp.data.ptr, 1, 7, 0, stream)  # float32 SUM

    def _peers(self):
        return [p for p in range(self.size) if p != self.rank]

    def _exchange_with_self(self, own_src, own_dst, own_bytes, sends, recvs, stream):
        self._copy(own_dst, own_src, own_bytes, stream)
        self.comm.exchange(sends, recvs, stream)

    # -- failure and lifetime --

    def abort(self, error):
        self.comm.abort(error)

    def check_async_error(self):
        self.comm.check_async_error()

    def orphan(self, why):
        """In a child forked from this process (engine/forks.py): free() leaves the parent's NCCL
        communicator alone (CUDA itself refuses a forked child's calls)."""
        self._orphaned = why

    def free(self):
        if self._orphaned is None:
            self.comm.destroy()
