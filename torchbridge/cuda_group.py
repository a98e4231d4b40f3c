"""The CUDA half of EngineProcessGroup: every c10d collective on CUDA tensors.

Two transports (ENGINE_CUDA_TRANSPORT):
- nccl (the default when cupy's NCCL is installed): engine.cuda's CudaCommunicator, one per group and
  device, created at the first CUDA collective; its NCCL unique id travels over MPI, or through torch's
  store when there is no MPI launch (torchrun). Calls enqueue on torch's current stream and return a
  CudaWork tied to a CUDA event: wait() makes the current stream wait, the host never blocks, as with
  torch's own NCCL backend. A watchdog aborts a collective that outlives the group's timeout.
- staged: device -> pinned host -> the engine's MPI path -> device. No cupy needed; for clusters
  without NCCL, and for several ranks sharing one GPU (NCCL refuses that). Runs synchronously.
"""

import warnings

import torch

from engine.config import env_choice
from engine.ops import ReduceOp

from .process_group import (_check_per_rank, _check_premul, _flat, _one, _reduce_op, _scatter_back, _uneven,
                            _write, all_to_all_counts)
from .work import CompletedWork, CudaWork

TRANSPORTS = ("auto", "nccl", "staged")


def _first_tensor(obj):
    while isinstance(obj, (list, tuple)):
        if not obj:
            return None
        obj = obj[0]
    return obj if isinstance(obj, torch.Tensor) else None


def is_cuda_call(args):
    """Whether a c10d call's tensors are on a CUDA device (outputs are argument 0, inputs argument 1)."""
    for a in args[:2]:
        t = _first_tensor(a)
        if t is not None:
            return t.is_cuda
    return False


