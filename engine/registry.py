"""The algorithm registry: every algorithm the engine can run, one entry per (collective, transport,
algorithm), listed in the order they are chosen.

For a call, a group walks the entries of its transport for that collective and runs the first that
applies: the message (one rank's piece, in bytes) and the group size in the entry's ranges, the
dtype and reduce op among those it takes, uneven counts only where it takes them, what it needs
present in the group (single copy, a hierarchy), and chosen automatically (some entries run only
when forced or named by a tuning file). The last automatic entry of each collective takes
everything, so every call has one.

This is the one place that names an algorithm or holds a threshold. Its users:
- the compiled core walks a group's rules in C on every call (Plan.configure hands them over as
  data; the core knows only implementation codes and records the entry index that ran), so the
  flight recorder and the trace name the entry;
- ENGINE_<COLLECTIVE>_ALGO forces an entry: `auto`, a name (every group whose transport runs it),
  or `transport:name` items separated by commas (`shm:twoshot,mpi:ring,tcp:ring`);
- a tuning file (ENGINE_TUNING_FILE, read by engine.tuning, its names checked by tuned() here;
  written by `python -m engine.bench tune`) puts measured rules ahead of the built-in ones and may set thresholds;
- tests/mpi/test_matrix.py forces every entry in turn, on every configuration that can run it.
"""

import dataclasses
import hashlib
import operator
import os
import re

from . import tuning
from ._core import DTYPE_NAMES, OP_KIND_NAMES, OPBITS, Impl
from .config import MAX_SETTING, env_choice, env_int

EVERY = 1 << 62                 # no upper bound (bytes or ranks)
COLLECTIVES = OP_KIND_NAMES     # the core's order: allreduce .. barrier, then sendrecv (point-to-point)
TRANSPORTS = ("shm", "mpi", "tcp", "nccl")
REDUCTIONS = ("allreduce", "reduce", "reduce_scatter")
ROOTED = ("gather", "scatter")   # (uneven: the counts are the root's alone)
OP_NAMES = ("sum", "product", "min", "max", "band", "bor", "bxor", "avg", "user")


@dataclasses.dataclass(frozen=True)
class Tunable:
    """A threshold or parameter: its environment variable wins, then a tuning file's "thresholds",
    then the default."""
    env: str
    default: int
    doc: str
    minimum: int = 0    # the least value that means something (the core refuses less)
    local: bool = False  # a rank's own (how it splits its own work): the group's ranks may differ
    maximum: int = MAX_SETTING   # the most the core takes

    def value(self):
        doc = tuned()   # (its thresholds were checked against the same bounds when it was read)
        return env_int(self.env, doc["thresholds"].get(self.env, self.default) if doc else self.default,
                       minimum=self.minimum, maximum=self.maximum)

    def given(self, value, what):
        """value, given in code where the setting is read (`what` names the argument), held to its bounds."""
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise TypeError(f"{what} must be an int ({self.doc}), not {value!r}")
        value = operator.index(value)
        if not self.minimum <= value <= self.maximum:
            raise ValueError(f"{what}={value}: expected {self.minimum}..{self.maximum} ({self.doc})")
        return value


@dataclasses.dataclass(frozen=True)
class Entry:
    collective: str
    transport: str
    name: str
    impl: int                       # what runs it: an engine._core.Impl code
    doc: str
    min_bytes: object = 0           # an int or a Tunable; one rank's piece of the message
    max_bytes: object = EVERY
    min_ranks: int = 1
    max_ranks: int = EVERY
    dtypes: frozenset = None        # dtype names it takes (None: every dtype)
    ops: frozenset = None           # reduce ops it takes, OP_NAMES (None: every op)
    takes: object = None            # (dtype, op) -> bool where a capability is not a product of the two
    uneven: bool = True             # takes per-rank counts (the v-collectives)
    needs: frozenset = frozenset()  # what the group must have: "single_copy", "hierarchy"
    auto: object = True             # True; False: only forced or tuned; a name: where the group has it
    params: tuple = ()              # (name, Tunable) the implementation reads

    @property
    def key(self):
        return f"{self.transport}:{self.collective}:{self.name}"

    @property
    def index(self):
        return INDEX[self.key]

    def bytes_range(self):
        lo, hi = (v.value() if isinstance(v, Tunable) else v for v in (self.min_bytes, self.max_bytes))
        if lo > hi and isinstance(self.min_bytes, Tunable) and isinstance(self.max_bytes, Tunable):
            raise ValueError(f"{self.min_bytes.env}={lo} is above {self.max_bytes.env}={hi}: the {self.key} entry "
                             "would run at no size (to turn it off, force another entry)")
        return lo, hi

    def takes_call(self, dtype, op):
        """Whether it takes a call of dtype (a name) and reduce op (an OP_NAMES name, None: no reduction)."""
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        if op is not None and self.ops is not None and op not in self.ops:
            return False
        return self.takes is None or self.takes(dtype, op)

    def masks(self):
        """(dtype mask, op mask) for the core (which has no (dtype, op) products: `takes` is Python's)."""
        dtypes = sum(1 << i for i, d in enumerate(DTYPE_NAMES) if self.dtypes is None or d in self.dtypes)
        ops = sum(1 << i for i, o in enumerate(OP_NAMES[:-1]) if self.ops is None or o in self.ops)
        if self.ops is None or "user" in self.ops:
            ops |= 1 << OPBITS["user"]
        return dtypes, ops | 1 << OPBITS["none"]


