"""The device communicators the adapter (process_group.py) drives: one per (device, transport) pair,
each with the same face.

    comm            the engine's collectives on this device's tensors, in engine.Communicator's
                    signatures: allreduce(sendbuf, recvbuf, op), broadcast(buf, root), ...
    launch(name, fn, a, b, c, nargs, outputs, opts)
                    runs fn(a, b, c) (its first nargs arguments) and returns the c10d Work
    send / recv     point-to-point, returning a Work
    fused(tensors, op, compression, prescale, name, sync)
                    a fused (bucketed) allreduce of many tensors, returning a Work
    shutdown()

CpuDevice: CPU tensors over the group's engine.Communicator (shared memory or MPI), in issue order
on the group's progress thread; a synchronous call runs in place. CudaDevice: CUDA tensors over NCCL,
enqueued on torch's current stream (the Work waits on a CUDA event). StagedDevice: CUDA tensors
through pinned host memory and the CPU communicator, for clusters without NCCL and ranks sharing a GPU.
"""

import sys
import time

import torch

from engine._core import NotContiguousError, NotDenseError
from engine.fusion import FusedAllreduce
from engine.ops import ReduceOp

from .work import CollectiveWork, CompletedWork, CudaWork, PointToPointWork, own_timeout, registered


def is_contiguous(t):
    """t.is_contiguous(); a sparse tensor (which only all_reduce takes) gets an error saying so where it
    has no such property (CSR, CSC, BSR)."""
    try:
        return t.is_contiguous()
    except RuntimeError:
        raise _not_dense(t) from None


def _not_dense(t):
    return RuntimeError(f"backend 'engine': a {t.layout} tensor was passed to a call that takes dense tensors; only "
                        "all_reduce (ReduceOp.SUM) takes sparse (COO) tensors, as on Gloo: pass tensor.to_dense()")


def contiguous(t):
    """t itself when contiguous, else a contiguous copy. Sparse tensors (which only all_reduce takes)
    get an error saying so."""
    if is_contiguous(t):
        return t
    if t.layout != torch.strided:
        raise _not_dense(t)
    return t.contiguous()


def write_back(out, result):
    """out.copy_(result) as the backend's own write, outside autograd: a tensor that requires grad (a
    channels_last or transposed Parameter, staged or not contiguous) is written as Gloo writes its
    memory, where autograd refuses an in-place copy into a leaf that requires grad. An output made
    under torch.inference_mode is written under it too (outside it torch refuses to update one)."""
    with torch.inference_mode() if out.is_inference() else torch.no_grad():
        try:
            out.copy_(result)
        except RuntimeError:
            if torch._debug_has_internal_overlap(out) != 1:
                raise
            raise ValueError(f"backend 'engine': the output tensor (shape {tuple(out.shape)}, strides {out.stride()}) "
                             "has elements that share memory (an expand()ed view), so the call's result, made on every "
                             "rank, can't be written into it: pass a tensor whose elements are its own "
                             "(tensor.clone())") from None


def _through_contiguous(fn, tensors, *args, **kwargs):
    work = [contiguous(t) for t in tensors]
    fn(work, *args, **kwargs)
    for t, w in zip(tensors, work):
        if w is not t:
            write_back(t, w)


def used_on(stream, *groups):
    """Marks every CUDA tensor in groups (sequences of tensors and of nested lists of them, as a call's
    arguments are) used on `stream`, as ProcessGroupNCCL records its tensors: the caching allocator
    then keeps a tensor's memory until the stream is past this point, whichever stream allocated it
    (freed before the work ends, an input allocated on another stream was handed out again while NCCL
    still read it)."""
    for group in groups:
        for item in group:
            if isinstance(item, (list, tuple)):
                used_on(stream, item)
            elif getattr(item, "is_cuda", False):
                item.record_stream(stream)


def _on_stream(fn, args, stream):
    with torch.cuda.stream(stream):
        fn(*args)


