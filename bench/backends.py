"""What each backend runs for one (collective, mode, count): a Case with run() (timed) and check()
(fresh data, one run, wrong elements against a reference every rank computes itself).

Backends (None from case() means "not applicable"):
- engine: torch.distributed on backend engine (the transport the group chose: shm on one host, TCP or
  MPI between hosts);
- engine-async: the same, each call asynchronous, then waited on;
- engine-group: the same on an engine group of every rank made by dist.new_group, as nop's and gloo's
  are: torch's own share of a call on the default group is larger (it looks the default group up again
  on every call, even when passed it), so this is the call to set beside nop;
- engine-interhost-tcp, engine-interhost-mpi: torch.distributed on engine groups made with
  ENGINE_INTERHOST=tcp / mpi (what carries bytes between hosts under mpirun), side by side in one run;
- engine-direct: the default group's engine.Communicator, driven directly: the engine without torch;
- engine-shm, engine-mpi, engine-tcp: an engine.Communicator forced onto shared memory / MPI / TCP,
  driven directly;
- gloo: torch.distributed on a Gloo group in the same job;
- mpi4py: raw mpi4py on numpy views of torch tensors (MPI launches only);
- nop: torch.distributed on a do-nothing Python process group: torch's own share of each call;
- nop+direct: each call is nop's then engine-direct's, back to back: what the torch call would cost if
  the adapter added nothing, timed in the same loop (a collective's ranks wait for the slowest one, so
  the jitter of torch's own share adds to a synchronizing call what nop alone, which never waits, hides);
- direct-group: torch.distributed on a Python group whose methods make engine-direct's call and nothing
  more: the torch call with an adapter that costs nothing, its wait inside torch's call as any backend's
  is (a pingpong's critical path holds torch's return from recv, which nop+direct runs before its wait);
- deepspeed-shm: DeepSpeed's CPU shared-memory allreduce (torch.ops.deepspeed.inference_all_reduce_),
  where deepspeed is installed and its op really loaded (all_reduce SUM of bfloat16/float16/float32 only);
- nccl: torch's nccl backend (CUDA machines only).
Every buffer comes from torch's allocator (numpy gives its own large arrays huge pages; torch doesn't).
"""

import types

import torch
import torch.distributed as dist

BACKENDS = ("engine", "engine-async", "engine-group", "engine-interhost-tcp", "engine-interhost-mpi", "engine-direct",
            "engine-shm", "engine-mpi", "engine-tcp", "gloo", "mpi4py", "nop", "nop+direct", "direct-group", "nccl",
            "deepspeed-shm")
CUDA_BACKENDS = ("engine", "nccl", "gloo")  # what runs on CUDA tensors (--device cuda)
# What can take --algo (the engine's allreduce entry), per device: on the CPU the direct calls, which pass it
# per call; on CUDA the engine's group, made under ENGINE_CUDA_ALLREDUCE_ALGO. The rest never see it.
ALGO_BACKENDS = {"cpu": ("engine-direct", "engine-shm", "engine-mpi", "engine-tcp", "nop+direct", "direct-group"),
                 "cuda": ("engine",)}
