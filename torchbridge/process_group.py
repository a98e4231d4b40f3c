"""EngineProcessGroup: the one adapter between torch.distributed and the engine. Every c10d method
is written once, over the device communicator of its tensors (torchbridge.devices): CPU tensors go
to the group's engine.Communicator (shared memory on one host, TCP or MPI across hosts), CUDA tensors to
NCCL or through host memory. Inputs are never modified; outputs are written in place
(non-contiguous ones through a contiguous copy).

The latency path is compiled (torchbridge._fastpath, pyx/torch_fastpath.pyx): the methods torch calls
on every collective and message (allreduce, broadcast, reduce, all_gather_single, reduce_scatter_single,
all_to_all_single, barrier, send, recv, recv_anysource) are its functions. Each reads torch's options in
one C call and makes one call into the communicator, the collective running in the calling thread
(engine.progress.Progress.run) when the group is idle; anything else goes to the general method of the
same collective here (`_broadcast` for broadcast, ...), which handles every case.

Under torch's profiler every call records an event named as torch's own backends name theirs
("engine:all_reduce", with the inputs' shapes when shapes are recorded), from the call until its work
completes. Without a profiler that costs one test of torch's own flag
(torch.autograd.profiler._is_profiler_enabled, what torch's compiler checks for the same reason).
"""

import functools
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd import profiler as _autograd_profiler

from engine import Communicator, ReduceOp
from engine.launcher import MPIRUN_HINT, detect_launcher
from engine.progress import Progress

from . import _fastpath
from ._fastpath import PREMUL, op_of
from .devices import CpuDevice, CudaDevice, StagedDevice, contiguous
from .fault import FaultTolerance, Unavailable, no_members_error, reconfigured
from .work import CollectiveWork, PointToPointWork

_GROUP_TAG = 31337  # MPI_Comm_create_group tag for torch sub-groups

# -- profiler events --

_RecordFunction = torch._C._profiler._RecordFunctionFast  # records the inputs' shapes when asked to


def _traced(name, inputs=None):
    """A c10d method that, under torch's profiler, records the event "engine:<name>" (with the shapes
    of inputs(*args): the tensors torch's own backends record) from the call until its work completes.
    Without a profiler: one test of torch's flag."""
    title = "engine:" + name

    def wrap(method):
        @functools.wraps(method)
        def traced(self, *args, **kwargs):
            if not _autograd_profiler._is_profiler_enabled:
                return method(self, *args, **kwargs)
            return _record(title, inputs(*args) if inputs is not None else [], method, self, args, kwargs)

        return traced

    return wrap


def _record(title, inputs, method, self, args, kwargs):
    event = _RecordFunction(title, list(inputs))
    event.__enter__()
    try:
        work = method(self, *args, **kwargs)
    except BaseException:
        _end(event)
        raise
    _end_when_done(work, event)
    return work


def _end(event, *_):
    event.__exit__(None, None, None)


def _end_when_done(work, event):
    """Ends event when work completes, in the thread that completes it (the progress thread, or a
    caller who waits), as torch's backends end theirs. Work already complete (a synchronous call ran in
    place) ends it now, and so does CUDA work: that is enqueued on a stream, and the GPU's own activity
    in the profile shows when it runs."""
    if type(work) is CollectiveWork:
        task = work._task
        task.progress.add_done_callback(task, functools.partial(_end, event))
    elif type(work) is PointToPointWork:
        work.add_done_callback(functools.partial(_end, event))
    else:
        _end(event)


def _first(tensors, *_):
    return tensors


def _second(_, tensors, *__):
    return tensors


def _second_one(_, tensor, *__):
    return [tensor]


def _root_inputs(_, input_lists, *__):
    return input_lists[0] if input_lists else []


