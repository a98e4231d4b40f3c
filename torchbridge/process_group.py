"""EngineProcessGroup: the one adapter between torch.distributed and the engine. Every c10d method
is written once, over the device communicator of its tensors (torchbridge.devices): CPU tensors go
to the group's engine.Communicator (shared memory on one host, TCP or MPI across hosts), CUDA tensors to
NCCL or through host memory. Inputs are never modified; outputs are written in place
(non-contiguous ones through a contiguous copy)."""

import functools
import sys
import types

import torch
import torch.distributed as dist

from engine import ReduceOp, failure
from engine._core import OP_KIND_NAMES, NotDivisibleError
from engine.monitored_barrier import monitored_barrier
from engine.progress import Progress, ran, was_run

from . import _fastpath
from ._fastpath import OTHER_FORMS, PREMUL, fill_options, op_of, rows
from .devices import CpuDevice, CudaDevice, StagedDevice, contiguous, is_contiguous, write_back
from .fault import FaultTolerance, Unavailable, no_members_error
from .sparse import sparse_sum, uneven
from .tracing import CollectiveHooks, first, root_inputs, second, second_one, traced
from .work import all_of, in_seconds, own_timeout

# The engine's collectives, longest name first: the one a c10d call's hook name begins with ("REDUCE_SCATTER_BASE").
_KINDS = sorted(OP_KIND_NAMES, key=len, reverse=True)


def _end_cuda_side(name, comm, devices, watchdog, error, swap):
    """Aborts a group's CUDA devices (ncclCommAbort) where a destroy could wait for ever: on abort()
    (error), when the group is broken, and when it is swapped (swap: a reconfigure) with a collective
    still unfinished on the GPU, which may wait on a peer that is gone. Otherwise the release destroys
    them after what they run: a destroyed group's collectives still running finish first (the
    release waits for them, at most to the watchdog's deadline, whose abort ends them). The watchdog
    goes first, so that what the devices' abort makes NCCL report is not taken for a failure of its
    own."""
    stuck = watchdog is not None and (watchdog.error is not None or (swap and watchdog.unfinished()))
    if error is None and not (stuck or comm.watch.broken):
        return
    error = error or RuntimeError(f"process group {name!r} was reconfigured or destroyed while a CUDA collective "
                                  "of its earlier members had not finished or the group was broken: it was ended "
                                  "(ncclCommAbort)")
    if watchdog is not None:
        watchdog.abort(error)
    for dev in devices:
        try:
            dev.abort(error)
        except Exception as exc:   # (one device's failure must not keep the others, or the group, attached)
            print(f"engine: aborting group {name!r}'s CUDA device failed: {exc}", file=sys.stderr, flush=True)


def _nonnegative(tag):
    """A receive's tag as torch gives it: the engine's -1 (any tag) is no torch tag; a receive with it
    took a message of any tag."""
    if tag < 0:
        raise ValueError(f"recv: tag {tag} is out of range; torch's tags are nonnegative (Gloo: Tag must be "
                         "nonnegative)")
    return tag


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


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
        factor = getattr(red, "factor", None)
        if factor is None:  # torch before 2.13 keeps it in C++ only
            raise RuntimeError(f"backend 'engine' reads PREMUL_SUM's factor from ReduceOp.factor, which torch "
                               f"{torch.__version__} does not expose: use torch 2.13 or newer, or multiply the "
                               f"tensor yourself and reduce with SUM")
        # (the engine scales by a real factor: a complex one's imaginary part would be dropped)
        if isinstance(factor, torch.Tensor) and torch.is_complex(factor):
            if not bool(factor.imag.ne(0).any()):
                return ReduceOp.SUM, factor.real   # (cast as it is, it warned that it discards the imaginary part)
            raise ValueError(f"backend 'engine': PREMUL_SUM's factor {factor} is complex, and the engine scales by a "
                             "real factor only (the imaginary part would be dropped): multiply the tensor by it "
                             "yourself and reduce with SUM")
        return ReduceOp.SUM, factor
    raise RuntimeError(f"backend 'engine' does not support reduce op {red.op}")


def _real(tensors, opts, what, written=1):
    """Complex tensors as their real views ((re, im) pairs: the last dimension doubled), on which SUM,
    AVG and PREMUL_SUM are the complex ones, and the others refused as torch refuses them. torch does
    this before dist.all_reduce, not before reduce and reduce_scatter, nor before a group's own
    allreduce or its coalesced form (funcol's, which compiled graphs call) (Gloo reduces complex
    tensors); a mix of complex and real tensors is left to the dtype checks. The first `written` are
    written: one lazily conjugated is refused, as the buffer layer refuses it (Gloo leaves such a
    reduce's root unreduced); the others are read, resolved where conjugated (as Gloo reads them)."""
    if not all(t.is_complex() for t in tensors):
        return tensors
    op = (opts.reduceOp if opts is not None else dist.ReduceOp(dist.ReduceOp.SUM)).op
    if not dist.distributed_c10d.supports_complex(op):
        raise ValueError(f"engine {what} does not support {op} on complex tensors: SUM, AVG and PREMUL_SUM reduce them")
    if any(t.is_conj() for t in tensors[:written]):
        raise ValueError(f"engine {what}: its output is a lazily conjugated view (its memory holds the values before "
                         "that); pass tensor.resolve_conj() and copy the result back")
    return [torch.view_as_real(t.resolve_conj()) for t in tensors]