DTYPES = {"float": torch.float32, "float32": torch.float32, "half": torch.float16, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "double": torch.float64, "float64": torch.float64, "int32": torch.int32,
          "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8}
OPS = ("sum", "prod", "min", "max", "avg")
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
              "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def data(rank, count, dtype):
    """Small positive integers: sums, products (of few ranks) and averages stay exact or near it."""
    return ((torch.arange(count, dtype=torch.int64) + rank) % 4 + 1).to(dtype)


def reduce_ref(op, arrays, dtype):
    acc = torch.stack([a.to(torch.float64) for a in arrays])
    out = {"sum": lambda: acc.sum(0), "prod": lambda: acc.prod(0), "min": lambda: acc.min(0).values,
           "max": lambda: acc.max(0).values, "avg": lambda: acc.sum(0) / len(arrays)}[op]()
    return out.to(dtype)


def count_wrong(got, want):
    got, want = got.reshape(-1).cpu(), want.reshape(-1).cpu()
    if got.dtype.is_floating_point:
        tol = _TOL[got.dtype]
        bad = (got.double() - want.double()).abs() > tol * want.double().abs().clamp(min=1) * 4
    else:
        bad = got != want
    return int(bad.sum())


class Case:
    """idle: this rank only waits out the others' calls (pingpong's unpaired rank): its time is no one's."""

    def __init__(self, run, reset, result, expected, idle=False):
        self.run, self._reset, self._result, self._expected, self.idle = run, reset, result, expected, idle

    def check(self):
        self._reset()
        self.run()
        got = self._result()
        return 0 if got is None else count_wrong(got, self._expected)

    def after(self, first):
        """This case with first() run before each of its calls (its results are still this case's)."""
        run = self.run

        def both():
            first()
            run()
        return Case(both, self._reset, self._result, self._expected, self.idle)


class Problem:
    """The buffers' contents and reference result for one collective on this rank."""

    def __init__(self, coll, count, dtype, op, root, rank, size):
        self.coll, self.count, self.dtype, self.op, self.root, self.rank, self.size = \
            coll, count, dtype, op, root, rank, size
        self._buffers = {}
        n, r = size, rank
        if coll == "all_reduce":
            self.input = data(r, count, dtype)
            self.expected = reduce_ref(op, [data(q, count, dtype) for q in range(n)], dtype)
        elif coll == "broadcast":
            self.input = data(r, count, dtype)
            self.expected = data(root, count, dtype)
        elif coll == "reduce":
            self.input = data(r, count, dtype)
            self.expected = reduce_ref(op, [data(q, count, dtype) for q in range(n)], dtype) if r == root else None
        elif coll == "all_gather":
            self.input = data(r, count, dtype)
            self.expected = torch.cat([data(q, count, dtype) for q in range(n)])
        elif coll == "reduce_scatter":
            block = count // n
            self.input = data(r, count, dtype)
            self.expected = reduce_ref(op, [data(q, count, dtype) for q in range(n)], dtype)[r * block:(r + 1) * block]
        elif coll == "alltoall":
            block = count // n
            self.input = data(r * 7, count, dtype)
            self.expected = torch.cat([data(q * 7, count, dtype)[r * block:(r + 1) * block] for q in range(n)])
        elif coll == "sendrecv":
            self.input = data(r, count, dtype)
            self.expected = data((r - 1) % n, count, dtype)
        elif coll == "pingpong":
            self.peer = r ^ 1 if (r ^ 1) < n else None
            self.input = data(r, count, dtype)
            self.expected = data(self.peer, count, dtype) if self.peer is not None else None
        else:  # barrier
            self.input, self.expected = torch.empty(0, dtype=dtype), None

    def buffers(self, device="cpu"):
        """(input, source, output) tensors, made once per device and shared by every backend: each
        backend then runs on the same memory, so placement (pages, cache, alignment) favours none of
        them. Checks run one case at a time, each resetting the input first."""
        made = self._buffers.get(device)
        if made is None:
            made = self._buffers[device] = (self.input.to(device, copy=True), self.input.to(device, copy=True),
                                            torch.empty(self.out_count(), dtype=self.dtype, device=device))
        return made

    def out_count(self):
        return {"all_gather": self.count * self.size, "reduce_scatter": self.count // self.size}.get(
            self.coll, self.count)


def _waited(fn):
    def call(*args, **kwargs):
        fn(*args, async_op=True, **kwargs).wait()
    return call


# all_gather_into_tensor and reduce_scatter_tensor under the names torch 2.13 gives them (and FSDP2
# calls): the old ones warn on every call.
_SYNC = types.SimpleNamespace(
    barrier=dist.barrier, all_to_all_single=dist.all_to_all_single, all_reduce=dist.all_reduce,
    broadcast=dist.broadcast, reduce=dist.reduce,
    all_gather_into_tensor=getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
    reduce_scatter_tensor=getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor))
# torch.distributed's collectives with async_op=True, then wait(): the cost of Work and futures.
_WAITED = types.SimpleNamespace(**{name: _waited(fn) for name, fn in vars(_SYNC).items()})