def _pinned(t):
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class CpuDevice:
    def __init__(self, comm, progress):
        self.comm = comm
        self.progress = progress
        progress.drive(comm.driver)   # (the messages left in flight move while the rank is elsewhere)
        self.kick = progress.kick     # (bound once: every message left in flight calls it)
        self._fusion = FusedAllreduce(comm)

    def launch(self, name, fn, a, b, c, nargs, outputs, opts):
        # torch says async_op=False when it will wait at once: run in place (no thread hand-off) and
        # raise here on failure; the returned Work is already complete.
        fn, a, b, c, nargs = self.timed(own_timeout(opts, name), fn, a, b, c, nargs)
        if opts is not None and not opts.asyncOp:
            self.progress.run(fn, a, b, c, nargs, name)
            return CompletedWork.of(outputs)
        self.comm.check_usable(name)   # (a broken group refuses a queued call now, not when it runs)
        return CollectiveWork.of(self.progress.submit(fn, (a, b, c)[:nargs], name, outputs))

    def timed(self, seconds, fn, a, b, c, nargs):
        """fn and its arguments as the progress engine runs them, within the call's own timeout where
        it has one (seconds; None: the group's): dist.barrier(timeout=...), opts.timeout."""
        if seconds is None:
            return fn, a, b, c, nargs
        return self._within, fn, (a, b, c)[:nargs], seconds, 3

    def _within(self, fn, args, seconds):
        with self.comm.call_timeout(seconds):
            fn(*args)

    def fused(self, tensors, op, compression, prescale, name, sync=False, seconds=None):
        """seconds: the call's own timeout (None: the group's)."""
        fn, a, b, c, nargs = self.timed(seconds, self._fused, tensors, op, (compression, prescale), 3)
        if sync:
            self.progress.run(fn, a, b, c, nargs, name)
            return CompletedWork.of(tensors)
        self.comm.check_usable(name)
        return CollectiveWork.of(self.progress.submit(fn, (a, b, c)[:nargs], name, tensors))

    def _fused(self, tensors, op, options):
        compression, prescale = options
        try:  # the fusion reads every tensor before it moves any: one that is not contiguous stops it first
            self._fusion.run(tensors, op, compression=compression, prescale=prescale)
            return
        except (NotContiguousError, NotDenseError):   # (the general form names what a sparse one may do)
            pass
        _through_contiguous(self._fusion.run, tensors, op, compression=compression, prescale=prescale)

    # Point-to-point is posted at once, never queued behind collectives, so an isend and an irecv to
    # the same peer can't block each other.
    def send(self, t, dst, tag, outputs):
        return PointToPointWork.of(self.comm.isend(contiguous(t), dst, tag), outputs, kick=self.kick)

    def recv(self, t, src, tag, outputs):
        if is_contiguous(t):
            return PointToPointWork.of(self.comm.irecv(t, src, tag, True), outputs, kick=self.kick)
        tmp = contiguous(t)
        return PointToPointWork.of(self.comm.irecv(tmp, src, tag, True), outputs, finish=lambda: write_back(t, tmp),
                                   kick=self.kick)

    def shutdown(self):
        self.progress.close()
        self._fusion.close()
        self.comm.free()


class _StreamOps:
    """engine.cuda.CudaCommunicator in engine.Communicator's signatures, on torch's current stream."""

    def __init__(self, cc, device):
        self.cc, self.device = cc, device

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def allreduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM):
        if recvbuf is not None and recvbuf is not sendbuf:
            write_back(recvbuf, sendbuf)
            sendbuf = recvbuf
        self.cc.allreduce(sendbuf, op, stream=self._stream())

    def broadcast(self, buf, root=0):
        self.cc.broadcast(buf, root, stream=self._stream())

    def reduce(self, sendbuf, recvbuf=None, op=ReduceOp.SUM, root=0):
        self.cc.reduce(sendbuf, recvbuf, op, root, stream=self._stream())

    def allgather(self, sendbuf, recvbuf, counts=None):
        self.cc.allgather(sendbuf, recvbuf, counts, stream=self._stream())

    def gather(self, sendbuf, recvbuf=None, root=0, counts=None):
        self.cc.gather(sendbuf, recvbuf, root, counts, stream=self._stream())

    def scatter(self, sendbuf, recvbuf, root=0, counts=None):
        self.cc.scatter(sendbuf, recvbuf, root, counts, stream=self._stream())

    def reduce_scatter(self, sendbuf, recvbuf, op=ReduceOp.SUM, counts=None):
        self.cc.reduce_scatter(sendbuf, recvbuf, op, counts, stream=self._stream())

    def alltoall(self, sendbuf, recvbuf, send_counts=None, recv_counts=None):
        self.cc.alltoall(sendbuf, recvbuf, send_counts, recv_counts, stream=self._stream())