# -- thresholds and parameters (measured on this project's machines: docs/tuning.md) --

SHM_ONESHOT_MAX = Tunable("ENGINE_SHM_ONESHOT_MAX_BYTES", 16 << 10, "largest one-shot shm allreduce")
SHM_REDUCE_ONESHOT_MAX = Tunable("ENGINE_SHM_REDUCE_ONESHOT_MAX_BYTES", 256 << 10,
                                 "largest one-shot shm reduce (only the root reduces; the peers run ahead)")
SHM_CHUNK = Tunable("ENGINE_SHM_CHUNK_BYTES", 512 << 10, "two-shot step size")
SHM_THREADS_MIN = Tunable("ENGINE_SHM_THREADS_MIN_BYTES", 256 << 10,
                          "smallest shm allreduce and reduce whose kernels split over the rank's threads")
SHM_THREAD_SLICE = Tunable("ENGINE_SHM_THREAD_SLICE_BYTES", 16 << 10,
                           "least bytes a thread's slice of a threaded kernel takes (fewer threads below)", local=True)
SINGLE_COPY_MIN = Tunable("ENGINE_SHM_CMA_MIN_BYTES", 32 << 10, "smallest piece that moves by single copy")
SINGLE_COPY_MAX = Tunable("ENGINE_SHM_CMA_MAX_BYTES", EVERY, "largest piece that moves by single copy")
RING_SEGMENT = Tunable("ENGINE_RING_SEGMENT_BYTES", 512 << 10, "pipeline segment of the ring", minimum=16)
RDOUBLE_MAX = Tunable("ENGINE_RDOUBLE_MAX_BYTES", 256 << 10, "largest recursive-doubling allreduce over MPI")
RING_MIN = Tunable("ENGINE_RING_MIN_BYTES", 32 << 10, "smallest ring allreduce over MPI")
SHM_PULL_PIECE = Tunable("ENGINE_SHM_PULL_PIECE_BYTES", 1 << 20,
                         "bytes of each peer's input a single-copy reduce_scatter reads at once", minimum=1,
                         local=True)
MPI_CHUNK = Tunable("ENGINE_MPI_CHUNK_ELEMENTS", 1 << 30, "largest piece of a native MPI reduction or broadcast",
                    minimum=1, maximum=2**31 - 1)   # (MPI's counts are ints)
HIER_MIN = {c: Tunable(f"ENGINE_HIER_{c.upper()}_MIN_BYTES", 16 << 10, f"smallest hierarchical {c}")
            for c in ("allreduce", "broadcast", "allgather", "reduce_scatter")}
TCP_RDOUBLE_MAX = Tunable("ENGINE_TCP_RDOUBLE_MAX_BYTES", 64 << 10, "largest recursive-doubling allreduce over TCP")
TCP_TREE_MAX = Tunable("ENGINE_TCP_TREE_MAX_BYTES", 64 << 10,
                       "largest broadcast and reduce through a binomial tree over TCP")


def _nccl_reduces(dtype, op):
    """the (dtype, op) pairs NCCL reduces itself"""
    from .cuda.tables import nccl_reduction
    from .ops import ReduceOp
    return op is None or (op != "user" and nccl_reduction(dtype, ReduceOp[op.upper()]) is not None)


def _gpu_kernels_reduce(dtype, op):
    """the dtypes the engine's GPU kernels reduce"""
    from .cuda.tables import KERNEL_DTYPES
    return op is None or (op != "user" and dtype in KERNEL_DTYPES)


def _movement(collective, transport, single_copy_doc):
    """A shared-memory data-movement collective: single copy in its range, through the slots otherwise."""
    return (Entry(collective, transport, "single_copy", Impl.SINGLE_COPY, single_copy_doc,
                  min_bytes=SINGLE_COPY_MIN, max_bytes=SINGLE_COPY_MAX, needs=frozenset({"single_copy"})),
            Entry(collective, transport, "segment", Impl.SEGMENT, "through the segment's slots, step by step"))