class TorchDistBackend:
    """torch.distributed on one group: engine (default group), Gloo, or NCCL (CUDA tensors).
    algorithm: the allreduce entry its group is made to use (engine on CUDA: ENGINE_CUDA_ALLREDUCE_ALGO)."""

    algorithm = None

    def __init__(self, name, group=None, device="cpu", asynchronous=False):
        self.name, self.group, self.device, self.asynchronous = name, group, device, asynchronous

    def case(self, p, mode):
        g, dev, op = self.group, self.device, _TORCH_OPS.get(p.op)
        d = _WAITED if self.asynchronous else _SYNC  # the synchronous calls stay torch's own, unwrapped
        inp, src, out = p.buffers(dev)

        def reset():
            inp.copy_(src)

        c = p.coll
        if c == "barrier":
            return None if mode == "in-place" else Case(lambda: d.barrier(group=g), lambda: None,
                                                        lambda: None, None)
        if mode == "out-of-place":
            if c == "all_gather":
                return Case(lambda: d.all_gather_into_tensor(out, inp, group=g), reset, lambda: out,
                            p.expected)
            if c == "reduce_scatter":
                return Case(lambda: d.reduce_scatter_tensor(out, inp, op=op, group=g), reset, lambda: out,
                            p.expected)
            if c == "alltoall":
                return Case(lambda: d.all_to_all_single(out, inp, group=g), reset, lambda: out, p.expected)
            if c == "sendrecv":
                return Case(lambda: self._sendrecv(out, inp), reset, lambda: out, p.expected)
            if c == "pingpong":
                if self.asynchronous:
                    send = lambda t, dst, group: dist.isend(t, dst, group=group).wait()
                    recv = lambda t, src, group: dist.irecv(t, src, group=group).wait()
                else:
                    send, recv = dist.send, dist.recv
                return _pingpong(p, lambda: send(inp, self._global(p.peer), group=g),
                                 lambda: recv(out, self._global(p.peer), group=g), out)
            return None  # all_reduce, broadcast, reduce exist in place only in torch
        if c == "all_reduce":
            return Case(lambda: d.all_reduce(inp, op=op, group=g), reset, lambda: inp, p.expected)
        if c == "broadcast":
            return Case(lambda: d.broadcast(inp, self._global(p.root), group=g), reset, lambda: inp,
                        p.expected)
        if c == "reduce":
            return Case(lambda: d.reduce(inp, self._global(p.root), op=op, group=g), reset,
                        lambda: inp if p.expected is not None else None, p.expected)
        return None

    def _global(self, rank):
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _sendrecv(self, out, inp):
        n, r = dist.get_world_size(), dist.get_rank()
        if n == 1:
            out.copy_(inp)
            return
        ops = [dist.P2POp(dist.isend, inp, (r + 1) % n, self.group), dist.P2POp(dist.irecv, out, (r - 1) % n, self.group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _pingpong(p, send, recv, out):
    """The pingpong Case from a backend's blocking send() and recv() of the Problem's buffers: rank 2k
    sends first, 2k+1 receives first; an unpaired last rank idles."""
    def reset():
        out.zero_()

    if p.size < 2:
        return None  # no pair: every rank would idle
    if p.peer is None:
        return Case(lambda: None, reset, lambda: None, None, idle=True)
    if p.rank % 2 == 0:
        def run():
            send()
            recv()
    else:
        def run():
            recv()
            send()
    return Case(run, reset, lambda: out, p.expected)


class EngineDirectBackend:
    """engine.Communicator driven directly on torch CPU tensors: the engine without the torch layer.
    transport None: the default group's own communicator; 'shm' / 'mpi' / 'tcp': a new one on that transport."""

    def __init__(self, name, transport=None, algorithm=None):
        import engine
        from engine.launcher import detect_launcher
        self.name = name
        default = dist.distributed_c10d._get_default_group().communicator
        if transport is None:
            self.comm = default
        elif transport == "mpi":
            if detect_launcher() is None:
                raise SystemExit("backend engine-mpi needs an MPI launch (mpirun); drop it from --backends")
            self.comm = engine.Communicator(transport="mpi", name="bench-mpi")
        elif transport == "tcp":
            if default.transport == "tcp":
                self.comm = default
            elif detect_launcher() is not None:
                self.comm = engine.Communicator(transport="tcp", name="bench-tcp")
            else:
                self.comm = engine.Communicator.from_store(dist.distributed_c10d._get_default_store(), dist.get_rank(),
                                                           dist.get_world_size(), prefix="engine/bench-tcp",
                                                           transport="tcp", name="bench-tcp")
        else:
            default = dist.distributed_c10d._get_default_group().communicator
            self.comm = default if default.transport == "shm" else engine.Communicator(transport="shm",
                                                                                      name="bench-shm")
        if algorithm is not None and algorithm not in self.comm.core.algorithms:
            raise SystemExit(f"--algo {algorithm}: backend {name}'s group ({self.comm.transport}) has no allreduce "
                             f"entry {algorithm!r}, only {', '.join(self.comm.core.algorithms)}; drop {name} from "
                             f"--backends or choose one of those")
        self.algorithm = algorithm

    def case(self, p, mode):
        comm, c, op = self.comm, p.coll, p.op.replace("prod", "product")
        inp, src, out = p.buffers()
        inplace = mode == "in-place"
        n, r = p.size, p.rank

        def reset():
            inp.copy_(src)

        if c == "barrier":
            return None if inplace else Case(comm.barrier, lambda: None, lambda: None, None)
        if c == "all_reduce":
            if inplace:
                return Case(lambda: comm.allreduce(inp, op=op, algorithm=self.algorithm), reset, lambda: inp, p.expected)
            return Case(lambda: comm.allreduce(inp, out, op, algorithm=self.algorithm), reset, lambda: out, p.expected)
        if c == "broadcast":
            return Case(lambda: comm.broadcast(inp, p.root), reset, lambda: inp, p.expected) if inplace else None
        if c == "reduce":
            res = (lambda: (inp if inplace else out) if r == p.root else None)
            return Case(lambda: comm.reduce(inp, None if inplace or r != p.root else out, op, p.root), reset, res,
                        p.expected)
        if c == "all_gather":
            if inplace:
                whole = torch.empty(p.count * n, dtype=p.dtype)
                mine = whole[r * p.count:(r + 1) * p.count]
                return Case(lambda: comm.allgather(mine, whole), lambda: mine.copy_(src), lambda: whole, p.expected)
            return Case(lambda: comm.allgather(inp, out), reset, lambda: out, p.expected)
        if c == "reduce_scatter":
            return None if inplace else Case(lambda: comm.reduce_scatter(inp, out, op), reset, lambda: out, p.expected)
        if c == "alltoall":
            return None if inplace else Case(lambda: comm.alltoall(inp, out), reset, lambda: out, p.expected)
        if c == "sendrecv":
            if inplace:
                return None

            return Case(lambda: comm.sendrecv(inp, (r + 1) % n, out, (r - 1) % n, 0, 0), reset, lambda: out,
                        p.expected)
        if c == "pingpong":
            return None if inplace else _pingpong(p, lambda: comm.send(inp, p.peer, 0), lambda: comm.recv(out, p.peer, 0),
                                                  out)
        return None


class DirectGroupBackend:
    """torch.distributed on a direct group (bench.nop) made for each case: its collective runs
    engine-direct's call of the same case, its send/recv engine-direct's communicator's."""

    name = "direct-group"

    def __init__(self, direct):
        self.direct, self.algorithm = direct, direct.algorithm

    def case(self, p, mode):
        from .nop import direct_group
        if p.coll == "sendrecv":
            return None  # batch_isend_irecv needs sends that don't block: the direct group's do
        direct = self.direct.case(p, mode)
        if direct is None or TorchDistBackend(self.name).case(p, mode) is None:
            return None  # (asked before making a group, which every rank does together)
        return TorchDistBackend(self.name, direct_group(self.direct.comm, direct.run)).case(p, mode)


class BackToBackBackend:
    """Each call is first's then second's, back to back; second's results are checked."""

    def __init__(self, name, first, second):
        self.name, self.first, self.second = name, first, second
        self.algorithm = getattr(second, "algorithm", None)

    def case(self, p, mode):
        a, b = self.first.case(p, mode), self.second.case(p, mode)
        return None if a is None or b is None else b.after(a.run)


class Mpi4pyBackend:
    """Raw mpi4py (Comm.Allreduce and friends) on numpy views of the same data."""

    name = "mpi4py"

    def __init__(self):
        from engine.launcher import detect_launcher
        if detect_launcher() is None:
            raise SystemExit("backend mpi4py needs an MPI launch (mpirun); drop it from --backends")
        from engine import mpi
        MPI = mpi.load()
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD

    def case(self, p, mode):
        MPI, comm, c = self.MPI, self.comm, p.coll
        if p.dtype == torch.bfloat16 or (p.dtype == torch.float16 and c in ("all_reduce", "reduce", "reduce_scatter")):
            return None  # MPI has no (b)float16 arithmetic
        mop = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX, "avg": None}.get(p.op)
        if c in ("all_reduce", "reduce", "reduce_scatter") and mop is None:
            return None  # MPI has no AVG
        inp_t, src_t, out_t = p.buffers()
        inp, out, src = inp_t.numpy(), out_t.numpy(), src_t.numpy()
        inplace = mode == "in-place"
        n, r = p.size, p.rank

        def reset():
            inp[...] = src

        if c == "barrier":
            return None if inplace else Case(comm.Barrier, lambda: None, lambda: None, None)
        if c == "all_reduce":
            if inplace:
                return Case(lambda: comm.Allreduce(MPI.IN_PLACE, inp, mop), reset, lambda: inp_t, p.expected)
            return Case(lambda: comm.Allreduce(inp, out, mop), reset, lambda: out_t, p.expected)
        if c == "broadcast":
            return Case(lambda: comm.Bcast(inp, p.root), reset, lambda: inp_t, p.expected) if inplace else None
        if c == "reduce":
            if inplace:
                run = lambda: comm.Reduce(MPI.IN_PLACE if r == p.root else inp, inp if r == p.root else None, mop, p.root)
                return Case(run, reset, lambda: inp_t if r == p.root else None, p.expected)
            return Case(lambda: comm.Reduce(inp, out, mop, p.root), reset, lambda: out_t if r == p.root else None,
                        p.expected)
        if c == "all_gather":
            return None if inplace else Case(lambda: comm.Allgather(inp, out), reset, lambda: out_t, p.expected)
        if c == "reduce_scatter":
            return None if inplace else Case(lambda: comm.Reduce_scatter_block(inp, out, mop), reset, lambda: out_t,
                                             p.expected)
        if c == "alltoall":
            return None if inplace else Case(lambda: comm.Alltoall(inp, out), reset, lambda: out_t, p.expected)
        if c == "sendrecv":
            if inplace:
                return None
            return Case(lambda: comm.Sendrecv(inp, (r + 1) % n, 0, out, (r - 1) % n, 0), reset, lambda: out_t,
                        p.expected)
        if c == "pingpong":
            return None if inplace else _pingpong(p, lambda: comm.Send(inp, p.peer, 0), lambda: comm.Recv(out, p.peer, 0),
                                                  out_t)
        return None


class DeepSpeedShmBackend:
    """DeepSpeed's CPU shared-memory allreduce, torch.ops.deepspeed.inference_all_reduce_, as DeepSpeed
    builds it (ShareMemCommBuilder, what deepspeed.init_distributed does on a CPU accelerator) and as
    SGLang and DeepSpeed's CPU inference call it: SUM over the whole world, bfloat16/float16/float32.

    DeepSpeed falls back to torch.distributed silently where its op can't run (LOCAL_SIZE unequal to the
    world size, a CPU without the ISA its kernels need), so nothing is assumed: this sets LOCAL_SIZE,
    checks that every rank is on this host, that the op is registered, which dtypes this CPU's kernels
    run (vector_kernel_level: AVX2 for float32, AVX-512BW for bfloat16/float16), and that a probe
    allreduce really sums across ranks. DeepSpeed leaves its segments in /dev/shm; once every rank has
    mapped them, each rank unlinks its own, so none outlive the run."""

    name = "deepspeed-shm"
    # vector_kernel_level() each dtype needs (DeepSpeed's own rule, deepspeed/comm/torch.py)
    LEVELS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}

    def __init__(self, control):
        import os
        import socket
        rank, size = dist.get_rank(), dist.get_world_size()
        hosts = [None] * size
        dist.all_gather_object(hosts, socket.gethostname(), group=control)
        if len(set(hosts)) != 1:
            raise SystemExit("backend deepspeed-shm runs only when every rank is on one host "
                             f"(DeepSpeed's shm allreduce); these ranks are on {sorted(set(hosts))}")
        if os.environ.setdefault("DS_ACCELERATOR", "cpu") != "cpu":
            raise SystemExit(f"backend deepspeed-shm needs DS_ACCELERATOR=cpu, not {os.environ['DS_ACCELERATOR']!r}")
        os.environ["LOCAL_SIZE"] = str(size)   # DeepSpeed uses shm only where LOCAL_SIZE equals the world size
        # Its kernels are OpenMP loops: one thread per rank's share of the cores, as torchrun sets it
        # (under mpirun nothing does, and every rank would start a thread per core).
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))
        try:
            import deepspeed  # noqa: F401
            from deepspeed.accelerator import get_accelerator
        except ImportError as exc:
            raise SystemExit(f"backend deepspeed-shm needs deepspeed ({exc}): pip install deepspeed, with a "
                             "constraints file pinning this torch so pip keeps it") from None
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not builder.is_compatible():
            raise SystemExit("backend deepspeed-shm: DeepSpeed's ShareMemCommBuilder is not available here")
        if rank == 0:
            print("# deepspeed-shm: loading DeepSpeed's shm op (built on first use: minutes)", flush=True)
        module = builder.load(verbose=False)
        module.initialize(size, rank)
        self.level = module.vector_kernel_level()
        self.op = getattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_", None)
        dist.barrier(group=control)  # every rank has mapped every rank's segment: the names can go
        name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
               f"{os.environ.get('MASTER_PORT', '')}_{rank}"
        if os.path.exists(name):
            os.unlink(name)
        if self.op is None:
            raise SystemExit("backend deepspeed-shm: torch.ops.deepspeed.inference_all_reduce_ is not registered")
        if self.level < 1:
            raise SystemExit("backend deepspeed-shm: DeepSpeed's shm kernels need AVX2 at least; this CPU lacks it")
        probe = torch.full((4099,), float(rank + 1))
        self.op(probe)
        ok = torch.tensor([float(bool(torch.all(probe == size * (size + 1) / 2)))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=control)
        if ok.item() != 1.0:
            raise SystemExit("backend deepspeed-shm: DeepSpeed's op ran but did not sum across ranks")
        skipped = [str(d).replace("torch.", "") for d, need in self.LEVELS.items() if self.level < need]
        if skipped and rank == 0:
            print(f"# deepspeed-shm: DeepSpeed's {'/'.join(skipped)} kernels need AVX-512BW, which this CPU lacks: "
                  "not measured in those dtypes", flush=True)

    def case(self, p, mode):
        if p.coll != "all_reduce" or mode != "in-place" or p.op != "sum" or self.level < self.LEVELS.get(p.dtype, 99):
            return None
        inp, src, _ = p.buffers()
        op = self.op
        return Case(lambda: op(inp), lambda: inp.copy_(src), lambda: inp, p.expected)


def _engine_group(**env):
    """A torch group on backend engine made under these ENGINE_* settings (collective over every rank)."""
    import os
    from engine.launcher import detect_launcher
    if "ENGINE_INTERHOST" in env and detect_launcher() is None:
        raise SystemExit("backends engine-interhost-* compare what carries bytes between hosts under mpirun; "
                         "drop them from --backends (without MPI, hosts talk over TCP)")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return dist.new_group(backend="engine")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_backends(names, algorithm=None, device="cpu", control=None):
    """Backend objects for names, in order; creates the groups they need (collective over all ranks).
    control: a Gloo group for the backends' own agreements (deepspeed-shm)."""
    made = []
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA machine (torch.cuda.is_available() is False)")
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    for name in names:
        if name == "engine":
            made.append(TorchDistBackend("engine", device=device))
            if device == "cuda":
                made[-1].algorithm = algorithm  # (the sweep set ENGINE_CUDA_ALLREDUCE_ALGO before making the group)
        elif name == "engine-async":
            made.append(TorchDistBackend("engine-async", device=device, asynchronous=True))
        elif name == "engine-group":
            made.append(TorchDistBackend(name, dist.new_group(backend="engine"), device=device))
        elif name == "engine-direct":
            made.append(EngineDirectBackend(name, None, algorithm))
        elif name in ("engine-interhost-tcp", "engine-interhost-mpi"):
            made.append(TorchDistBackend(name, _engine_group(ENGINE_INTERHOST=name.rsplit("-", 1)[1]), device=device))
        elif name in ("engine-shm", "engine-mpi", "engine-tcp"):
            made.append(EngineDirectBackend(name, name.split("-")[1], algorithm))
        elif name == "nop":
            from .nop import nop_group
            made.append(TorchDistBackend("nop", nop_group()))
        elif name == "nop+direct":
            from .nop import nop_group
            made.append(BackToBackBackend(name, TorchDistBackend("nop", nop_group()),
                                          EngineDirectBackend("engine-direct", None, algorithm)))
        elif name == "direct-group":
            made.append(DirectGroupBackend(EngineDirectBackend("engine-direct", None, algorithm)))
        elif name == "gloo":
            made.append(TorchDistBackend("gloo", dist.new_group(backend="gloo"), device=device))
        elif name == "mpi4py":
            made.append(Mpi4pyBackend())
        elif name == "deepspeed-shm":
            if device != "cpu":
                raise SystemExit("backend deepspeed-shm runs on CPU tensors only")
            made.append(DeepSpeedShmBackend(control))
        elif name == "nccl":
            if not torch.cuda.is_available():
                raise SystemExit("--backends nccl needs a CUDA machine (torch.cuda.is_available() is False)")
            made.append(TorchDistBackend("nccl", dist.new_group(backend="nccl"), device="cuda"))
        else:
            raise SystemExit(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    return made