class CudaCollectives:
    def __init__(self, group, mpi_comm, store, name, timeout_seconds, transport=None):
        self._group = group
        self._mpi = mpi_comm  # an MPI communicator of the group's ranks, or None (no MPI launch)
        self._store = store
        self._name = name
        self._timeout = timeout_seconds
        self._comms = {}  # device index -> engine.cuda.CudaCommunicator
        self._fused = {}
        self._watchdog = None
        self._pending_p2p = []  # deferred NCCL sends/receives, see send()
        self.transport = self._pick_transport(transport)

    def _pick_transport(self, forced=None):
        forced = forced or env_choice("ENGINE_CUDA_TRANSPORT", TRANSPORTS, "auto")
        if forced == "staged":
            if self._mpi is None:
                raise RuntimeError("ENGINE_CUDA_TRANSPORT=staged moves CUDA tensors over MPI, but this job has no MPI "
                                   "launch; use mpirun, or the nccl transport")
            return "staged"
        from engine.cuda import load_cupy
        load_cupy()  # without the extra: an ImportError naming it
        if forced == "auto" and self._mpi is not None and self._shares_a_gpu():
            warnings.warn("backend 'engine': ranks of this group share a GPU, which NCCL refuses; CUDA tensors take "
                          "the host-staged MPI path (ENGINE_CUDA_TRANSPORT=staged)", RuntimeWarning, stacklevel=3)
            return "staged"
        return "nccl"

    def _shares_a_gpu(self):
        import socket
        dev = torch.cuda.current_device()
        mine = (socket.gethostname(), str(torch.cuda.get_device_properties(dev).uuid))
        everyone = self._mpi.allgather(mine)
        return len(set(everyone)) < len(everyone)

    # -- the NCCL side --

    def _comm(self, device):
        cc = self._comms.get(device)
        if cc is None:
            from engine.cuda.communicator import CudaCommunicator
            from engine.cuda.nccl import unique_id_over_mpi, unique_id_over_store
            from engine.cuda.watchdog import Watchdog
            rank, size = self._group.rank(), self._group.size()
            if self._mpi is not None:
                uid = unique_id_over_mpi(self._mpi)
            else:
                uid = unique_id_over_store(self._store, f"engine/nccl/{self._name}/{device}", rank)
            with torch.cuda.device(device):
                cc = self._comms[device] = CudaCommunicator(uid, rank, size, device)
            if self._watchdog is None:
                self._watchdog = Watchdog(self._name, rank, size, self._timeout or 1800.0)
        return cc

    def _enter(self, t):
        """(CUDA communicator, torch's current stream handle) for tensor t's device."""
        device = t.device.index
        cc = self._comm(device)
        if self._watchdog.error is not None:
            raise self._watchdog.error
        return cc, torch.cuda.current_stream(device).cuda_stream

    def _work(self, what, outputs, device, cc):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._watchdog.watch(event, what, cc)
        return CudaWork(event, outputs, device, self._watchdog)

    # -- staged: host copies through the group's CPU (MPI) path --

    def _staged(self, method, args):
        """Runs the CPU method on pinned host copies of argument 0 (outputs, read too: in-place
        collectives) and argument 1 (inputs), then copies argument 0 back before returning."""
        pairs = []

        def host(obj):
            if isinstance(obj, torch.Tensor):
                if not obj.is_cuda:
                    return obj
                h = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
                h.copy_(obj)
                pairs.append((obj, h))
                return h
            if isinstance(obj, (list, tuple)):
                return type(obj)(host(o) for o in obj)
            return obj

        outputs = host(args[0])
        n_out = len(pairs)
        rest = [host(a) if i == 0 else a for i, a in enumerate(args[1:])]
        getattr(self._group, method)(outputs, *rest).wait()
        for dev, h in pairs[:n_out]:
            dev.copy_(h)  # blocking: any stream may read it once we return
        return CompletedWork(args[0] if isinstance(args[0], list) else [args[0]])

    # -- the collectives --

    def call(self, method, args):
        if self._pending_p2p and method not in ("send", "recv", "recv_anysource"):
            self.flush_p2p()  # a collective after isend/irecv: the p2p goes first, as issued
        if self.transport == "staged" and method not in ("send", "recv", "recv_anysource"):
            return self._staged(method, args)
        return getattr(self, method)(*args)

    def allreduce(self, tensors, opts=None):
        t = _one(tensors, "allreduce")
        op, factor = _reduce_op(opts)
        cc, stream = self._enter(t)
        buf = t if t.is_contiguous() else t.contiguous()
        if factor is not None:
            _check_premul(t)
            cc.scale(buf, factor, stream=stream)  # in place: the result overwrites it anyway
        cc.allreduce(buf, op, stream=stream)
        if buf is not t:
            t.copy_(buf)
        return self._work("allreduce", tensors, t.device.index, cc)

    def fused_allreduce(self, tensors, op=ReduceOp.SUM, *, compression=None, prescale=1.0, name="fused_allreduce"):
        if not tensors:
            return CompletedWork()
        if self._pending_p2p:
            self.flush_p2p()
        if self.transport == "staged":
            return self._staged_fused(tensors, op, compression, prescale)
        from engine.cuda.fusion import CudaFusedAllreduce
        device = tensors[0].device.index
        cc, stream = self._enter(tensors[0])
        fused = self._fused.get(device)
        if fused is None:
            fused = self._fused[device] = CudaFusedAllreduce(cc)
        work = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        fused.run(work, op, stream=stream, compression=compression, prescale=prescale)
        for t, w in zip(tensors, work):
            if w is not t:
                t.copy_(w)
        return self._work(name, tensors, device, cc)

    def _staged_fused(self, tensors, op, compression, prescale):
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in tensors]
        self._group.fused_allreduce(hosts, op, compression=compression, prescale=prescale)
        for t, h in zip(tensors, hosts):
            t.copy_(h)
        return CompletedWork(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        op, factor = _reduce_op(opts)
        if factor is not None:
            for t in tensors:
                _check_premul(t)
        return self.fused_allreduce(tensors, op, prescale=factor or 1.0, name="allreduce_coalesced")

    def reduce(self, tensors, opts):
        t = _one(tensors, "reduce")
        op, factor = _reduce_op(opts)
        cc, stream = self._enter(t)
        root = opts.rootRank
        if factor is not None:
            _check_premul(t)
        src = t * factor if factor is not None else t.contiguous()
        if cc.rank == root:
            out = t if t.is_contiguous() else torch.empty_like(src)
            cc.reduce(src, out, op, root, stream=stream)
            if out is not t:
                t.copy_(out)
        else:
            cc.reduce(src, None, op, root, stream=stream)
        return self._work("reduce", tensors, t.device.index, cc)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        op, factor = _reduce_op(opts)
        _check_per_rank(inputs, self._group.size(), out.dtype, "reduce_scatter", "input")
        cc, stream = self._enter(out)
        flat = _flat(inputs)
        if factor is not None:
            _check_premul(out)
            cc.scale(flat, factor, stream=stream)
        counts = [i.numel() for i in inputs]
        _write(out, lambda buf: cc.reduce_scatter(flat, buf, op, _uneven(counts), stream=stream))
        return self._work("reduce_scatter", output_tensors, out.device.index, cc)

    def reduce_scatter_single(self, output, input, opts=None):
        op, factor = _reduce_op(opts)
        cc, stream = self._enter(output)
        src = input.contiguous()
        if factor is not None:
            _check_premul(input)
            src = input * factor
        _write(output, lambda buf: cc.reduce_scatter(src, buf, op, stream=stream))
        return self._work("reduce_scatter_tensor", [output], output.device.index, cc)

    def broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        cc, stream = self._enter(t)
        _write(t, lambda buf: cc.broadcast(buf, opts.rootRank, stream=stream))
        return self._work("broadcast", tensors, t.device.index, cc)

    def allgather(self, output_lists, input_tensors, opts=None):
        outs = _one(output_lists, "allgather")
        inp = _one(input_tensors, "allgather")
        _check_per_rank(outs, self._group.size(), inp.dtype, "all_gather", "output")
        cc, stream = self._enter(inp)
        counts = [o.numel() for o in outs]
        flat = torch.empty(sum(counts), dtype=inp.dtype, device=inp.device)
        cc.allgather(inp.contiguous(), flat, _uneven(counts), stream=stream)
        _scatter_back(flat, outs)
        return self._work("allgather", output_lists, inp.device.index, cc)

    def all_gather_single(self, output, input, opts=None):
        cc, stream = self._enter(input)
        _write(output, lambda buf: cc.allgather(input.contiguous(), buf, stream=stream))
        return self._work("all_gather_into_tensor", [output], input.device.index, cc)

    def gather(self, output_lists, input_tensors, opts):
        inp = _one(input_tensors, "gather")
        root = opts.rootRank
        cc, stream = self._enter(inp)
        if cc.rank != root:
            cc.gather(inp.contiguous(), None, root, stream=stream)
            return self._work("gather", output_lists, inp.device.index, cc)
        outs = output_lists[0] if output_lists else []
        _check_per_rank(outs, self._group.size(), inp.dtype, "gather", "output", " on the root")
        counts = [o.numel() for o in outs]
        flat = torch.empty(sum(counts), dtype=inp.dtype, device=inp.device)
        cc.gather(inp.contiguous(), flat, root, _uneven(counts), stream=stream)
        _scatter_back(flat, outs)
        return self._work("gather", output_lists, inp.device.index, cc)

    def scatter(self, output_tensors, input_lists, opts):
        out = _one(output_tensors, "scatter")
        root = opts.rootRank
        cc, stream = self._enter(out)
        if cc.rank == root:
            inputs = input_lists[0] if input_lists else []
            _check_per_rank(inputs, self._group.size(), out.dtype, "scatter", "input", " on the root")
            flat = _flat(inputs)
            counts = _uneven([i.numel() for i in inputs])
            _write(out, lambda buf: cc.scatter(flat, buf, root, counts, stream=stream))
        else:
            _write(out, lambda buf: cc.scatter(None, buf, root, stream=stream))
        return self._work("scatter", output_tensors, out.device.index, cc)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        size = self._group.size()
        if len(output_tensors) != size or len(input_tensors) != size:
            raise ValueError(f"all_to_all needs {size} input and output tensors, got {len(input_tensors)} and "
                             f"{len(output_tensors)}")
        cc, stream = self._enter(input_tensors[0])
        recv_counts = [o.numel() for o in output_tensors]
        flat = torch.empty(sum(recv_counts), dtype=output_tensors[0].dtype, device=output_tensors[0].device)
        cc.alltoall(_flat(input_tensors), flat, [i.numel() for i in input_tensors],
                    recv_counts, stream=stream)
        _scatter_back(flat, output_tensors)
        return self._work("alltoall", output_tensors, flat.device.index, cc)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        send_counts, recv_counts = all_to_all_counts(output, input, output_split_sizes, input_split_sizes,
                                                     self._group.size())
        cc, stream = self._enter(input)
        _write(output, lambda buf: cc.alltoall(input.contiguous(), buf, send_counts, recv_counts, stream=stream))
        return self._work("alltoall_base", [output], input.device.index, cc)

    def barrier(self, device):
        """Only without MPI (torchrun): an allreduce of one element, then the host waits for it."""
        if self._pending_p2p:
            self.flush_p2p()
        t = torch.empty(0, device=device)
        cc, stream = self._enter(t)
        cc.barrier(stream=stream)
        work = self._work("barrier", [], device, cc)
        work.synchronize_host()
        return work

    # Point-to-point over NCCL is deferred: isend/irecv are collected and posted together, in one NCCL
    # group call, when one of their Works is waited on or the next collective is issued. NCCL's
    # sends wait on the device for the matching receive, so a rank's isend and irecv posted one after
    # the other on one stream would wait forever if the peer did the same (batch_isend_irecv does).

    def send(self, tensors, dst, tag):
        t = _one(tensors, "send").contiguous()
        if self.transport == "staged":
            return self._group.send([t.cpu()], dst, tag)
        return self._defer("send", t, dst, tensors)

    def recv(self, tensors, src, tag):
        t = _one(tensors, "recv")
        if self.transport == "staged":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return self._group._post_recv([host], src, tag, finish=lambda: t.copy_(host))
        if src is None:
            raise RuntimeError("recv without a source rank is not possible over NCCL (it matches sends by peer); "
                               "pass src=, or use ENGINE_CUDA_TRANSPORT=staged")
        return self._defer("recv", t, src, tensors)

    def _defer(self, kind, t, peer, outputs):
        cc, _ = self._enter(t)
        buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        event = torch.cuda.Event()
        self._pending_p2p.append((kind, t, buf, peer, event, cc))
        return CudaWork(event, outputs, t.device.index, self._watchdog, flush=self.flush_p2p)

    def flush_p2p(self):
        """Posts the deferred sends and receives of each device in one group call, on the current stream."""
        pending, self._pending_p2p = self._pending_p2p, []
        by_comm = {}
        for item in pending:
            by_comm.setdefault(id(item[5]), []).append(item)
        for items in by_comm.values():
            cc = items[0][5]
            device = items[0][1].device.index
            stream = torch.cuda.current_stream(device)
            cc.sendrecv([(buf, peer) for kind, _, buf, peer, _, _ in items if kind == "send"],
                        [(buf, peer) for kind, _, buf, peer, _, _ in items if kind == "recv"],
                        stream=stream.cuda_stream)
            for kind, t, buf, _, event, _ in items:
                if buf is not t:
                    t.copy_(buf)
                event.record(stream)
                self._watchdog.watch(event, kind, cc)

    def recv_anysource(self, tensors, tag):
        return self.recv(tensors, None, tag)

    def shutdown(self):
        if self._pending_p2p:
            self.flush_p2p()
        if self._watchdog is not None:
            self._watchdog.close()
        for cc in self._comms.values():
            cc.free()
        self._comms.clear()