def _check_root_tensor(opts, what):
    if opts.rootTensor != 0:   # (torch's list form's index of the root's tensor: the engine takes one)
        raise ValueError(f"engine {what}: rootTensor is {opts.rootTensor}, but the engine takes one tensor per "
                         "process, so the root's is tensors[0]: pass rootTensor=0")


def _one_list(lists, what, kind, root, rank):
    """The root's one list of gather's outputs or scatter's inputs; [] on the others, which pass none."""
    if rank == root and len(lists) != 1:
        raise ValueError(f"engine {what}: the root takes one list of {kind} tensors (one per rank), in a list of "
                         f"one; got {len(lists)} lists")
    if rank != root and any(len(tensors) for tensors in lists):
        raise ValueError(f"engine {what}: only the root (rank {root}) passes {kind} tensors; this rank ({rank}) "
                         f"passed {sum(len(tensors) for tensors in lists)}: pass none here")
    return lists[0] if rank == root else []


def _check_premul(t):
    if not t.is_floating_point():
        raise RuntimeError(f"PREMUL_SUM needs a floating dtype, got {t.dtype}")
    if t.element_size() == 1:   # (torch can't scale them, and the engine reduces none: the core's words)
        raise ValueError(f"reduce op PREMUL_SUM is not supported for dtype {str(t.dtype)[6:]}: the engine moves 8- "
                         "and 4-bit float formats (all_gather, broadcast, all_to_all, scatter, gather, send/recv) but "
                         "does not reduce them; reduce in bfloat16 or float32 and cast the result")


def _premul(t, factor):
    """A scaled copy for PREMUL_SUM (the input itself is never modified), in t's dtype, as NCCL scales
    (a factor tensor of another dtype would promote the copy), contiguous (a product keeps a dense
    tensor's layout: channels_last, a transpose)."""
    _check_premul(t)
    return contiguous(t * (factor.to(t.dtype) if isinstance(factor, torch.Tensor) else factor))


def _source(t, factor):
    return _premul(t, factor) if factor is not None else contiguous(t)


def _write(out, fn):
    if is_contiguous(out):
        fn(out)
    else:
        tmp = contiguous(out)
        fn(tmp)
        write_back(out, tmp)


def _flat(tensors, like):
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else like.new_empty(0)


def _check_per_rank(tensors, size, dtype, what, kind, where=""):
    if len(tensors) != size:
        raise ValueError(f"{what} needs one {kind} tensor per rank ({size}){where}, got {len(tensors)}")
    _check_dtypes(tensors, dtype, what)


def _check_dtypes(tensors, dtype, what):
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"engine {what}: tensors must share one dtype, got {dtype} and {t.dtype}")


def _scatter_back(flat, outputs):
    for out, piece in zip(outputs, flat.split([o.numel() for o in outputs])):
        write_back(out, piece.view(out.shape))


def _check_pair(name, out, inp, gathers, size, where=""):
    """One output and one input of a collective over a tensor that holds size() blocks (gathers: the
    output, all_gather_into_tensor's; else the input, reduce_scatter_tensor's), in torch's words."""
    if out.dtype != inp.dtype:
        raise TypeError(f"{name}: output tensor{where} is {out.dtype} but the input tensor is {inp.dtype}; they "
                        "must have the same dtype")
    whole, block = (out, inp) if gathers else (inp, out)
    if whole.numel() != block.numel() * size:
        raise ValueError(f"{name}: invalid size of {'output' if gathers else 'input'} tensor{where}: it has "
                         f"{whole.numel()} elements; it needs {block.numel()} x {size} ranks = {block.numel() * size} "
                         f"(the {'input' if gathers else 'output'} tensor's elements, once per rank)")


def _check_block(name, tensors, rank, kind, one, one_kind):
    """A list of one tensor per rank beside one tensor (`one`): this rank's entry is as large as it."""
    if tensors[rank].numel() != one.numel():
        raise ValueError(f"{name}: {kind} tensor {rank} (this rank's) has {tensors[rank].numel()} elements but the "
                         f"{one_kind} tensor has {one.numel()}; this rank's entry is as large as it")


