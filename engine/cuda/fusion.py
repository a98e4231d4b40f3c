"""Fused allreduce on the GPU: engine.fusion's pure planner, the GPU pack/unpack kernels (one launch
per bucket whatever its tensor count, with the compression cast and the AVG/PREMUL scale fused in),
one allreduce per bucket, all enqueued on one stream."""

from ..fusion import COMPRESSIONS, ITEMSIZE, SizedFusion, bucket_scales, plan_buckets, wire_dtype
from ..ops import ReduceOp, op_code
from .tables import check_reduction


class CudaFusedAllreduce(SizedFusion):
    def __init__(self, cuda_comm, bucket_bytes=None, direct_bytes=None):
        super().__init__(bucket_bytes, direct_bytes)
        self.comm = cuda_comm

    def run(self, buffers, op=ReduceOp.SUM, *, stream, compression=None, prescale=1.0):
        """buffers[i] = op over ranks of buffers[i], in place, for every i (contiguous CUDA buffers)."""
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        code = op_code(op)
        messages = [self.comm._message(b) for b in buffers]
        if _overlap(messages):
            self._run_on_copies(messages, code, stream, compression, prescale)
        else:
            self._run(messages, code, stream, compression, prescale)
        return buffers

    def _run_on_copies(self, messages, code, stream, compression, prescale):
        """run() of buffers that share memory (the same one twice, overlapping views): each is read into
        a copy first and written back after, in order, as the CPU fusion does (engine/fusion.py): in
        place, the second would be reduced again."""
        comm = self.comm
        copies = [comm._scratch(count * itemsize, stream) for _, count, itemsize, _, _ in messages]  # (held to the end)
        for (ptr, count, itemsize, _, _), copy in zip(messages, copies):
            comm._copy(copy.data.ptr, ptr, count * itemsize, stream)
        self._run([(copy.data.ptr, *m[1:]) for m, copy in zip(messages, copies)], code, stream, compression, prescale)
        for (ptr, count, itemsize, _, _), copy in zip(messages, copies):
            comm._copy(ptr, copy.data.ptr, count * itemsize, stream)

    def _run(self, messages, code, stream, compression, prescale):
        specs = [(count, dtype, itemsize, f"cuda:{dev}") for _, count, itemsize, dtype, dev in messages]
        comm, kernels = self.comm, self.comm.kernels
        reduce_op = ReduceOp.SUM if code == ReduceOp.AVG else code
        buckets = plan_buckets(specs, *self.sizes)
        for bucket in buckets:  # all before any is enqueued: one refused later would leave these reduced
            check_reduction(bucket.dtype, code)
        for bucket in buckets:
            wire = wire_dtype(bucket.dtype, compression)
            before, after = bucket_scales(code, wire, bucket.dtype, comm.size, prescale)
            itemsize = messages[bucket.indices[0]][2]
            parts = [(messages[i][0], messages[i][1]) for i in bucket.indices]
            if len(parts) == 1 and wire == bucket.dtype:  # alone: reduced in place
                flat = None
                ptr = parts[0][0]
                if before != 1.0:
                    kernels.scale(ptr, bucket.count, wire, before, stream)
            else:
                flat = comm._scratch(bucket.count * ITEMSIZE[wire], stream)
                ptr = flat.data.ptr
                kernels.pack(ptr, wire, parts, bucket.dtype, itemsize, stream, before)
            comm._allreduce(ptr, bucket.count, ITEMSIZE[wire], wire, reduce_op, stream)
            if flat is None:
                if after != 1.0:
                    kernels.scale(ptr, bucket.count, wire, after, stream)
            else:
                kernels.unpack(ptr, wire, parts, bucket.dtype, itemsize, stream, after)


def _overlap(messages):
    """Whether two of the buffers (device_message's tuples) share memory."""
    spans = sorted((ptr, ptr + count * itemsize) for ptr, count, itemsize, _, _ in messages if count)
    return any(start < end for (_, end), (start, _) in zip(spans, spans[1:]))