def create_process_group(opts, backend_options=None):
    """The creator torch calls (extended API) on each member of a new group. Under an MPI launcher the
    group is made through MPI; otherwise (torchrun, mp.spawn, plain python) through torch's store
    (shared memory inside a host, the engine's TCP transport between hosts). After a reconfigure the
    store is used under MPI too: MPI's world no longer says who the members are. A group made with
    enable_reconfigure=True (torch 2.14) gets its communicator from its first reconfigure."""
    seconds = opts.timeout.total_seconds() if opts.timeout is not None else None
    name = opts.group_id or "default"
    ranks = list(opts.global_ranks_in_group)
    store = attempt_store(opts.store)
    if getattr(opts, "enable_reconfigure", False):
        return EngineProcessGroup(None, opts.group_rank, opts.group_size, opts.timeout, store, name, listen=True)
    if detect_launcher() is None or reconfigured():
        comm = Communicator.from_store(store, opts.group_rank, opts.group_size, prefix="engine/boot",
                                       timeout=seconds, name=name)
    else:
        mpi_comm = _mpi_group(opts, ranks)
        comm = Communicator(mpi_comm, timeout=seconds, store=store, name=name, _owned=mpi_comm)
    return EngineProcessGroup(comm, opts.group_rank, opts.group_size, opts.timeout, store, name)


def attempt_store(store):
    """The part of torch's store that belongs to this attempt of the job. torchrun hands every attempt
    of a restarted job the same store (its agent's: c10d and static rendezvous alike), and torch's own
    keys for a group are the same in each, so a restarted worker would read what the attempt before it
    wrote (a dead rank's segment, its addresses). Under torchrun the engine's keys go under the run and
    the attempt (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT); other launches make their store anew
    with the job (rank 0 hosts it)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if store is None or attempt is None:
        return store
    return dist.PrefixStore(f"engine/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt-{attempt}", store)


def _mpi_group(opts, ranks):
    """An MPI communicator of the group's members (collective over them only)."""
    from engine import mpi
    MPI = mpi.load()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("backend 'engine' needs MPI_THREAD_MULTIPLE (its progress thread calls MPI); this MPI "
                           f"was initialised with level {MPI.Query_thread()}: leave mpi4py.rc.thread_level at "
                           "'multiple' and use an MPI built with thread support")
    world = MPI.COMM_WORLD
    if not ranks:  # the default group: everyone
        if world.Get_size() != opts.group_size or world.Get_rank() != opts.group_rank:
            raise RuntimeError(
                f"torch.distributed says rank {opts.group_rank} of {opts.group_size}, but MPI says rank "
                f"{world.Get_rank()} of {world.Get_size()}: the processes were not started by one MPI launcher; "
                f"{MPIRUN_HINT}")
        return world.Dup()
    if world.Get_rank() not in ranks or ranks.index(world.Get_rank()) != opts.group_rank:
        raise RuntimeError(f"rank {world.Get_rank()} asked to join group {ranks} as rank {opts.group_rank}")
    group = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(group, tag=_GROUP_TAG)
    finally:
        group.Free()


def _seconds(timeout, default):
    """A timeout (timedelta, seconds or None: `default`) in seconds."""
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _one(tensors, what):
    if len(tensors) != 1:
        raise RuntimeError(f"engine {what}: expected a list with one tensor (one device per process), got {len(tensors)}")
    return tensors[0]


def _reduce_op(opts):
    """(engine op, premultiply factor or None) for the ReduceOp of torch's options."""
    if opts is None:
        return ReduceOp.SUM, None
    red = opts.reduceOp
    code, op = op_of(red)
    if op is not None:
        return op, None
    if code == PREMUL:
        return ReduceOp.SUM, red.factor
    raise RuntimeError(f"backend 'engine' does not support reduce op {red.op}")


def _nothing():
    pass


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
        tmp = contiguous(out)
        fn(tmp)
        out.copy_(tmp)