class CudaDevice:
    """One CUDA device of the group over NCCL: calls enqueue on torch's current stream and return a
    CudaWork at once (its wait() makes the then-current stream wait; the host never blocks).

    Point-to-point is deferred: isend/irecv are collected and posted together, in one NCCL group call,
    when one of their Works is waited on or the next collective is issued. NCCL's sends wait on the
    device for the matching receive, so an isend and an irecv posted one after the other on one stream
    would wait forever if the peer did the same (batch_isend_irecv does).

    A collective is refused when it is made once the watchdog failed, or once the group's CPU
    communicator (cpu_comm) broke: a peer lost or a call timed out there leaves NCCL to wait for the
    same peer until the watchdog's timeout. Messages are refused only for the watchdog, as on the CPU."""

    def __init__(self, cc, device, watchdog, cpu_comm=None):
        self.cc, self.device, self.watchdog, self.cpu_comm = cc, device, watchdog, cpu_comm
        self.comm = _StreamOps(cc, device)
        self._fusion = None
        self._pending = []

    def _check(self, collective=None):
        if self.watchdog.error is not None:
            raise self.watchdog.error
        if collective is not None and self.cpu_comm is not None:
            self.cpu_comm.check_usable(collective)

    def _work(self, name, outputs, seconds=None):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.watchdog.watch(event, name, self.cc, seconds)
        return registered(CudaWork(event, outputs, self.device, self.watchdog), outputs)

    def launch(self, name, fn, a, b, c, nargs, outputs, opts):
        seconds = own_timeout(opts, name)   # (the watchdog's deadline for this call)
        self._check(name)
        self.flush()  # point-to-point issued earlier goes first
        used_on(torch.cuda.current_stream(self.device), (a, b, c)[:nargs], outputs)
        (fn(a, b, c) if nargs == 3 else fn(a, b) if nargs == 2 else fn(a) if nargs == 1 else fn())
        return self._work(name, outputs, seconds)

    def fused(self, tensors, op, compression, prescale, name, sync=False, seconds=None):
        from engine.cuda.fusion import CudaFusedAllreduce
        self._check(name)
        self.flush()
        used_on(torch.cuda.current_stream(self.device), tensors)
        if self._fusion is None:
            self._fusion = CudaFusedAllreduce(self.cc)
        _through_contiguous(self._fusion.run, tensors, op, stream=self.comm._stream(), compression=compression,
                            prescale=prescale)
        return self._work(name, tensors, seconds)

    def send(self, t, dst, tag, outputs):
        return self._defer("send", t.contiguous(), dst, outputs)

    def recv(self, t, src, tag, outputs):
        if src is None:
            raise RuntimeError("recv without a source rank is not possible over NCCL (it matches sends by peer); "
                               "pass src=, or use ENGINE_CUDA_TRANSPORT=staged")
        return self._defer("recv", t, src, outputs)

    def _defer(self, kind, t, peer, outputs):
        self._check()
        buf = t if is_contiguous(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        # (what the message comes after on its caller's stream: the flush's stream, maybe another one,
        # waits for it)
        issued = torch.cuda.Event()
        issued.record(torch.cuda.current_stream(self.device))
        work = registered(CudaWork(torch.cuda.Event(), outputs, self.device, self.watchdog, flush=self.flush), outputs)
        self._pending.append((kind, t, buf, peer, issued, work))
        return work

    def flush(self):
        """Posts the deferred sends and receives in one group call, on the current stream, after what
        came before each on the stream it was issued on. A failure to post fails each of their Works."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        stream = torch.cuda.current_stream(self.device)
        try:
            for _, _, buf, _, issued, _ in pending:
                stream.wait_event(issued)
                buf.record_stream(stream)   # (a send's contiguous copy, a receive's staging: freed after)
            self.cc.sendrecv([(buf, peer) for kind, _, buf, peer, *_ in pending if kind == "send"],
                             [(buf, peer) for kind, _, buf, peer, *_ in pending if kind == "recv"],
                             stream=stream.cuda_stream)
        except Exception as exc:
            for *_, work in pending:
                work.fail(exc)
            raise
        for kind, t, buf, _, _, work in pending:
            if buf is not t:
                write_back(t, buf)
            work._event.record(stream)
            self.watchdog.watch(work._event, kind, self.cc)

    def abort(self, error):
        """The group's abort(): what was deferred is dropped and NCCL's kernels are freed
        (ncclCommAbort), so nothing waits on a peer; the Works raise error (the watchdog's)."""
        self._pending = []
        self.cc.abort(error)

    def shutdown(self):
        """Posts what was deferred, waits for the group's GPU work, then destroys the communicator.
        ncclCommDestroy waits for unfinished operations itself, with nothing to end that wait (a send
        its peer never receives); this wait ends at the watchdog's deadline, whose abort frees them."""
        try:
            self.flush()
        except Exception as exc:   # (its Works hold the failure)
            print(f"engine: posting the deferred sends and receives at the group's end failed: {exc}",
                  file=sys.stderr, flush=True)
        while self.watchdog.error is None and self.watchdog.unfinished():
            time.sleep(0.01)
        self.cc.free()


class _HostOps:
    """The CPU communicator's collectives on CUDA tensors through pinned host copies: every CUDA tensor
    argument is copied to the host, the CPU collective runs, and the copies are written back."""

    def __init__(self, cpu_comm):
        self.cpu = cpu_comm

    def __getattr__(self, name):
        op = getattr(self.cpu, name)

        def staged(*args):
            pairs = []

            def host(obj):
                if isinstance(obj, torch.Tensor) and obj.is_cuda:
                    h = _pinned(obj).copy_(obj)
                    pairs.append((obj, h))
                    return h
                return obj

            result = op(*[host(a) for a in args])
            for dev, h in pairs:
                write_back(dev, h)  # blocking: any stream may read it once we return
            return result

        return staged


class StagedDevice:
    """CUDA tensors through the group's CPU communicator (pinned host copies), synchronously and in
    issue order with the group's CPU collectives."""

    def __init__(self, cpu):
        self.cpu = cpu
        self.comm = _HostOps(cpu.comm)

    def launch(self, name, fn, a, b, c, nargs, outputs, opts):
        # The call's device copies (its outputs written back) go on the caller's stream wherever it runs
        # (in place, or on the progress thread behind queued calls, whose stream is another), and are
        # done before it returns: its Work is complete, for a reader on any stream.
        seconds = own_timeout(opts, name)
        if seconds is not None:
            fn, a, b, c, nargs = self.cpu.timed(seconds, fn, a, b, c, nargs)
        stream = torch.cuda.current_stream()
        stream.synchronize()   # (its inputs are written)
        self.cpu.progress.run(_on_stream, fn, (a, b, c)[:nargs], stream, 3, name)
        stream.synchronize()
        return CompletedWork.of(outputs)

    def fused(self, tensors, op, compression, prescale, name, sync=False, seconds=None):
        hosts = [_pinned(t).copy_(t) for t in tensors]
        self.cpu.fused(hosts, op, compression, prescale, name, sync=True, seconds=seconds)
        for t, h in zip(tensors, hosts):
            write_back(t, h)
        return CompletedWork.of(tensors)

    def send(self, t, dst, tag, outputs):
        return self.cpu.send(t.cpu(), dst, tag, outputs)

    def recv(self, t, src, tag, outputs):
        host = _pinned(t)
        return PointToPointWork.of(self.cpu.comm.irecv(host, src, tag, True), outputs,
                                   finish=lambda: write_back(t, host), kick=self.cpu.kick)

    def abort(self, error):
        pass   # (its calls run on the group's CPU communicator, which the abort ends)

    def shutdown(self):
        pass
