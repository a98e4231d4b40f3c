"""EngineProcessGroup: every collective torch.distributed dispatches to a Python process group,
mapped onto the engine. Collectives run in issue order on a progress thread per group (see
engine.progress); point-to-point is posted at once as nonblocking MPI. Inputs are never modified,
outputs are written in place (non-contiguous ones through a contiguous copy)."""

import torch
import torch.distributed as dist

from engine import Communicator, ReduceOp
from engine.fusion import FusedAllreduce
from engine.progress import Progress

from .launch import MPIRUN_HINT
from .work import CollectiveWork, CompletedWork, PointToPointWork

_RED = dist.ReduceOp.RedOpType
# Keyed by int: hashing torch's pybind enum costs more than the 1 KB allreduce itself.
_OPS = {int(_RED.SUM): ReduceOp.SUM, int(_RED.PRODUCT): ReduceOp.PRODUCT, int(_RED.MIN): ReduceOp.MIN,
        int(_RED.MAX): ReduceOp.MAX, int(_RED.BAND): ReduceOp.BAND, int(_RED.BOR): ReduceOp.BOR,
        int(_RED.BXOR): ReduceOp.BXOR, int(_RED.AVG): ReduceOp.AVG}
_GROUP_TAG = 31337  # MPI_Comm_create_group tag for torch sub-groups


def create_process_group(opts, backend_options=None):
    """The creator torch calls (extended API) on each member of a new group."""
    from mpi4py import MPI
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("backend 'engine' needs MPI_THREAD_MULTIPLE (its progress thread calls MPI); this MPI "
                           f"was initialised with level {MPI.Query_thread()}: leave mpi4py.rc.thread_level at "
                           "'multiple' and use an MPI built with thread support")
    world = MPI.COMM_WORLD
    ranks = list(opts.global_ranks_in_group)
    if world.Get_size() == 1 and opts.group_size > 1 and torch.cuda.is_available():
        # No MPI launch (torchrun): CUDA tensors go over NCCL, whose id travels through torch's store.
        return EngineProcessGroup(None, opts.group_rank, opts.group_size, opts.timeout, opts.store,
                                  opts.group_id or "default")
    if not ranks:  # the default group: everyone
        if world.Get_size() != opts.group_size or world.Get_rank() != opts.group_rank:
            raise RuntimeError(
                f"torch.distributed says rank {opts.group_rank} of {opts.group_size}, but MPI says rank "
                f"{world.Get_rank()} of {world.Get_size()}: the processes were not started by one MPI launcher "
                f"(torchrun and mp.spawn start independent MPI singletons); {MPIRUN_HINT}")
        comm = world.Dup()
    else:
        if world.Get_rank() not in ranks or ranks.index(world.Get_rank()) != opts.group_rank:
            raise RuntimeError(f"rank {world.Get_rank()} asked to join group {ranks} as rank {opts.group_rank}")
        group = world.Get_group().Incl(ranks)
        try:
            comm = world.Create_group(group, tag=_GROUP_TAG)
        finally:
            group.Free()
    return EngineProcessGroup(comm, opts.group_rank, opts.group_size, opts.timeout, opts.store,
                              opts.group_id or "default")


def _one(tensors, what):
    if len(tensors) != 1:
        raise RuntimeError(f"engine {what}: expected a list with one tensor (one device per process), got {len(tensors)}")
    return tensors[0]


def _reduce_op(opts):
    """(engine op, premultiply factor or None) for the ReduceOp of torch's options."""
    reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    kind = reduce_op.op
    op = _OPS.get(int(kind))
    if op is not None:
        return op, None
    if kind == _RED.PREMUL_SUM:
        return ReduceOp.SUM, reduce_op.factor
    raise RuntimeError(f"backend 'engine' does not support reduce op {kind}")


def _check_premul(t):
    if not t.is_floating_point():
        raise RuntimeError(f"PREMUL_SUM needs a floating dtype, got {t.dtype}")


def _premul(t, factor):
    """A scaled copy for PREMUL_SUM (the input itself is never modified)."""
    _check_premul(t)
    return t * factor


def _write(out, fn):
    """Runs fn on out, through a contiguous copy written back when out is not contiguous."""
    if out.is_contiguous():
        fn(out)
    else:
        tmp = out.contiguous()
        fn(tmp)
        out.copy_(tmp)


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _check_per_rank(tensors, size, dtype, what, kind, where=""):
    """A list argument with one tensor per rank, all of one dtype."""
    if len(tensors) != size:
        raise ValueError(f"{what} needs one {kind} tensor per rank ({size}){where}, got {len(tensors)}")
    _check_dtypes(tensors, dtype, what)