def _hier(transport, collective, doc, name="hier", **kw):
    """A composite entry (pyx/hierarchy.pxi): shared memory inside each host (socket), `transport`
    between them. The one named "leader" runs the leader allreduce."""
    return Entry(collective, transport, name, Impl.COMPOSITE, doc, min_bytes=HIER_MIN[collective],
                 needs=frozenset({"hierarchy"}), **kw)


def _hierarchy(transport, place="host"):
    """The hierarchy's entries over `transport` between places (hosts; for shm, sockets), each first
    among its collective's."""
    return {
        "allreduce": (
            _hier(transport, "allreduce",
                  f"local reduce, an allreduce among one leader per {place}, local broadcast", name="leader",
                  auto="hier:leader"),
            _hier(transport, "allreduce",
                  f"local reduce_scatter, every rank's slice across {place}s, local allgather", auto="hier:slice")),
        "broadcast": (_hier(transport, "broadcast",
                            f"across {place}s among the root's local index, then inside each {place}"),),
        "allgather": (_hier(transport, "allgather", f"across {place}s, then inside each {place}",
                            uneven=False),),
        "reduce_scatter": (_hier(transport, "reduce_scatter",
                                 f"inside each {place}, then across {place}s", uneven=False),),
    }


_SHM_HIER = _hierarchy("shm", "socket")


def _p2p(transport, auto=True, alltoall_auto=None):
    """The algorithms over point-to-point (pyx/p2p_collectives.pxi), the same code on every transport:
    TCP's own collectives (auto, the tree up to its threshold), and on shared memory and MPI entries
    that run only when forced or tuned (auto=False; the alltoall's: alltoall_auto, if given)."""
    tree_max = TCP_TREE_MAX if auto else EVERY
    return {
        "broadcast": (
            Entry("broadcast", transport, "tree", Impl.TREE, "binomial tree", max_bytes=tree_max, auto=auto),
            Entry("broadcast", transport, "pipeline", Impl.PIPELINE, "a chain from the root, in ring segments",
                  params=(("segment_bytes", RING_SEGMENT),), auto=auto)),
        "reduce": (
            Entry("reduce", transport, "tree", Impl.TREE, "binomial tree to the root, children in rank order",
                  max_bytes=tree_max, auto=auto),
            Entry("reduce", transport, "rsag", Impl.RSAG, "ring reduce-scatter, then the root gathers the blocks",
                  auto=auto)),
        "allgather": (Entry("allgather", transport, "ring", Impl.RING, "the ring: each rank passes on what it received",
                            auto=auto),),
        "gather": (Entry("gather", transport, "linear", Impl.LINEAR, "every rank sends its part to the root at once",
                         auto=auto),),
        "scatter": (Entry("scatter", transport, "linear", Impl.LINEAR, "the root sends every rank its part at once",
                          auto=auto),),
        "reduce_scatter": (Entry("reduce_scatter", transport, "ring", Impl.RING,
                                 "the ring: partial sums go round, each rank keeps its block", auto=auto),),
        "alltoall": (Entry("alltoall", transport, "pairwise", Impl.PAIRWISE,
                           "every pair exchanges its blocks directly, at once; each receive checks its sender's size",
                           auto=auto if alltoall_auto is None else alltoall_auto),),
        "barrier": (Entry("barrier", transport, "dissemination", Impl.DISSEMINATION,
                          "log2(P) rounds of empty messages", auto=auto),),
    }


def _by_collective(*tables):
    """The entries of {collective: entries} tables in COLLECTIVES order, each collective's table by table."""
    return tuple(e for c in COLLECTIVES for table in tables for e in table.get(c, ()))


_MPI_NATIVE = {c: (Entry(c, "mpi", "native", Impl.NATIVE, doc, auto=c != "alltoall",
                         params=(("chunk_elements", MPI_CHUNK),) if c in ("allreduce", "broadcast", "reduce") else ()),)
               for c, doc in (("allreduce", "MPI_Allreduce"), ("broadcast", "MPI_Bcast"), ("reduce", "MPI_Reduce"),
                              ("allgather", "MPI_Allgather(v)"), ("gather", "MPI_Gather(v)"),
                              ("scatter", "MPI_Scatter(v)"), ("reduce_scatter", "MPI_Reduce_scatter(_block)"),
                              ("alltoall", "MPI_Alltoall(v)"), ("barrier", "MPI_Barrier"),
                              ("sendrecv", "MPI_Isend / MPI_Irecv"))}