def _coalesced(single, name, gathers):
    """The coalesced form of pair method `single`, traced as `name`: every pair checked before any is
    queued (a bad one raises naming its index, nothing runs), then one Work for them all (a barrier's
    for none). gathers: each output holds size() inputs (all_gather), else each input size() outputs."""
    @traced(name, second)
    def coalesced(self, outputs, inputs, opts=None):
        if len(outputs) != len(inputs):
            raise ValueError(f"{name}: {len(outputs)} output tensors for {len(inputs)} inputs; it takes one "
                             "output per input")
        for i, (out, inp) in enumerate(zip(outputs, inputs)):
            _check_pair(name, out, inp, gathers, self.size(), f" at index {i}")
        works = [single(self, o, i, opts) for o, i in zip(outputs, inputs)]
        return all_of(works, outputs) if works else self._barrier()
    return coalesced


def other_forms(name):
    """A list method that takes torch's other form of it too (OTHER_FORMS), as the list form."""
    options, one, fields = OTHER_FORMS[name]
    tensors = ("tensors, tensors", "tensor, tensors", "tensors, tensor")[0 if one is None else one + 1]
    form = f"{name}(): takes (tensor lists, options) or ({tensors}, {', '.join(fields)})"

    def wrap(method):
        @functools.wraps(method)
        def either(self, first, second, *rest, **named):
            opts = rest[0] if rest else named.get("opts")
            single = None if one is None else (first, second)[one]
            if (len(rest) + len(named) <= 1 and named.keys() <= {"opts"} and (opts is None or isinstance(opts, options))
                    and not isinstance(single, torch.Tensor)):
                return method(self, first, second, opts)
            if one is not None:
                if not isinstance(single, torch.Tensor):   # (a list there, with a timeout or a root: both forms)
                    raise TypeError(f"{form}; got a {type(single).__name__} where its one tensor goes")
                first, second = [first], [second]
            return method(self, first, second, fill_options(options, fields, rest, named, form, one is not None))
        return either
    return wrap


def all_to_all_counts(comm, output, input, output_split_sizes, input_split_sizes):
    """(send counts, receive counts) in elements for all_to_all_single; None for a side split evenly."""
    size = comm.size

    def counts(t, splits, side):
        n = rows(t)   # (split by rows, as torch's backends do: not by elements, which would cut rows)
        if not splits:
            if n % size:
                raise NotDivisibleError(f"all_to_all_single: the {side} tensor's first dimension ({n}) is not "
                                        f"divisible by the group size {size}; pass {side}_split_sizes")
            return None
        if len(splits) != size:
            raise ValueError(f"all_to_all_single: {side}_split_sizes has {len(splits)} entries, needs {size}")
        row = t[0].numel() if t.dim() and t.shape[0] else 1
        if sum(splits) != n:
            raise ValueError(f"all_to_all_single: {side}_split_sizes add up to {sum(splits)} but the {side} "
                             f"tensor has {n} rows")
        return [s * row for s in splits]

    return counts(input, input_split_sizes, "input"), counts(output, output_split_sizes, "output")