def _check_dtypes(tensors, dtype, what):
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"engine {what}: tensors must share one dtype, got {dtype} and {t.dtype}")


def _scatter_back(flat, outputs):
    for out, piece in zip(outputs, flat.split([o.numel() for o in outputs])):
        out.copy_(piece.view(out.shape))


def _uneven(counts):
    return None if len(set(counts)) <= 1 else counts


def all_to_all_counts(output, input, output_split_sizes, input_split_sizes, size):
    """(send counts, receive counts) in elements for all_to_all_single, or (None, None) when even."""

    def counts(t, splits, side):
        if not splits:
            if t.numel() % size:
                raise ValueError(f"all_to_all_single: {side} has {t.numel()} elements, not divisible by the "
                                 f"group size {size}; pass {side}_split_sizes")
            return None
        if len(splits) != size:
            raise ValueError(f"all_to_all_single: {side}_split_sizes has {len(splits)} entries, needs {size}")
        row = t[0].numel() if t.dim() and t.shape[0] else 1
        if sum(splits) != (t.shape[0] if t.dim() else t.numel()):
            raise ValueError(f"all_to_all_single: {side}_split_sizes add up to {sum(splits)} but the {side} "
                             f"tensor has {t.shape[0] if t.dim() else t.numel()} rows")
        return [s * row for s in splits]

    send_counts = counts(input, input_split_sizes, "input")
    recv_counts = counts(output, output_split_sizes, "output")
    if (send_counts is None) != (recv_counts is None):
        send_counts = send_counts or [input.numel() // size] * size
        recv_counts = recv_counts or [output.numel() // size] * size
    return send_counts, recv_counts


_COMPLETED = CompletedWork()
# The c10d methods that take tensors: with CUDA present, each routes CUDA calls (see _route_cuda).
_CUDA_METHODS = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single",
                 "broadcast", "allgather", "all_gather_single", "gather", "scatter", "alltoall", "alltoall_base",
                 "send", "recv", "recv_anysource")


class _NoMPI:
    """Where the MPI communicator would be in a job with no MPI launch (torchrun with CUDA tensors):
    every CPU collective raises, naming what would make it work."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def __getattr__(self, name):
        raise RuntimeError(f"backend 'engine' moves CPU tensors over MPI, but this job was not started by an MPI "
                           f"launcher: CUDA tensors work here (NCCL), CPU tensors need one; {MPIRUN_HINT}")


class EngineProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup over one MPI communicator (a Dup of COMM_WORLD, or a sub-communicator)."""

    def __init__(self, mpi_comm, rank, size, timeout=None, store=None, name="default"):
        super().__init__(rank, size)
        seconds = timeout.total_seconds() if timeout is not None else None
        cuda_mpi = mpi_comm.Dup() if mpi_comm is not None and torch.cuda.is_available() else None
        if mpi_comm is None:
            self._comm = _NoMPI(rank, size)
        else:
            self._comm = Communicator(mpi_comm, timeout=seconds, store=store, name=name, _owned=mpi_comm)
        self._fusion = FusedAllreduce(self._comm)
        self._progress = Progress(name=f"engine-progress-{size}r")
        self._timeout = timeout
        self._cuda = None
        if torch.cuda.is_available():  # CPU-only machines never pay for the CUDA routing
            self._route_cuda(cuda_mpi, store, name, seconds)

    def _route_cuda(self, cuda_mpi, store, name, seconds):
        """Each c10d method, on this instance, first sends calls on CUDA tensors to a CudaCollectives
        (torchbridge.cuda_group), created at the first such call. torch looks methods up on the
        instance, so the class's CPU methods stay as they are."""
        from .cuda_group import CudaCollectives, is_cuda_call

        def cuda_side():
            if self._cuda is None:
                self._cuda = CudaCollectives(self, cuda_mpi, store, name, seconds)
            return self._cuda

        self._cuda_side = cuda_side
        for method in _CUDA_METHODS:
            cpu = getattr(self, method)

            def route(*args, _cpu=cpu, _method=method):
                if is_cuda_call(args):
                    return cuda_side().call(_method, args)
                return _cpu(*args)

            setattr(self, method, route)
        self._reduce_scatter_base = self.reduce_scatter_single
        self._allgather_base = self.all_gather_single

    def getBackendName(self):
        return "engine"

    # torch reads a group's name back through C++, which looks it up on registered backends: a
    # Python group has none, so destroy_process_group(subgroup) would fail. Keep it here instead.
    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return getattr(self, "_group_name", "")

    @property
    def communicator(self):
        """The engine Communicator behind this group."""
        return self._comm

    def _submit(self, what, fn, outputs, opts=None):
        # torch says async_op=False when it will wait at once: run in place (no thread hand-off) and
        # raise here on failure; the returned Work is already complete.
        if opts is not None and not getattr(opts, "asyncOp", True):
            self._progress.run(fn, what)
            return _COMPLETED
        return CollectiveWork(self._progress, self._progress.submit(fn, what), outputs)

    # -- reductions --

    def allreduce(self, tensors, opts=None):
        t = _one(tensors, "allreduce")
        op, factor = _reduce_op(opts)
        comm = self._comm
        if factor is None:
            if t.is_contiguous():  # the common case, kept short: it is the latency path
                return self._submit("allreduce", lambda: comm.allreduce(t, None, op), tensors, opts)
            return self._submit("allreduce", lambda: _write(t, lambda buf: comm.allreduce(buf, op=op)), tensors, opts)
        return self._submit("allreduce", lambda: _write(t, lambda buf: comm.allreduce(_premul(t, factor), buf, op)),
                            tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        """Fused: tensors packed into buckets (engine.fusion), one allreduce per bucket."""
        op, factor = _reduce_op(opts)
        if factor is not None:
            for t in tensors:
                _check_premul(t)
        return self._submit("allreduce_coalesced", lambda: self.fused_allreduce(tensors, op, prescale=factor or 1.0),
                            tensors, opts)

    def fused_allreduce_async(self, tensors, op=ReduceOp.SUM, *, compression=None, name="fused_allreduce"):
        """Queues a fused allreduce of tensors (in place) on this group's progress thread; returns its
        Work at once. Used by DistributedOptimizer's buckets and the DDP comm hooks. CUDA tensors are
        enqueued on the current stream instead."""
        if tensors and tensors[0].is_cuda:
            return self._cuda_side().fused_allreduce(tensors, op, compression=compression, name=name)
        return self._submit(name, lambda: self.fused_allreduce(tensors, op, compression=compression), tensors)

    def fused_allreduce(self, tensors, op=ReduceOp.SUM, *, compression=None, prescale=1.0):
        """Runs now, in the calling thread: engine.fusion on contiguous views (copies written back).
        CUDA tensors: enqueued on the current stream (what follows on that stream sees the result)."""
        if tensors and tensors[0].is_cuda:
            self._cuda_side().fused_allreduce(tensors, op, compression=compression, prescale=prescale)
            return
        work = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        self._fusion.run(work, op, compression=compression, prescale=prescale)
        for t, w in zip(tensors, work):
            if w is not t:
                t.copy_(w)

    def reduce(self, tensors, opts):
        t = _one(tensors, "reduce")
        op, factor = _reduce_op(opts)
        root, comm = opts.rootRank, self._comm

        def run():
            src = _premul(t, factor) if factor is not None else t.contiguous()
            if comm.rank == root:
                _write(t, lambda buf: comm.reduce(src, buf if src is not buf else None, op, root))
            else:
                comm.reduce(src, None, op, root)

        return self._submit("reduce", run, tensors, opts)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        op, factor = _reduce_op(opts)
        _check_per_rank(inputs, self.size(), out.dtype, "reduce_scatter", "input")
        comm = self._comm

        def run():
            flat = _flat(inputs)
            if factor is not None:
                flat = _premul(flat, factor)
            _write(out, lambda buf: comm.reduce_scatter(flat, buf, op, _uneven([i.numel() for i in inputs])))

        return self._submit("reduce_scatter", run, output_tensors, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        op, factor = _reduce_op(opts)
        comm = self._comm

        def run():
            src = _premul(input, factor) if factor is not None else input.contiguous()
            _write(output, lambda buf: comm.reduce_scatter(src, buf, op))

        return self._submit("reduce_scatter_tensor", run, [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --

    def broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        root, comm = opts.rootRank, self._comm
        return self._submit("broadcast", lambda: _write(t, lambda buf: comm.broadcast(buf, root)), tensors, opts)

    def allgather(self, output_lists, input_tensors, opts=None):
        outs = _one(output_lists, "allgather")
        inp = _one(input_tensors, "allgather")
        _check_per_rank(outs, self.size(), inp.dtype, "all_gather", "output")
        comm = self._comm

        def run():
            counts = [o.numel() for o in outs]
            flat = torch.empty(sum(counts), dtype=inp.dtype)
            comm.allgather(inp.contiguous(), flat, _uneven(counts))
            _scatter_back(flat, outs)

        return self._submit("allgather", run, output_lists, opts)

    def all_gather_single(self, output, input, opts=None):
        comm = self._comm
        return self._submit("all_gather_into_tensor",
                            lambda: _write(output, lambda buf: comm.allgather(input.contiguous(), buf)), [output],
                            opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        works = [self.allgather([outs], [inp], opts) for outs, inp in zip(output_lists, input_list)]
        return works[-1] if works else self.barrier()

    def gather(self, output_lists, input_tensors, opts):
        inp = _one(input_tensors, "gather")
        root, comm = opts.rootRank, self._comm
        outs = output_lists[0] if output_lists else []
        if comm.rank == root:
            _check_per_rank(outs, self.size(), inp.dtype, "gather", "output", " on the root")

        def run():
            if comm.rank != root:
                comm.gather(inp.contiguous(), None, root)
                return
            counts = [o.numel() for o in outs]
            flat = torch.empty(sum(counts), dtype=inp.dtype)
            comm.gather(inp.contiguous(), flat, root, _uneven(counts))
            _scatter_back(flat, outs)

        return self._submit("gather", run, output_lists, opts)

    def scatter(self, output_tensors, input_lists, opts):
        out = _one(output_tensors, "scatter")
        root, comm = opts.rootRank, self._comm
        inputs = input_lists[0] if input_lists else []
        if comm.rank == root:
            _check_per_rank(inputs, self.size(), out.dtype, "scatter", "input", " on the root")

        def run():
            if comm.rank == root:
                _write(out, lambda buf: comm.scatter(_flat(inputs), buf, root, _uneven([i.numel() for i in inputs])))
            else:
                _write(out, lambda buf: comm.scatter(None, buf, root))

        return self._submit("scatter", run, output_tensors, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise ValueError(f"all_to_all needs {self.size()} input and output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        _check_dtypes(list(output_tensors) + list(input_tensors), input_tensors[0].dtype, "all_to_all")
        comm = self._comm

        def run():
            recv_counts = [o.numel() for o in output_tensors]
            flat = torch.empty(sum(recv_counts), dtype=output_tensors[0].dtype)
            comm.alltoall(_flat(input_tensors), flat, [i.numel() for i in input_tensors], recv_counts)
            _scatter_back(flat, output_tensors)

        return self._submit("alltoall", run, output_tensors, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        send_counts, recv_counts = all_to_all_counts(output, input, output_split_sizes, input_split_sizes,
                                                     self.size())
        comm = self._comm

        def run():
            _write(output, lambda buf: comm.alltoall(input.contiguous(), buf, send_counts, recv_counts))

        return self._submit("alltoall_base", run, [output], opts)

    def barrier(self, opts=None):
        if isinstance(self._comm, _NoMPI):  # torchrun: the ranks meet on the GPU, over NCCL
            return self._cuda_side().barrier(torch.cuda.current_device())
        return self._submit("barrier", self._comm.barrier, [], opts)

    # -- point to point: posted now, never queued behind collectives --

    def send(self, tensors, dst, tag):
        t = _one(tensors, "send").contiguous()
        return PointToPointWork(self._comm.isend(t, dst, tag), tensors)

    def recv(self, tensors, src, tag):
        return self._post_recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._post_recv(tensors, None, tag)

    def _post_recv(self, tensors, src, tag, finish=None):
        t = _one(tensors, "recv")
        if t.is_contiguous():
            return PointToPointWork(self._comm.irecv(t, src, tag), tensors, finish=finish)
        tmp = t.contiguous()
        return PointToPointWork(self._comm.irecv(tmp, src, tag), tensors, finish=lambda: t.copy_(tmp))

    # -- lifetime --

    def shutdown(self):
        if self._progress is not None:
            self._progress.close()
            self._progress = None
            self._fusion.close()
            if self._cuda is not None:
                self._cuda.shutdown()
            if not isinstance(self._comm, _NoMPI):
                self._comm.free()

    def abort(self):
        self.shutdown()