ENTRIES = (
    # -- shared memory (one host; a group on several sockets: the hierarchy first, sockets for hosts) --
    *_SHM_HIER["allreduce"],
    Entry("allreduce", "shm", "oneshot", Impl.ONESHOT, "every rank reduces every rank's slot (one sync)",
          max_bytes=SHM_ONESHOT_MAX),
    Entry("allreduce", "shm", "ring", Impl.RING, "the ring over the segment's point-to-point queues", auto=False,
          params=(("segment_bytes", RING_SEGMENT),)),
    Entry("allreduce", "shm", "rdouble", Impl.RDOUBLE, "recursive doubling over the segment's queues", auto=False),
    Entry("allreduce", "shm", "twoshot_threads", Impl.THREADED,
          "two-shot, each step's copies and reduction split over the rank's threads (blocking calls)",
          min_bytes=SHM_THREADS_MIN, needs=frozenset({"threads"}),
          params=(("chunk_bytes", SHM_CHUNK), ("slice_bytes", SHM_THREAD_SLICE))),
    Entry("allreduce", "shm", "twoshot", Impl.TWOSHOT, "reduce-scatter through the slots, then allgather",
          params=(("chunk_bytes", SHM_CHUNK),)),
    Entry("reduce", "shm", "oneshot", Impl.ONESHOT, "the peers copy in, the root reduces",
          max_bytes=SHM_REDUCE_ONESHOT_MAX),
    Entry("reduce", "shm", "twoshot_threads", Impl.THREADED,
          "two-shot, each step's copies and reduction split over the rank's threads (blocking calls)",
          min_bytes=SHM_THREADS_MIN, needs=frozenset({"threads"}),
          params=(("chunk_bytes", SHM_CHUNK), ("slice_bytes", SHM_THREAD_SLICE))),
    Entry("reduce", "shm", "twoshot", Impl.TWOSHOT, "every rank reduces a block, the root gathers them",
          params=(("chunk_bytes", SHM_CHUNK),)),
    *_SHM_HIER["broadcast"],
    *_movement("broadcast", "shm", "readers copy from the root's buffer while the root writes their tails"),
    *_SHM_HIER["allgather"],
    *_movement("allgather", "shm", "each rank reads every part from its owner's buffer"),
    *_movement("gather", "shm", "the root reads every part from its owner's buffer"),
    *_movement("scatter", "shm", "each rank reads its part from the root's buffer"),
    *_SHM_HIER["reduce_scatter"],
    Entry("reduce_scatter", "shm", "single_copy", Impl.SINGLE_COPY,
          "each rank reads its block of every input and reduces it", min_bytes=SINGLE_COPY_MIN,
          max_bytes=SINGLE_COPY_MAX, needs=frozenset({"single_copy"}), params=(("piece_bytes", SHM_PULL_PIECE),)),
    Entry("reduce_scatter", "shm", "segment", Impl.SEGMENT, "through the slots, each rank reducing its block"),
    *_movement("alltoall", "shm", "each rank reads its block from every sender's buffer"),
    Entry("barrier", "shm", "segment", Impl.SEGMENT, "every rank's step flag in the segment"),
    Entry("sendrecv", "shm", "single_copy", Impl.SINGLE_COPY,
          "rendezvous: the receiver copies straight from the sender's buffer", min_bytes=SINGLE_COPY_MIN,
          max_bytes=SINGLE_COPY_MAX, needs=frozenset({"single_copy"})),
    Entry("sendrecv", "shm", "queue", Impl.SEGMENT, "framed through the pair's byte ring"),
    *_by_collective(_p2p("shm", auto=False)),   # the same algorithms over the segment's queues

    # -- MPI (across hosts under mpirun with ENGINE_INTERHOST=mpi; one host with ENGINE_TRANSPORT=mpi) --
    *_by_collective(_hierarchy("mpi"), {"allreduce": (
        Entry("allreduce", "mpi", "rdouble", Impl.RDOUBLE, "recursive doubling over MPI point-to-point",
              max_bytes=RDOUBLE_MAX, min_ranks=2),
        Entry("allreduce", "mpi", "ring", Impl.RING, "the pipelined ring over MPI point-to-point", min_bytes=RING_MIN,
              min_ranks=2, params=(("segment_bytes", RING_SEGMENT),)))}, _MPI_NATIVE),
    # the same algorithms over MPI point-to-point; alltoall by pairwise, not MPI_Alltoallv, which leaves
    # a block whose sender split otherwise partly unwritten, without an error (even or uneven alike: a
    # rank may pass even splits where another passes none, and every rank must run the same algorithm)
    *_by_collective(_p2p("mpi", auto=False, alltoall_auto=True)),

    # -- TCP (across hosts without MPI: torchrun, Kubernetes, Ray; under mpirun with ENGINE_INTERHOST=tcp;
    #    one host with ENGINE_TRANSPORT=tcp). Every collective is the engine's own over point-to-point. --
    *_by_collective(_hierarchy("tcp"), {
        "allreduce": (
            Entry("allreduce", "tcp", "rdouble", Impl.RDOUBLE, "recursive doubling over TCP",
                  max_bytes=TCP_RDOUBLE_MAX, min_ranks=2),
            Entry("allreduce", "tcp", "ring", Impl.RING, "the pipelined ring over TCP",
                  params=(("segment_bytes", RING_SEGMENT),))),
        "sendrecv": (Entry("sendrecv", "tcp", "stream", Impl.NATIVE,
                           "framed over the pair's connections; into the posted receive's buffer, without a copy"),),
    }, _p2p("tcp")),

    # -- NCCL (CUDA tensors, engine.cuda) --
    Entry("allreduce", "nccl", "nccl", Impl.NATIVE, "ncclAllReduce", takes=_nccl_reduces),
    Entry("allreduce", "nccl", "ring", Impl.RING, "the engine's GPU ring over NCCL send/recv (bitwise ops, int16)",
          takes=_gpu_kernels_reduce),
    Entry("reduce", "nccl", "nccl", Impl.NATIVE, "ncclReduce", takes=_nccl_reduces),
    Entry("reduce", "nccl", "ring", Impl.RING, "the GPU ring's allreduce; the root keeps it", takes=_gpu_kernels_reduce),
    Entry("reduce_scatter", "nccl", "nccl", Impl.NATIVE, "ncclReduceScatter", takes=_nccl_reduces, uneven=False),
    Entry("reduce_scatter", "nccl", "ring", Impl.RING, "the GPU ring's allreduce; each rank keeps its block",
          takes=_gpu_kernels_reduce),
    Entry("broadcast", "nccl", "nccl", Impl.NATIVE, "ncclBroadcast"),
    Entry("allgather", "nccl", "nccl", Impl.NATIVE, "ncclAllGather", uneven=False),
    Entry("allgather", "nccl", "p2p", Impl.SEGMENT, "NCCL send/recv in one group call (uneven counts)"),
    Entry("gather", "nccl", "p2p", Impl.SEGMENT, "NCCL send/recv in one group call"),
    Entry("scatter", "nccl", "p2p", Impl.SEGMENT, "NCCL send/recv in one group call"),
    Entry("alltoall", "nccl", "p2p", Impl.SEGMENT, "NCCL send/recv in one group call"),
    Entry("barrier", "nccl", "nccl", Impl.NATIVE, "an ncclAllReduce of one element"),
    Entry("sendrecv", "nccl", "nccl", Impl.NATIVE, "ncclSend / ncclRecv in one group call"),
)
INDEX = {e.key: i for i, e in enumerate(ENTRIES)}
# The composite entries that run the hierarchy's leader allreduce (the others run by their collective).
LEADER_ENTRIES = frozenset(i for i, e in enumerate(ENTRIES) if e.impl == Impl.COMPOSITE and e.name == "leader")