class EngineProcessGroup(FaultTolerance, CollectiveHooks, dist.ProcessGroup):
    """A torch ProcessGroup over one engine.Communicator (and, for CUDA tensors, NCCL); abort and
    reconfigure: torchbridge/fault.py; torch's collective hooks: torchbridge/tracing.py. comm None: no
    members until the first reconfigure."""

    def __init__(self, comm, rank, size, timeout=None, store=None, name="default", listen=False, base_store=None,
                 world_key=None, world_rank=None):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._cuda = torch.cuda.is_available()  # False: no CUDA routing at all
        self._store, self._name, self._timeout = store, name, timeout
        self._cuda_transport = None
        self._init_fault_tolerance(listen, store if base_store is None else base_store, world_key, world_rank)
        self._init_call_hooks()
        if comm is None:
            self._detach(no_members_error(name))
        else:
            self._attach(comm)

    def _attach(self, comm):
        """Runs the group's calls on comm from now on."""
        self._comm = comm
        self._last_watch = comm.watch   # (kept past an abort: a recovery then retires its failures)
        progress = Progress(name=f"engine-progress-{self._name}", stall_seconds=self._timeout_seconds())
        self._cpu = CpuDevice(comm, progress)
        self._fast = _fastpath.FastPath(comm, progress, self._cuda)
        self._hooks_changed()   # (the new latency path learns whether hooks are set)
        self._devices = {}                       # CUDA device index -> CudaDevice / StagedDevice
        self._watchdog = None
        self._cuda_transport = None              # (decided again among the members it has now)
        comm.watch.on_break = self._abort_hooks_on_failure

    def _detach(self, error, abort=True):
        """Takes the communicator off the group; every later call raises `error` (None: this is a
        swap, the caller attaches another at once). With an error and abort, what is queued and running
        ends with it; without abort, what is queued still runs before the release frees the group.
        Returns (cpu device holding the communicator, or None without one; CUDA devices; watchdog) for _release."""
        comm = getattr(self, "_comm", None)
        cpu = self._cpu if comm is not None else None   # (without a communicator: the stand-in)
        devices, watchdog = list(getattr(self, "_devices", {}).values()), getattr(self, "_watchdog", None)
        if comm is not None:
            comm.watch.on_break = None   # (what is still queued on it fails the old group, not this one)
        if error is not None and abort and comm is not None:
            comm.abort()
            cpu.progress.abort(error)
        if comm is not None and devices:
            _end_cuda_side(self._name, comm, devices, watchdog, error if abort else None, error is None)
        stand_in = Unavailable(error or RuntimeError("process group is being reconfigured"), self._rank, self._size)
        self._comm = None
        self._cpu = stand_in
        self._fast = _fastpath.FastPath(stand_in, stand_in, self._cuda)
        self._hooks_changed()
        self._devices, self._watchdog = {}, None
        return cpu, devices, watchdog

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

    def _get_sequence_number_for_group(self):
        """How many collectives the group has run (Gloo's and NCCL's count, which torch's debugging
        tools compare across ranks); its CPU communicator's."""
        comm = self._comm
        return comm.core.seq if comm is not None and comm.core is not None else 0

    def _set_sequence_number_for_group(self):
        pass   # (every rank's count starts at 0 with the group: nothing to agree on)

    # -- the group as its own per-device backend --
    # torch keeps a C++ Backend per device for its own groups and reaches it with _get_backend(device)
    # (monitored_barrier, timeouts, splitting, eager init); a Backend can't be made in Python, and torch
    # uses a Python group as it is. So the group answers as its devices' backend itself: torch's Python
    # code that asks for the backend gets this group, and the Backend methods and properties it uses
    # next (monitored_barrier, supports_*) are here.

    supports_coalescing = False
    supports_time_estimate = _supports_time_estimate = False   # (torch 2.15 reads the second name)
    supports_window = False   # (torch 2.15's one-sided windows: NCCL's symmetric memory)

    def new_window(self, tensor=None):
        raise RuntimeError("backend 'engine' has no one-sided (RMA) windows (dist._supports_window() is False): "
                           "use point-to-point (isend/irecv) or a collective")

    def supports_tensor_alloc(self, device):  # a method on torch's Backend: FSDP2 calls it
        return False

    @property
    def options(self):
        """torch's Backend.options. Its split_group copies the parent's (copy.deepcopy) for a split given
        none; the engine reads its settings from the environment and takes none, so only the group's
        backend and timeout are here (set on a copy, as torch's splits do)."""
        timeout = self._timeout if self._timeout is not None else dist.default_pg_timeout
        return types.SimpleNamespace(backend="engine", _timeout=timeout)

    def get_group_store(self):
        """The store the group was made over (torch's own groups': its PrefixStore); None once shut down."""
        return self._store

    def _start_coalescing(self, device):
        # (torch marked the group as coalescing before this call: left so, its later calls would only queue)
        dist.distributed_c10d._world.pg_coalesce_state.pop(self, None)
        raise RuntimeError("backend 'engine' does not coalesce calls between _start_coalescing and _end_coalescing "
                           "(its supports_coalescing is False): call torch's _coalescing_manager without device=, "
                           "and torch gives the calls to the group's *_coalesced methods")

    _end_coalescing = _start_coalescing

    @property
    def _device_types(self):
        return [torch.device("cpu"), torch.device("cuda")] if self._cuda else [torch.device("cpu")]

    def _get_backend(self, device):
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        if kind == "cpu" or (kind == "cuda" and self._cuda):
            return self
        raise RuntimeError(f"No backend type associated with device type {kind}: backend 'engine' serves "
                           f"{' and '.join(d.type for d in self._device_types)} tensors")

    get_backend = _get_backend

    def eager_connect_single_device(self, device):
        """init_process_group(..., device_id=...) (and new_group's): torch binds the group to the device
        (bound_device_id, which DeviceMesh, split_group and barrier read) on a ProcessGroup it then drops
        for this one, and asks a backend that splits to connect on it now. The binding is kept here; the
        CUDA side is made at the group's first CUDA call, as without device_id."""
        self.bound_device_id = torch.device(device)

    @traced("monitored_barrier")
    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """Gloo's monitored barrier (engine.monitored_barrier), in the group's store: rank 0 waits at most
        `timeout` (default: the group's) and names the ranks that did not arrive. dist.monitored_barrier
        refuses every backend not named "gloo" (torch checks the name): call it on the group,
        `(group or dist.group.WORLD).monitored_barrier(timeout)`. An aborted group refuses it, as every call."""
        if self._comm is None:
            raise self._cpu.error   # (the stand-in's reason: aborted, or no members before a reconfigure)
        seq = self._monitored_seq = self._monitored_seq + 1
        if self.size() == 1:
            return
        if self._store is None:
            raise RuntimeError("monitored_barrier needs the group's store (a group torch created)")
        store = self._meeting_store(f"monitored barrier #{seq} of group {self._name!r}")
        comm = self._comm
        monitored_barrier(store, f"engine/monitored-barrier/{self._membership}{seq}/", self.rank(), self.size(),
                          in_seconds(timeout, self._timeout_seconds()), self._timeout_seconds(), wait_all_ranks,
                          f"monitored barrier #{seq} of group {self._name!r}",
                          aborted=lambda: None if self._comm is comm else self._cpu.error, lost=comm.lost_ranks)

    def _refused(self, kind, exc, args, kwargs, view):
        """A check of this adapter's refused a collective here (exc; kind: its name in torch's hooks,
        "ALLGATHER_BASE") before the communicator ran it: the refusal counts as the group's next call,
        as the core's own refusals do (CoreComm.refuse), for a peer whose checks passed went ahead and
        sent its part, which this rank's next call would take as its own. Not for a call on CUDA
        tensors over NCCL (its calls are not numbered; staged ones are the CPU core's), nor one the
        communicator ran or refused itself (the progress engine's mark), nor twice. Queued, in order
        after the calls queued before it, not waited for: the error is raised at once, as before."""
        if was_run(exc) or not isinstance(self._cpu, CpuDevice):
            return
        ran(exc)   # (counted once: an outer traced method meets it again)
        try:
            inputs, outputs, _, _ = view(*args, **kwargs)
            if any(isinstance(t, torch.Tensor) and t.is_cuda and not isinstance(self._devices.get(t.device.index),
                                                                                StagedDevice)
                   for t in (*inputs, *outputs)):
                return
        except Exception:   # (arguments too wrong to read: the call is refused on the CPU side)
            pass
        collective = next(k for k in _KINDS if kind.lower().startswith(k))
        try:
            self._cpu.progress.submit(self._cpu.comm.core.refuse, (collective, exc), collective)
        except Exception:   # (a group broken or shut down meanwhile: nothing to count)
            pass

    # -- which device communicator --

    def _device(self, t):
        if self._cuda and t.is_cuda:
            return self._cuda_device(t.device.index)
        return self._cpu

    def _cuda_device(self, index):
        dev = self._devices.get(index)
        if dev is None:
            comm = self._comm
            dev, watchdog = self._make_cuda_device(index)
            if self._comm is not comm:   # aborted or reconfigured while it was made: not this group's now
                error = getattr(self._cpu, "error", None) or RuntimeError(
                    f"process group {self._name!r} was reconfigured while its CUDA side was being set up: call again")
                dev.abort(error)
                if watchdog is not None and watchdog is not self._watchdog:
                    watchdog.abort(error)
                raise error
            self._devices[index], self._watchdog = dev, watchdog
        return dev

    def _make_cuda_device(self, index):
        """(the device communicator for CUDA device index, the group's watchdog or None): made at the
        group's first call on it, agreed among its members now over its CPU communicator."""
        from engine.config import cuda_transport
        if self._cuda_transport is None:
            forced = cuda_transport()
            self._cuda_transport = "staged" if forced == "staged" else self._nccl_or_staged(forced, index)
        if self._cuda_transport == "staged":
            return StagedDevice(self._cpu), self._watchdog
        from engine.cuda import load_cupy
        from engine.cuda.communicator import CudaCommunicator
        from engine.cuda.nccl import unique_id_over
        from engine.cuda.watchdog import Watchdog
        rank, size = self.rank(), self.size()
        uid = self._over_cpu(lambda comm: unique_id_over(comm, ready=load_cupy, group=self._name), "NCCL's unique id")
        seconds = self._timeout_seconds()   # as the CPU path: the group's, else ENGINE_TIMEOUT
        # (ncclCommInitRank waits for every rank: one that got the id and then failed or died would hold
        # the others there for good, before any watchdog exists)
        with torch.cuda.device(index), failure.blocked_in("NCCL", f"making group {self._name!r}'s NCCL "
                                                          "communicator (ncclCommInitRank)", rank, seconds):
            cc = CudaCommunicator(uid, rank, size, index)
        watchdog = self._watchdog
        if watchdog is None:
            watchdog = Watchdog(self._name, rank, size, seconds, on_fail=self._abort_hooks_on_failure)
        return CudaDevice(cc, index, watchdog, cpu_comm=self._comm), watchdog

    def _nccl_or_staged(self, forced, index):
        """nccl, unless ranks of the group share a GPU (staged); forced nccl is taken as it is. Every
        rank loads cupy first (without the extra: an ImportError naming it, and the others are told)."""
        import warnings
        from engine.bootstrap import host_identity
        from engine.cuda import load_cupy
        from engine.cuda.nccl import ranks_sharing_a_device

        def identity():
            load_cupy()
            return f"{host_identity()[0]}/{torch.cuda.get_device_properties(index).uuid}".encode()

        shared = self._over_cpu(lambda comm: ranks_sharing_a_device(comm, identity, self._name), "which GPU each rank uses")
        if forced == "nccl" or not shared:
            return "nccl"
        warnings.warn("backend 'engine': ranks of this group share a GPU, which NCCL refuses; CUDA tensors take "
                      "the host-staged path (ENGINE_CUDA_TRANSPORT=staged)", RuntimeWarning, stacklevel=4)
        return "staged"

    def _over_cpu(self, fn, what):
        """fn(the group's CPU communicator), in issue order with the group's CPU calls: how the CUDA side
        agrees on its setup, with whoever the members are now (a reconfigure's may share no store). A
        collective of every member, at the group's first call on a CUDA device, whatever that call is.
        An aborted group, or one without members yet, raises why."""
        comm = self._comm
        if comm is None:
            raise self._cpu.error   # (the stand-in's reason: aborted, or no members before a reconfigure)
        result = []
        try:
            self._cpu.progress.run(lambda: result.append(fn(comm)), nargs=0, name=f"cuda setup: {what}")
        except Exception as exc:
            raise RuntimeError(f"process group {self._name!r}: setting up its CUDA side ({what}, agreed by every "
                               f"member at the group's first call on a CUDA tensor) failed: {exc}") from exc
        return result[0]

    # -- reductions --

    @traced("all_reduce", first)
    def _allreduce(self, tensors, opts):
        t = _one(tensors, "allreduce")
        if t.layout != torch.strided:
            return self._sparse_allreduce(t, tensors, opts)
        dev = self._device(t)
        op, factor = _reduce_op(opts)
        t, = _real([t], opts, "allreduce")
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
        if not t.is_sparse:   # (CSR, CSC, BSR, whose is_contiguous() raises; mkldnn: sparse_sum sums COO)
            coo = "tensor.to_sparse_coo(), or " if t.layout in _COMPRESSED else ""
            raise RuntimeError(f"engine all_reduce of a {t.layout} tensor: it takes dense tensors, and sums sparse COO "
                               f"ones (ReduceOp.SUM, as on Gloo); pass {coo}tensor.to_dense()")
        op, factor = _reduce_op(opts)
        if op != ReduceOp.SUM or factor is not None:
            raise RuntimeError(f"engine all_reduce of a sparse tensor: only ReduceOp.SUM is supported (as Gloo), got "
                               f"{opts.reduceOp.op}; pass a dense tensor (tensor.to_dense()) for other ops")
        if t.is_cuda:
            raise RuntimeError("engine all_reduce of a sparse tensor: CUDA sparse tensors are not supported; move it "
                               "to the CPU (tensor.cpu()) or pass a dense tensor")
        return self._cpu.launch("allreduce", sparse_sum, t, self._cpu.comm, None, 2, tensors, opts)

    @traced("all_reduce_coalesced", first)
    def allreduce_coalesced(self, tensors, opts=None):
        """Fused: tensors packed into buckets (engine.fusion), one allreduce per bucket."""
        op, factor = _reduce_op(opts)
        if factor is not None:
            for t in tensors:
                _check_premul(t)
        seconds = own_timeout(opts, "allreduce_coalesced")
        if not tensors:   # (its options, as a barrier's)
            barrier = None if opts is None else dist.BarrierOptions()
            if barrier is not None:
                barrier.timeout, barrier.asyncOp = opts.timeout, opts.asyncOp
            return self._barrier(barrier)
        sync = opts is not None and not opts.asyncOp
        reals = _real(tensors, opts, "allreduce_coalesced", written=len(tensors))
        return self._device(tensors[0]).fused(reals, op, None, 1.0 if factor is None else factor,
                                              "allreduce_coalesced", sync, seconds)

    @traced("fused_allreduce", first)
    def fused_allreduce_async(self, tensors, op=ReduceOp.SUM, *, compression=None, name="fused_allreduce"):
        """Queues a fused allreduce of tensors (in place) and returns its Work at once: the buckets of
        DistributedOptimizer and the DDP comm hooks."""
        if not tensors:
            return self._cpu.launch(name, lambda: None, None, None, None, 0, [], None)
        return self._device(tensors[0]).fused(tensors, op, compression, 1.0, name)

    @traced("reduce", first)
    def _reduce(self, tensors, opts):
        t = _one(tensors, "reduce")
        _check_root_tensor(opts, "reduce")
        dev = self._device(t)
        op, factor = _reduce_op(opts)
        t, = _real([t], opts, "reduce")
        root, comm = opts.rootRank, dev.comm

        def run():
            src = _source(t, factor)
            if self.rank() == root:
                _write(t, lambda buf: comm.reduce(src, buf if src is not buf else None, op, root))
            else:
                comm.reduce(src, None, op, root)

        return dev.launch("reduce", run, None, None, None, 0, tensors, opts)

    @other_forms("reduce_scatter")
    @traced("reduce_scatter", root_inputs)
    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        dev = self._device(out)
        op, factor = _reduce_op(opts)
        _check_per_rank(inputs, self.size(), out.dtype, "reduce_scatter", "input")
        _check_block("reduce_scatter", inputs, self.rank(), "input", out, "output")
        out, *inputs = _real([out, *inputs], opts, "reduce_scatter")
        comm = dev.comm

        def run():
            flat = _source(_flat(inputs, out), factor)
            _write(out, lambda buf: comm.reduce_scatter(flat, buf, op, uneven([i.numel() for i in inputs])))

        return dev.launch("reduce_scatter", run, None, None, None, 0, output_tensors, opts)

    def _reduce_scatter_single(self, output, input, opts=None):
        _check_pair("reduce_scatter_tensor", output, input, False, self.size())
        dev = self._device(output)
        op, factor = _reduce_op(opts)
        out, real_input = _real([output, input], opts, "reduce_scatter_tensor")
        comm = dev.comm

        def run():
            src = _source(real_input, factor)
            _write(out, lambda buf: comm.reduce_scatter(src, buf, op))

        return dev.launch("reduce_scatter_tensor", run, None, None, None, 0, [output], opts)

    _reduce_scatter_tensor = traced("reduce_scatter_tensor", second_one)(_reduce_scatter_single)

    reduce_scatter_single_coalesced = _coalesced(_reduce_scatter_single, "reduce_scatter_tensor_coalesced", False)
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --

    @traced("broadcast", first)
    def _broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        _check_root_tensor(opts, "broadcast")
        dev = self._device(t)
        if is_contiguous(t):
            return dev.launch("broadcast", dev.comm.broadcast, t, opts.rootRank, None, 2, tensors, opts)
        comm, root = dev.comm, opts.rootRank
        return dev.launch("broadcast", _write, t, lambda buf: comm.broadcast(buf, root), None, 2, tensors, opts)

    def _allgather(self, output_lists, input_tensors, opts=None):
        outs = _one(output_lists, "allgather")
        inp = _one(input_tensors, "allgather")
        _check_per_rank(outs, self.size(), inp.dtype, "all_gather", "output")
        _check_block("all_gather", outs, self.rank(), "output", inp, "input")
        dev = self._device(inp)
        comm = dev.comm

        def run():
            counts = [o.numel() for o in outs]
            flat = inp.new_empty(sum(counts))
            comm.allgather(contiguous(inp), flat, uneven(counts))
            _scatter_back(flat, outs)

        return dev.launch("allgather", run, None, None, None, 0, outs, opts)   # (its Work's result: Gloo's)

    allgather = other_forms("allgather")(traced("all_gather", second)(_allgather))

    def _all_gather_single(self, output, input, opts=None):
        _check_pair("all_gather_into_tensor", output, input, True, self.size())
        dev = self._device(input)
        comm = dev.comm
        return dev.launch("all_gather_into_tensor", _write, output,
                          lambda buf: comm.allgather(contiguous(input), buf), None, 2, [output], opts)

    _all_gather_into_tensor = traced("all_gather_into_tensor", second_one)(_all_gather_single)

    all_gather_single_coalesced = _coalesced(_all_gather_single, "all_gather_into_tensor_coalesced", True)
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @traced("all_gather_coalesced", second)
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][j] receives rank r's input_list[j]: one allgather per input, every one checked
        before any is queued, one Work for them all."""
        size, rank = self.size(), self.rank()
        if len(output_lists) != size:
            raise ValueError(f"all_gather_coalesced needs one output list per rank ({size}), got {len(output_lists)}")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise ValueError(f"all_gather_coalesced: the output list of rank {r} has {len(outs)} tensors; it "
                                 f"needs one per input ({len(input_list)})")
        for j, inp in enumerate(input_list):
            _check_dtypes([outs[j] for outs in output_lists], inp.dtype, "all_gather_coalesced")
            if output_lists[rank][j].numel() != inp.numel():
                raise ValueError(f"all_gather_coalesced: invalid size of output tensor at index {j}: this rank's "
                                 f"has {output_lists[rank][j].numel()} elements; its input has {inp.numel()}")
        works = [self._allgather([[outs[j] for outs in output_lists]], [inp], opts) for j, inp in enumerate(input_list)]
        # (its future's value as Gloo's: the output lists, nested; a group of one's one list)
        return all_of(works, [t for outs in output_lists for t in outs],
                      output_lists if size > 1 else None) if works else self._barrier()

    @other_forms("gather")
    @traced("gather", second)
    def gather(self, output_lists, input_tensors, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        inp = _one(input_tensors, "gather")
        dev = self._device(inp)
        root, comm = opts.rootRank, dev.comm
        outs = _one_list(output_lists, "gather", "output", root, self.rank())
        if self.rank() == root:
            _check_per_rank(outs, self.size(), inp.dtype, "gather", "output", " on the root")
            _check_block("gather", outs, root, "output", inp, "input")

        def run():
            if self.rank() != root:
                comm.gather(contiguous(inp), None, root)
                return
            counts = [o.numel() for o in outs]
            flat = inp.new_empty(sum(counts))
            comm.gather(contiguous(inp), flat, root, uneven(counts))
            _scatter_back(flat, outs)

        return dev.launch("gather", run, None, None, None, 0, outs, opts)

    @traced("gather_single", second_one)
    def gather_single(self, output, input, opts=None):
        """torch 2.15's dist.gather_single (gather_into_tensor): every rank's input, in rank order, into
        one tensor on the root (the others pass an empty one; the core checks the root's size and dtype)."""
        opts = opts if opts is not None else dist.GatherOptions()
        dev = self._device(input)
        root, comm = opts.rootRank, dev.comm
        if self.rank() != root:
            return dev.launch("gather", lambda: comm.gather(contiguous(input), None, root), None, None, None, 0,
                              [output], opts)
        return dev.launch("gather", _write, output, lambda buf: comm.gather(contiguous(input), buf, root), None, 2,
                          [output], opts)

    gather_into_tensor = gather_single

    @other_forms("scatter")
    @traced("scatter", root_inputs)
    def scatter(self, output_tensors, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        out = _one(output_tensors, "scatter")
        dev = self._device(out)
        root, comm = opts.rootRank, dev.comm
        inputs = _one_list(input_lists, "scatter", "input", root, self.rank())
        if self.rank() == root:
            _check_per_rank(inputs, self.size(), out.dtype, "scatter", "input", " on the root")
            _check_block("scatter", inputs, root, "input", out, "output")

        def run():
            if self.rank() == root:
                flat = _flat(inputs, out)
                _write(out, lambda buf: comm.scatter(flat, buf, root, uneven([i.numel() for i in inputs])))
            else:
                _write(out, lambda buf: comm.scatter(None, buf, root))

        return dev.launch("scatter", run, None, None, None, 0, output_tensors, opts)

    @other_forms("alltoall")
    @traced("all_to_all", second)
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

    @traced("all_to_all_single", second_one)
    def _alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        send_counts, recv_counts = all_to_all_counts(self._comm or self._cpu, output, input, output_split_sizes,
                                                     input_split_sizes)
        dev = self._device(input)
        comm = dev.comm
        return dev.launch("alltoall_base", _write, output,
                          lambda buf: comm.alltoall(contiguous(input), buf, send_counts, recv_counts), None, 2,
                          [output], opts)

    def _barrier(self, opts=None):
        # The ranks meet on the host: no CUDA device is involved (torch's own NCCL barrier would allreduce
        # on the GPU); CUDA work already enqueued keeps its own order. Sends and receives a CUDA device
        # deferred are posted first: a peer may wait on one (its recv, then .item()) before it comes.
        for dev in list(self._devices.values()):
            flush = getattr(dev, "flush", None)
            if flush is not None:
                flush()
        return self._cpu.launch("barrier", getattr(self._comm, "barrier", None), None, None, None, 0, [], opts)

    _traced_barrier = traced("barrier")(_barrier)

    # -- point to point: posted now, never queued behind collectives --

    @traced("send", first)
    def _send(self, tensors, dst, tag):
        t = _one(tensors, "send")
        return self._device(t).send(t, dst, tag, tensors)

    @traced("recv", first)
    def _recv(self, tensors, src, tag):
        t = _one(tensors, "recv")
        return self._device(t).recv(t, src, _nonnegative(tag), tensors)

    @traced("recvAnySource", first)
    def _recv_anysource(self, tensors, tag):
        t = _one(tensors, "recv")
        return self._device(t).recv(t, None, _nonnegative(tag), tensors)

    # -- lifetime --

    def shutdown(self):
        """destroy_process_group: what is queued runs, then the group's memory, descriptors and threads go.
        The store goes too: a destroyed group a caller still holds must not keep torch's store (its
        sockets, and rank 0's server thread) alive."""
        why = f"process group {self._name!r} was shut down (destroy_process_group)"
        with self._swapping:   # (a reconfigure or a shrink in flight ends, and does not bring the group back)
            self._end_remaking(why)
            self._close_listener()
            self._store = None
            old = self._detach(RuntimeError(f"{why}; create a new one"), abort=False) if self._comm is not None else None
        if old is not None:
            self._release(*old)


# The latency path's fast forms (torchbridge/_fastpath.pyx), falling back to the general forms here.
for _name, _method in _fastpath.methods().items():
    setattr(EngineProcessGroup, _name, _method)