def _sparse_sum(t, comm):
    """all_reduce (SUM) of a sparse COO tensor as Gloo does it: every rank's coalesced indices and values
    are gathered, concatenated in rank order and summed by coalescing; the sum is written into t."""
    mine = t.coalesce()
    indices, values = mine.indices(), mine.values()
    meta = torch.tensor([mine._nnz(), mine.sparse_dim(), mine.dim(), hash(tuple(mine.shape)), t.dtype.itemsize,
                         t.dtype.is_floating_point, t.dtype.is_complex], dtype=torch.int64)
    metas = torch.empty(comm.size * meta.numel(), dtype=torch.int64)
    comm.allgather(meta, metas)
    metas = metas.view(comm.size, -1)
    if not bool((metas[:, 1:] == meta[1:]).all()):
        differ = [r for r in range(comm.size) if not bool((metas[r, 1:] == meta[1:]).all())]
        raise ValueError(f"engine all_reduce of a sparse tensor: ranks {', '.join(map(str, differ))} passed a "
                         f"sparse tensor of another shape, sparse dimension or dtype than this rank's "
                         f"{tuple(t.shape)} {t.dtype} with {mine.sparse_dim()} sparse dimensions")
    counts = metas[:, 0].tolist()
    total = sum(counts)
    if total == 0:
        t.copy_(mine)
        return
    row = math.prod(values.shape[1:])
    all_indices = indices.new_empty(total, indices.shape[0])  # rank-major: each rank's block is contiguous
    comm.allgather(indices.t().contiguous(), all_indices, _uneven([n * indices.shape[0] for n in counts]))
    all_values = values.new_empty((total,) + tuple(values.shape[1:]))
    comm.allgather(values.contiguous(), all_values, _uneven([n * row for n in counts]))
    t.copy_(torch.sparse_coo_tensor(all_indices.t(), all_values, t.shape, check_invariants=False).coalesce())


def _flat(tensors, like):
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else like.new_empty(0)


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