# ENGINE_HIER: whether groups spanning hosts build a hierarchy, and which of its allreduces runs by default.
HIER_MODES = ("auto", "slice", "leader", "off")


def hier_mode():
    return env_choice("ENGINE_HIER", HIER_MODES, "auto")


def hierarchy_caps(mode):
    """What a group with a hierarchy has, in this ENGINE_HIER mode (Entry.needs and Entry.auto read them)."""
    return {"hierarchy", "hier:leader" if mode == "leader" else "hier:slice"}


def entries(collective=None, transport=None):
    return [e for e in ENTRIES if (collective is None or e.collective == collective)
            and (transport is None or e.transport == transport)]


def entry(transport, collective, name):
    i = INDEX.get(f"{transport}:{collective}:{name}")
    if i is None:
        raise KeyError(f"no {collective} algorithm {name!r} on the {transport} transport; it runs "
                       f"{', '.join(e.name for e in entries(collective, transport))}")
    return ENTRIES[i]


def tunables(transport=None):
    """Every threshold and parameter (of one transport's entries), once each (for the docs, the tuner
    and settings())."""
    seen = {}
    for e in entries(transport=transport):
        for t in (e.min_bytes, e.max_bytes, *(p for _, p in e.params)):
            if isinstance(t, Tunable):
                seen.setdefault(t.env, t)
    return list(seen.values())


