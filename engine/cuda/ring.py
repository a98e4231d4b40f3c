"""The engine's ring allreduce on the GPU: reduce-scatter then allgather around the ring, each step
one NCCL send and one receive posted in a group call, the reduction done by the engine's own kernel
(kernels.cu) on the same stream. It reduces what NCCL cannot (BAND/BOR/BXOR, int16) and is the
engine's alternative to ncclAllReduce in the algorithm registry (engine.registry).

Both rings run one schedule (engine.ring_schedule, the CPU ring's): they cut a buffer the same way.
"""

from .._core import ring_schedule


class CudaRingAllreduce:
    """For one NCCL communicator; scratch (one block) is allocated by the caller's allocator once per
    size class and reused, stream-ordered."""

    def __init__(self, nccl_comm, kernels):
        self.comm = nccl_comm
        self.kernels = kernels
        self.right = (nccl_comm.rank + 1) % nccl_comm.size
        self.left = (nccl_comm.rank - 1) % nccl_comm.size

    def run(self, ptr, count, itemsize, dtype, op, scratch_ptr, stream):
        """In place on the count elements at ptr. scratch_ptr: room for ceil(count / size) elements."""
        comm, size = self.comm, self.comm.size
        if size == 1 or count == 0:
            return
        for phase, (send_off, send_len), (recv_off, recv_len) in ring_schedule(count, size, comm.rank):
            target = ptr + recv_off * itemsize
            comm.exchange([(ptr + send_off * itemsize, send_len * itemsize, self.right)],
                          [(scratch_ptr if phase == "reduce" else target, recv_len * itemsize, self.left)], stream)
            if phase == "reduce":
                self.kernels.reduce(target, target, scratch_ptr, recv_len, dtype, op, stream)