class EngineProcessGroup(FaultTolerance, dist.ProcessGroup):
    """A torch ProcessGroup over one engine.Communicator (and, for CUDA tensors, NCCL); abort and
    reconfigure: torchbridge/fault.py. comm None: no members until the first reconfigure."""

    def __init__(self, comm, rank, size, timeout=None, store=None, name="default", listen=False):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._cuda = torch.cuda.is_available()  # False: no CUDA routing at all
        self._store, self._name, self._timeout = store, name, timeout
        self._cuda_transport = None
        self._init_fault_tolerance(listen)
        if comm is None:
            self._detach(no_members_error(name))
        else:
            self._attach(comm)

    def _attach(self, comm):
        """Runs the group's calls on comm from now on."""
        self._comm = comm
        self._progress = Progress(name=f"engine-progress-{self._name}")
        self._cpu = CpuDevice(comm, self._progress)
        self._fast = _fastpath.FastPath(comm, self._progress, self._cuda)
        self._devices = {}                       # CUDA device index -> CudaDevice / StagedDevice
        self._watchdog = None

    def _detach(self, error, abort=True):
        """Takes the communicator off the group; every later call raises `error` (None: this is a
        swap, the caller attaches another at once). With an error and abort, what is queued and running
        ends with it; without abort, what is queued still runs before the release frees the group.
        Returns (comm, cpu device, CUDA devices, watchdog) for _release."""
        comm = getattr(self, "_comm", None)
        cpu = self._cpu if comm is not None else None   # (without a communicator: the stand-in)
        devices, watchdog = list(getattr(self, "_devices", {}).values()), getattr(self, "_watchdog", None)
        if error is not None and abort:
            if comm is not None:
                comm.abort()
            if cpu is not None:
                cpu.progress.abort(error)
        stand_in = Unavailable(error or RuntimeError("process group is being reconfigured"), self._rank, self._size)
        self._comm = None
        self._cpu = stand_in
        self._progress = stand_in
        self._fast = _fastpath.FastPath(stand_in, stand_in, self._cuda)
        self._devices, self._watchdog = {}, None
        return comm, cpu, devices, watchdog

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
        """The engine Communicator behind this group (CPU tensors)."""
        return self._comm

    # -- the group as its own per-device backend --
    # torch keeps a C++ Backend per device for its own groups and reaches it with _get_backend(device)
    # (monitored_barrier, timeouts, splitting, eager init); a Backend can't be made in Python, and torch
    # uses a Python group as it is. So the group answers as its devices' backend itself: torch's Python
    # code that asks for the backend gets this group, and the Backend methods and properties it uses
    # next (monitored_barrier, supports_*) are here.

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False
    supports_tensor_alloc = False

    @property
    def _device_types(self):
        return [torch.device("cpu"), torch.device("cuda")] if self._cuda else [torch.device("cpu")]

    def get_backend(self, device):
        return self._get_backend(device)

    def _get_backend(self, device):
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        if kind == "cpu" or (kind == "cuda" and self._cuda):
            return self
        raise RuntimeError(f"No backend type associated with device type {kind}: backend 'engine' serves "
                           f"{' and '.join(d.type for d in self._device_types)} tensors")

    @_traced("monitored_barrier")
    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """Gloo's monitored barrier: every rank reports to rank 0, which waits at most `timeout` (default:
        the group's) and names in its error the ranks that did not arrive (the first, or with
        wait_all_ranks every one); then it releases the others, or tells them it failed. The ranks
        meet in the group's store, not on its transport, so a collective stuck on this group can't
        hold it up. dist.monitored_barrier refuses every backend not named "gloo" (torch checks the
        name): call it on the group, `(group or dist.group.WORLD).monitored_barrier(timeout)`."""
        seconds = _seconds(timeout, self._timeout_seconds())
        seq = self._monitored_seq = getattr(self, "_monitored_seq", 0) + 1
        if self.size() == 1:
            return
        if self._store is None:
            raise RuntimeError("monitored_barrier needs the group's store (a group torch created)")
        key = f"engine/monitored-barrier/{seq}/"
        if self.rank() != 0:
            return self._report_to_rank_0(key, seq)
        start = time.monotonic()
        arrived, missing = [], []
        for r in range(1, self.size()):
            left = start + seconds - time.monotonic()
            if self._arrives(key + str(r), left):
                arrived.append(r)
                continue
            if wait_all_ranks:
                missing.append(r)
                continue
            if left <= 0:  # no time left to wait for rank r at all (Gloo's wording)
                error = (f"[Rank 0]: Rank 0 timed out in monitoredBarrier after {seconds * 1e3:.0f} ms: Timed out "
                         f"before rank {r} arrived (monitored barrier #{seq} of group {self._name!r}; ranks that "
                         f"arrived: {', '.join(map(str, arrived)) or 'none'})")
            else:
                error = (f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {seconds * 1e3:.0f} ms: Timed out "
                         f"waiting for it (monitored barrier #{seq} of group {self._name!r})")
            break
        else:
            error = None
            if missing:
                error = (f"[Rank 0]: Rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} failed to "
                         f"pass monitoredBarrier in {seconds * 1e3:.0f} ms: Timed out waiting for "
                         f"{'them' if len(missing) > 1 else 'it'} (monitored barrier #{seq} of group {self._name!r})")
        self._store.set(key + "verdict", error or "ok")
        if error is not None:
            raise RuntimeError(error)

    def _arrives(self, key, seconds):
        """Whether key is set in the store within seconds (at once when seconds <= 0)."""
        if seconds > 0:
            try:
                self._store.wait([key], timedelta(seconds=seconds))
                return True
            except RuntimeError:  # the store's timeout (its own exception type and wording)
                pass
        return self._store.check([key])

    def _report_to_rank_0(self, key, seq):
        rank = self.rank()
        self._store.set(key + str(rank), "")
        # Rank 0 answers when everyone arrived or its own timeout ran out; this rank waits as long as the
        # group's timeout (as Gloo's other ranks do), rank 0 itself may be the one late.
        seconds = self._timeout_seconds()
        if not self._arrives(key + "verdict", seconds):
            raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                               f"for send/recv from rank 0: Timed out after {seconds:g} s waiting for rank 0's answer "
                               f"(monitored barrier #{seq} of group {self._name!r}); rank 0 did not arrive")
        verdict = self._store.get(key + "verdict").decode()
        if verdict != "ok":
            raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                               f"for send/recv from rank 0: rank 0 reported: {verdict}")

    # -- which device communicator --

    def _device(self, t):
        if self._cuda and t.is_cuda:
            return self._cuda_device(t.device.index)
        return self._cpu

    def _cuda_device(self, index):
        dev = self._devices.get(index)
        if dev is None:
            dev = self._devices[index] = self._make_cuda_device(index)
        return dev

    def _make_cuda_device(self, index):
        from engine.config import env_choice
        if self._cuda_transport is None:
            forced = env_choice("ENGINE_CUDA_TRANSPORT", ("auto", "nccl", "staged"), "auto")
            self._cuda_transport = "staged" if forced == "staged" else self._nccl_or_staged(forced)
        if self._cuda_transport == "staged":
            return StagedDevice(self._cpu)
        from engine.cuda.communicator import CudaCommunicator
        from engine.cuda.nccl import unique_id_over_store
        from engine.cuda.watchdog import Watchdog
        rank, size = self.rank(), self.size()
        uid = unique_id_over_store(self._store, f"engine/nccl/{self._name}/{index}", rank)
        with torch.cuda.device(index):
            cc = CudaCommunicator(uid, rank, size, index)
        if self._watchdog is None:
            seconds = self._timeout.total_seconds() if self._timeout is not None else 1800.0
            self._watchdog = Watchdog(self._name, rank, size, seconds)
        return CudaDevice(cc, index, self._watchdog)

    def _nccl_or_staged(self, forced):
        import warnings
        from engine.bootstrap import StoreBootstrap, host_identity
        from engine.cuda import load_cupy
        load_cupy()  # without the extra: an ImportError naming it
        if forced == "nccl":
            return "nccl"
        dev = torch.cuda.current_device()
        mine = (host_identity()[0], str(torch.cuda.get_device_properties(dev).uuid))
        everyone = StoreBootstrap(self._store, self.rank(), self.size(), "engine/gpus").allgather(mine)
        if len(set(everyone)) < len(everyone):
            warnings.warn("backend 'engine': ranks of this group share a GPU, which NCCL refuses; CUDA tensors take "
                          "the host-staged path (ENGINE_CUDA_TRANSPORT=staged)", RuntimeWarning, stacklevel=4)
            return "staged"
        return "nccl"

    # -- reductions --

    # The latency path, compiled: each falls back to the general method named with an underscore.
    allreduce = _fastpath.allreduce
    broadcast = _fastpath.broadcast
    reduce = _fastpath.reduce
    all_gather_single = _allgather_base = _fastpath.all_gather_single
    reduce_scatter_single = _reduce_scatter_base = _fastpath.reduce_scatter_single
    all_to_all_single = alltoall_base = _fastpath.alltoall_base  # (torch 2.13 calls the first)
    barrier = _fastpath.barrier
    send = _fastpath.send
    recv = _fastpath.recv
    recv_anysource = _fastpath.recv_anysource

    @_traced("all_reduce", _first)
    def _allreduce(self, tensors, opts):
        t = _one(tensors, "allreduce")
        if t.is_sparse:
            return self._sparse_allreduce(t, tensors, opts)
        dev = self._device(t)
        op, factor = _reduce_op(opts)
        if factor is None:
            if t.is_contiguous():  # the latency path: no closure
                return dev.launch("allreduce", dev.comm.allreduce, t, None, op, 3, tensors, opts)
            comm = dev.comm
            return dev.launch("allreduce", _write, t, lambda buf: comm.allreduce(buf, None, op), None, 2, tensors,
                              opts)
        comm = dev.comm
        return dev.launch("allreduce", _write, t, lambda buf: comm.allreduce(_premul(t, factor), buf, op), None, 2,
                          tensors, opts)

    def _sparse_allreduce(self, t, tensors, opts):
        op, factor = _reduce_op(opts)
        if op != ReduceOp.SUM or factor is not None:
            raise RuntimeError(f"engine all_reduce of a sparse tensor: only ReduceOp.SUM is supported (as Gloo), got "
                               f"{opts.reduceOp.op}; pass a dense tensor (tensor.to_dense()) for other ops")
        if t.is_cuda:
            raise RuntimeError("engine all_reduce of a sparse tensor: CUDA sparse tensors are not supported; move it "
                               "to the CPU (tensor.cpu()) or pass a dense tensor")
        return self._cpu.launch("allreduce", _sparse_sum, t, self._cpu.comm, None, 2, tensors, opts)

    @_traced("all_reduce_coalesced", _first)
    def allreduce_coalesced(self, tensors, opts=None):
        """Fused: tensors packed into buckets (engine.fusion), one allreduce per bucket."""
        op, factor = _reduce_op(opts)
        if factor is not None:
            for t in tensors:
                _check_premul(t)
        if not tensors:
            return self._barrier()
        sync = opts is not None and not opts.asyncOp
        return self._device(tensors[0]).fused(tensors, op, None, factor or 1.0, "allreduce_coalesced", sync)

    @_traced("fused_allreduce", _first)
    def fused_allreduce_async(self, tensors, op=ReduceOp.SUM, *, compression=None, name="fused_allreduce"):
        """Queues a fused allreduce of tensors (in place) and returns its Work at once: the buckets of
        DistributedOptimizer and the DDP comm hooks."""
        if not tensors:
            return self._cpu.launch(name, _nothing, None, None, None, 0, [], None)
        return self._device(tensors[0]).fused(tensors, op, compression, 1.0, name)

    @_traced("fused_allreduce", _first)
    def fused_allreduce(self, tensors, op=ReduceOp.SUM, *, compression=None, prescale=1.0):
        """Runs now (CUDA: enqueued on the current stream, what follows on it sees the result)."""
        if tensors:
            self._device(tensors[0]).fused(tensors, op, compression, prescale, "fused_allreduce", sync=True)

    @_traced("reduce", _first)
    def _reduce(self, tensors, opts):
        t = _one(tensors, "reduce")
        dev = self._device(t)
        op, factor = _reduce_op(opts)
        root, comm = opts.rootRank, dev.comm

        def run():
            src = _premul(t, factor) if factor is not None else contiguous(t)
            if self.rank() == root:
                _write(t, lambda buf: comm.reduce(src, buf if src is not buf else None, op, root))
            else:
                comm.reduce(src, None, op, root)

        return dev.launch("reduce", run, None, None, None, 0, tensors, opts)

    @_traced("reduce_scatter", _root_inputs)
    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        dev = self._device(out)
        op, factor = _reduce_op(opts)
        _check_per_rank(inputs, self.size(), out.dtype, "reduce_scatter", "input")
        comm = dev.comm

        def run():
            flat = _flat(inputs, out)
            if factor is not None:
                flat = _premul(flat, factor)
            _write(out, lambda buf: comm.reduce_scatter(flat, buf, op, _uneven([i.numel() for i in inputs])))

        return dev.launch("reduce_scatter", run, None, None, None, 0, output_tensors, opts)

    def _reduce_scatter_single(self, output, input, opts=None):
        dev = self._device(output)
        op, factor = _reduce_op(opts)
        comm = dev.comm

        def run():
            src = _premul(input, factor) if factor is not None else contiguous(input)
            _write(output, lambda buf: comm.reduce_scatter(src, buf, op))

        return dev.launch("reduce_scatter_tensor", run, None, None, None, 0, [output], opts)

    _reduce_scatter_tensor = _traced("reduce_scatter_tensor", _second_one)(_reduce_scatter_single)

    @_traced("reduce_scatter_tensor_coalesced", _second)
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self._barrier()

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --

    @_traced("broadcast", _first)
    def _broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        dev = self._device(t)
        if t.is_contiguous():
            return dev.launch("broadcast", dev.comm.broadcast, t, opts.rootRank, None, 2, tensors, opts)
        comm, root = dev.comm, opts.rootRank
        return dev.launch("broadcast", _write, t, lambda buf: comm.broadcast(buf, root), None, 2, tensors, opts)

    def _allgather(self, output_lists, input_tensors, opts=None):
        outs = _one(output_lists, "allgather")
        inp = _one(input_tensors, "allgather")
        _check_per_rank(outs, self.size(), inp.dtype, "all_gather", "output")
        dev = self._device(inp)
        comm = dev.comm

        def run():
            counts = [o.numel() for o in outs]
            flat = inp.new_empty(sum(counts))
            comm.allgather(contiguous(inp), flat, _uneven(counts))
            _scatter_back(flat, outs)

        return dev.launch("allgather", run, None, None, None, 0, output_lists, opts)

    allgather = _traced("all_gather", _second)(_allgather)

    def _all_gather_single(self, output, input, opts=None):
        dev = self._device(input)
        comm = dev.comm
        return dev.launch("all_gather_into_tensor", _write, output,
                          lambda buf: comm.allgather(contiguous(input), buf), None, 2, [output], opts)

    _all_gather_into_tensor = _traced("all_gather_into_tensor", _second_one)(_all_gather_single)

    @_traced("all_gather_into_tensor_coalesced", _second)
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self._all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self._barrier()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_traced("all_gather_coalesced", _second)
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][j] receives rank r's input_list[j]: one allgather per input."""
        works = [self._allgather([[outs[j] for outs in output_lists]], [inp], opts) for j, inp in enumerate(input_list)]
        return works[-1] if works else self._barrier()

    @_traced("gather", _second)
    def gather(self, output_lists, input_tensors, opts):
        inp = _one(input_tensors, "gather")
        dev = self._device(inp)
        root, comm = opts.rootRank, dev.comm
        outs = output_lists[0] if output_lists else []
        if self.rank() == root:
            _check_per_rank(outs, self.size(), inp.dtype, "gather", "output", " on the root")

        def run():
            if self.rank() != root:
                comm.gather(contiguous(inp), None, root)
                return
            counts = [o.numel() for o in outs]
            flat = inp.new_empty(sum(counts))
            comm.gather(contiguous(inp), flat, root, _uneven(counts))
            _scatter_back(flat, outs)

        return dev.launch("gather", run, None, None, None, 0, output_lists, opts)

    @_traced("scatter", _root_inputs)
    def scatter(self, output_tensors, input_lists, opts):
        out = _one(output_tensors, "scatter")
        dev = self._device(out)
        root, comm = opts.rootRank, dev.comm
        inputs = input_lists[0] if input_lists else []
        if self.rank() == root:
            _check_per_rank(inputs, self.size(), out.dtype, "scatter", "input", " on the root")

        def run():
            if self.rank() == root:
                flat = _flat(inputs, out)
                _write(out, lambda buf: comm.scatter(flat, buf, root, _uneven([i.numel() for i in inputs])))
            else:
                _write(out, lambda buf: comm.scatter(None, buf, root))

        return dev.launch("scatter", run, None, None, None, 0, output_tensors, opts)

    @_traced("all_to_all", _second)
    def alltoall(self, output_tensors, input_tensors, opts=None):
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise ValueError(f"all_to_all needs {self.size()} input and output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        _check_dtypes(list(output_tensors) + list(input_tensors), input_tensors[0].dtype, "all_to_all")
        dev = self._device(input_tensors[0])
        comm = dev.comm

        def run():
            recv_counts = [o.numel() for o in output_tensors]
            flat = output_tensors[0].new_empty(sum(recv_counts))
            comm.alltoall(_flat(input_tensors, flat), flat, [i.numel() for i in input_tensors], recv_counts)
            _scatter_back(flat, output_tensors)

        return dev.launch("alltoall", run, None, None, None, 0, output_tensors, opts)

    @_traced("all_to_all_single", _second_one)
    def _alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        send_counts, recv_counts = all_to_all_counts(output, input, output_split_sizes, input_split_sizes,
                                                     self.size())
        dev = self._device(input)
        comm = dev.comm
        return dev.launch("alltoall_base", _write, output,
                          lambda buf: comm.alltoall(contiguous(input), buf, send_counts, recv_counts), None, 2,
                          [output], opts)

    def _barrier(self, opts=None):
        # The ranks meet on the host: no CUDA device is involved (torch's own NCCL barrier would allreduce
        # on the GPU); CUDA work already enqueued keeps its own order.
        return self._cpu.launch("barrier", getattr(self._comm, "barrier", None), None, None, None, 0, [], opts)

    _traced_barrier = _traced("barrier")(_barrier)

    # -- point to point: posted now, never queued behind collectives --

    @_traced("send", _first)
    def _send(self, tensors, dst, tag):
        t = _one(tensors, "send")
        return self._device(t).send(t, dst, tag, tensors)

    @_traced("recv", _first)
    def _recv(self, tensors, src, tag):
        t = _one(tensors, "recv")
        return self._device(t).recv(t, src, tag, tensors)

    @_traced("recvAnySource", _first)
    def _recv_anysource(self, tensors, tag):
        t = _one(tensors, "recv")
        return self._device(t).recv(t, None, tag, tensors)

    # -- lifetime --

    def shutdown(self):
        """destroy_process_group: what is queued runs, then the group's memory, descriptors and threads go.
        The store goes too: a destroyed group a caller still holds must not keep torch's store (its
        sockets, and rank 0's server thread) alive."""
        self._close_listener()
        self._store = None
        if self._comm is None:
            return
        self._release(*self._detach(RuntimeError(
            f"process group {self._name!r} was shut down (destroy_process_group); create a new one"), abort=False))