def settings(transport):
    """What the plan of a group on `transport` is made of, by variable: the value of each threshold and
    parameter of its entries (the environment's, a tuning file's or the default; not a rank's own,
    Tunable.local), the algorithms forced on it, and a hash of the tuning file's rules for it; and the
    same of the NCCL plan its CUDA tensors take (its ranks choose alike, or one runs the engine's ring
    while another calls ncclAllReduce). The ranks of a group must share them (engine.communicator
    compares them first)."""
    mine = (transport, "nccl")
    out = {t.env: t.value() for t in tunables(transport) + tunables("nccl") if not t.local}
    for coll in COLLECTIVES:
        forced = [(t, n) for t, n in forced_items(coll) if t in (None, *mine)]
        if forced:
            out[force_variable(coll)] = ",".join(f"{t}:{n}" if t else n for t, n in forced)
    doc = tuned()
    rules = sorted((k, v) for k, v in (doc["rules"].items() if doc else ()) if k[1] in mine)
    if rules:
        out["ENGINE_TUNING_FILE"] = f"rules {hashlib.sha1(repr(rules).encode()).hexdigest()[:12]}"
    return out


_tuned = {}


def tuned(path=None):
    """The tuning file named by ENGINE_TUNING_FILE (or path), its names checked against this registry,
    or None without one: {"rules": {(collective, transport): [(name, lo, hi, min_ranks, max_ranks)]},
    "thresholds": {env: int}}."""
    path = path or os.environ.get("ENGINE_TUNING_FILE") or None
    if path is None:
        return None
    if path not in _tuned:
        doc = tuning.parse(path)
        for (coll, transport), rules in doc["rules"].items():
            if coll not in COLLECTIVES:
                raise tuning.fail(path, f"unknown collective {coll!r} (expected one of {', '.join(COLLECTIVES)})")
            if transport not in TRANSPORTS:
                raise tuning.fail(path, f"unknown transport {transport!r} (expected one of {', '.join(TRANSPORTS)})")
            names = [e.name for e in entries(coll, transport)]
            for i, (name, *bounds) in enumerate(rules):
                if name not in names:
                    raise tuning.fail(path, f"{coll}.{transport}[{i}]: algorithm {name!r} does not run on the "
                                            f"{transport} transport (its {coll} runs {', '.join(names)})")
            doc["rules"][coll, transport] = [(name, lo, EVERY if hi is None else hi, lo_r, EVERY if hi_r is None
                                              else hi_r) for name, lo, hi, lo_r, hi_r in rules]
            if coll in ROOTED and any(lo or hi < EVERY for _, lo, hi, _, _ in doc["rules"][coll, transport]):
                raise tuning.fail(path, f"{coll}.{transport}: a {coll} rule can't depend on the call's size: off the "
                                        "root a rank knows only its own part (torch gives the counts to the root "
                                        "alone), so the ranks of an uneven call would choose differently; give "
                                        "rules for every size")
        known = {t.env: t for t in tunables()}
        for name, value in doc["thresholds"].items():
            if name not in known:
                raise tuning.fail(path, f"unknown threshold {name!r} (the registry's: {', '.join(sorted(known))})")
            if not known[name].minimum <= value <= known[name].maximum:
                raise tuning.fail(path, f"threshold {name} must be {known[name].minimum}..{known[name].maximum}, "
                                        f"not {value}")
        _tuned[path] = doc
    return _tuned[path]


def force_variable(collective):
    return f"ENGINE_{collective.upper()}_ALGO"


def forced_items(collective, environ=None):
    """The (transport or None, name) items of ENGINE_<COLLECTIVE>_ALGO, checked against the registry
    (ENGINE_CUDA_ALLREDUCE_ALGO, the older CUDA-only variable, adds nccl: items to allreduce's)."""
    env = os.environ if environ is None else environ
    sources = [(force_variable(collective), "")]
    if collective == "allreduce":
        sources.append(("ENGINE_CUDA_ALLREDUCE_ALGO", "nccl:"))
    out, named = [], {}   # named: transport (None: every transport) -> the name given it
    for var, prefix in sources:
        raw = env.get(var, "").strip().lower()
        if raw in ("", "auto"):
            continue
        for item in (i.strip() for i in raw.split(",")):
            if not item:
                continue
            if prefix and ":" in item and not item.startswith(prefix):   # (the CUDA-only variable: NCCL's entries)
                raise ValueError(f"{var}={raw!r}: expected names of NCCL's allreduce entries (nccl, ring); "
                                 f"use ENGINE_ALLREDUCE_ALGO={item} for another transport's")
            transport, _, name = (item if ":" in item else prefix + item).rpartition(":")
            if transport and transport not in TRANSPORTS:
                raise ValueError(f"{var}={raw!r}: unknown transport {transport!r} (expected one of "
                                 f"{', '.join(TRANSPORTS)})")
            names = sorted({e.name for e in entries(collective, transport or None)})
            if name not in names:
                where = f" on the {transport} transport" if transport else ""
                raise ValueError(f"{var}={raw!r}: {collective} has no algorithm {name!r}{where}; expected auto, or "
                                 f"one of {', '.join(names)} (optionally as transport:name)")
            # (the second named for a transport was never run; nor one after a bare name that runs there)
            first = named.setdefault(transport or None, name)
            if first == name and transport and None in named and \
                    named[None] in {e.name for e in entries(collective, transport)}:
                first = named[None]
            if first != name:
                raise ValueError(f"{var}={raw!r} names two {collective} algorithms for "
                                 f"{f'the {transport} transport' if transport else 'every transport'} "
                                 f"({first}, {name}): name one")
            out.append((transport or None, name))
    return out


_FORCED_RAN = set()   # (collective, name) of the bare names forced on a group of this process


class Plan:
    """How one group chooses its algorithms: for each collective, the rules it walks (forced, tuned,
    then the registry's automatic entries) and every entry it can run (for algorithm=).

    caps: what the group has ("single_copy", "hierarchy", and "hier:slice" or "hier:leader" for the
    ENGINE_HIER mode). A stage of a composite (a hierarchy's local and cross groups) and the CUDA
    communicator ignore a forced name their transport does not run; a group a user made refuses it.
    A forced entry needing what the group lacks is refused too, but by a group of one rank (alone),
    whose calls move nothing whatever entry they name: a script forcing single copy runs at one rank
    as at two."""

    def __init__(self, transport, caps=(), *, stage=False, alone=False, environ=None):
        measured = tuned()
        self.transport, self.caps = transport, frozenset(caps)
        self.rules, self.named = {}, {}
        for coll in COLLECTIVES:
            mine = entries(coll, transport)
            runnable = [e for e in mine if e.needs <= self.caps]
            forced = self._forced(coll, mine, stage, alone, environ)
            from_file = measured["rules"].get((coll, transport), ()) if measured else ()
            rules = [(entry(transport, coll, name), lo, hi, lo_r, hi_r) for name, lo, hi, lo_r, hi_r in from_file]
            rules = [r for r in rules if r[0].needs <= self.caps]
            rules += [(e, *e.bytes_range(), e.min_ranks, e.max_ranks) for e in runnable
                      if e.auto is True or e.auto in self.caps]
            if forced is not None:
                # Every size and group size; a call it does not take (its dtype, op or uneven counts)
                # keeps the automatic choice.
                rules = [(forced, 0, EVERY, 1, EVERY)] + [r for r in rules if r[0] is not forced]
            self.rules[coll], self.named[coll] = rules, runnable

    def _forced(self, coll, mine, stage, alone, environ):
        for transport, name in forced_items(coll, environ):
            if transport not in (None, self.transport):
                continue
            match = [e for e in mine if e.name == name]
            if not match:
                # (one a group of this process ran was meant for that one's transport: the groups a shrink or
                # split makes of an MPI world run on shared memory or TCP, and must not fail for it)
                if transport is None and not stage and (coll, name) not in _FORCED_RAN:
                    raise ValueError(f"{force_variable(coll)}={name} does not run on the {self.transport} transport; "
                                     f"its {coll} runs {', '.join(e.name for e in mine)} (or name a transport: "
                                     f"{self.transport}:<name>)")
                continue
            missing = match[0].needs - self.caps
            if missing:
                if stage or alone:
                    continue
                raise ValueError(f"{force_variable(coll)}={name}: {coll} {name} needs {', '.join(sorted(missing))}, "
                                 f"which this {self.transport} group lacks ({_why(missing)})")
            _FORCED_RAN.add((coll, name))
            return match[0]
        return None

    def choose(self, collective, nbytes, size, dtype=None, op=None, uneven=False):
        """The entry a call runs (Python's walk, as the core's; CUDA and the tests use it), or None."""
        for e, lo, hi, lo_r, hi_r in self.rules[collective]:
            if lo <= nbytes <= hi and lo_r <= size <= hi_r and (e.uneven or not uneven) \
                    and (dtype is None or e.takes_call(dtype, op)):
                return e
        return None

    def sizes_running(self, collective, impl, size):
        """The byte sizes at which a call of `collective` in a group of `size` ranks runs an entry of
        implementation `impl` (the first rule each size matches; dtypes, ops and uneven counts aside),
        as (lo, hi) ranges in ascending order."""
        taken, found = [], []   # (ranges the rules before took; ranges impl gets)
        for e, lo, hi, lo_r, hi_r in self.rules[collective]:
            if not lo_r <= size <= hi_r:
                continue
            if e.impl == impl:
                pieces = [(lo, hi)]
                for t_lo, t_hi in taken:   # (what an earlier rule took is not this one's)
                    pieces = [p for a, b in pieces for p in ((a, min(b, t_lo - 1)), (max(a, t_hi + 1), b)) if p[0] <= p[1]]
                found += pieces
            taken.append((lo, hi))
        merged = []
        for lo, hi in sorted(found):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged

    def configure(self, core):
        """Hands every collective's rules to the compiled core."""
        names = [e.name for e in ENTRIES]
        for coll in COLLECTIVES:
            def item(e, lo, hi, lo_r, hi_r):
                return (e.index, e.impl, lo, hi, lo_r, hi_r, *e.masks(), e.uneven)
            core.set_rules(coll, [item(*r) for r in self.rules[coll]],
                           [(e.name, item(e, 0, EVERY, 1, EVERY)) for e in self.named[coll]], names)

    def digest(self):
        """The plan in one string: every rank of a group must walk the same rules (their pieces must
        agree on how each moves), so ranks compare it when the group is made."""
        def bound(v):
            return "any" if v >= EVERY else str(v)
        text = ";".join(f"{c}={','.join(f'{e.name}[{lo},{bound(hi)},{a},{bound(b)}]' for e, lo, hi, a, b in rules)}"
                        for c, rules in self.rules.items())
        return hashlib.sha1(text.encode()).hexdigest()[:16], text


def plan_difference(texts, r, q):
    """What differs between ranks r's and q's plans (texts: each rank's Plan.digest() text), by
    collective: the rules (entry[bytes from, to, ranks from, to]) one walks and the other does not."""
    def rules(text):
        return {c: re.findall(r"[^,]+?\[[^\]]*\]", part) for c, part in (p.split("=", 1) for p in text.split(";"))}
    mine, theirs = rules(texts[r]), rules(texts[q])
    told = []
    for c, a in mine.items():
        b = theirs.get(c, [])
        if a == b:
            continue
        only_a, only_b = ", ".join(e for e in a if e not in b), ", ".join(e for e in b if e not in a)
        if only_a and only_b:
            told.append(f"{c}: rank {r} walks {only_a} where rank {q} walks {only_b}")
        elif only_a or only_b:
            told.append(f"{c}: rank {r} walks {only_a}, rank {q} does not" if only_a else
                        f"{c}: rank {q} walks {only_b}, rank {r} does not")
        else:   # (the same rules in another order)
            told.append(f"{c}: rank {r} walks {', '.join(a)} in this order, rank {q} {', '.join(b)}")
    return "; ".join(told)


def _why(missing):
    return "; ".join({"single_copy": "process_vm_readv between the ranks is not allowed here (ENGINE_SHM_CMA)",
                      "hierarchy": "its ranks are not on several hosts (shm: sockets, ENGINE_SOCKETS) with "
                                   "the same number (2+) on each, or ENGINE_HIER=off",
                      "threads": "its host's ranks have one core each to share out; ENGINE_THREADS=N (2 or "
                                 "more) gives each rank N threads"}.get(m, m) for m in sorted(missing))


def markdown():
    """The registry as the Markdown table of docs/algorithms.md (tests/test_registry.py keeps them equal)."""
    def size(v):
        v = v.default if isinstance(v, Tunable) else v
        return "any" if v >= EVERY else f"{v >> 10}K" if v >= 1024 and v % 1024 == 0 else str(v)

    def bound(v):
        return f"{size(v)} (`{v.env}`)" if isinstance(v, Tunable) else size(v)

    lines = ["| transport | collective | entry | bytes from | bytes to | ranks | needs | chosen | what it does |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in ENTRIES:
        auto = {True: "auto", False: "forced or tuned"}.get(e.auto, f"auto with {e.auto}")
        ranks = f"{e.min_ranks}+" if e.max_ranks >= EVERY else f"{e.min_ranks}-{e.max_ranks}"
        needs = ", ".join(sorted(e.needs)) + (", " if e.needs and not e.uneven else "") + \
            ("even counts" if not e.uneven else "")
        lines.append(f"| {e.transport} | {e.collective} | `{e.name}` | {bound(e.min_bytes)} | {bound(e.max_bytes)} | "
                     f"{ranks} | {needs or '-'} | {auto} | {e.doc}"
                     + (f"; predicate: {e.takes.__doc__ or e.takes.__name__}" if e.takes else "") + " |")
    return "\n".join(lines) + "\n"
