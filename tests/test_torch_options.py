"""torchbridge._fastpath reads torch's options structs (reduce op, rootRank, rootTensor, asyncOp, timeout) from
C++: it must agree with pybind's own getters for every op, root and asyncOp, whatever the other fields
hold, and leave everything else (a call's own timeout among it) to the general path."""

import ctypes
import datetime
import random
import sys

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from engine import ReduceOp
from torchbridge import _fastpath
from torchbridge._fastpath import LAYOUTS, read_options

TYPES = {"allreduce": c10d.AllreduceOptions, "broadcast": c10d.BroadcastOptions, "reduce": c10d.ReduceOptions,
         "allgather": c10d.AllgatherOptions, "reduce_scatter": c10d.ReduceScatterOptions,
         "alltoall": c10d.AllToAllOptions, "barrier": c10d.BarrierOptions}
OPS = [name for name in dist.ReduceOp.RedOpType.__members__ if name not in ("PREMUL_SUM", "UNUSED")]


def test_every_struct_is_read_directly_on_this_torch():
    for name, lay in LAYOUTS.items():
        assert lay.type is TYPES[name] and lay.direct, f"{name}: offsets not found, read through pybind"


def test_a_padding_byte_that_matches_the_samples_is_not_taken_for_asyncop(monkeypatch):
    """The bytes after asyncOp are padding, and hold whatever the allocator left there: a byte that
    happens to be nonzero exactly where the samples' asyncOp is (seen once on torch 2.14, from freed
    objects of the same pattern) must not make the flag's offset ambiguous. Planted here in every
    sample's padding; the layout must still be found, and only the setter-driven byte taken."""
    lay = LAYOUTS["broadcast"]
    pad = lay.async_at + 1
    assert pad < 32 and pad not in range(lay.root_at, lay.root_at + 8)
    made = _fastpath._samples

    def planted(*args):
        samples = made(*args)
        for o, _, a, _ in samples:      # the C++ object: just past pybind's PyObject header
            value = ctypes.c_void_p.from_address(id(o) + sys.getsizeof(object())).value
            ctypes.c_ubyte.from_address(value + pad).value = 0x5a if a else 0
        return samples

    monkeypatch.setattr(_fastpath, "_samples", planted)
    found = _fastpath._layout(c10d.BroadcastOptions, False, True, 32)
    assert found.direct and (found.root_at, found.async_at) == (lay.root_at, lay.async_at)


def _options(kind, rng):
    """Options of every kind with random values in each field, and what the fast path must read."""
    o = TYPES[kind]()
    op = root = None
    if LAYOUTS[kind].has_op:
        name = rng.choice(OPS)
        o.reduceOp = getattr(dist.ReduceOp, name)
        op = ReduceOp[name]
    if LAYOUTS[kind].has_root:
        root = rng.choice([0, 1, 2, 7, rng.randrange(2 ** 40)])
        o.rootRank = root
        o.rootTensor = rng.choice([0, 0, rng.randrange(1, 1000)])   # (not 0: the general path refuses it)
    own = rng.random() < 0.3    # a call's own timeout, or one not above 0: the general path takes it
    o.timeout = datetime.timedelta(milliseconds=rng.choice([rng.randrange(0, 10 ** 9), 0, -2]) if own else -1)
    if kind == "barrier":
        o.device_ids = rng.choice([[], [0], [1, 2, 3]])
        if rng.random() < 0.5:
            o.device = torch.device("cpu")
    o.asyncOp = rng.random() < 0.5
    return o, None if own or (root is not None and o.rootTensor) else (op, root or 0, o.asyncOp)


@pytest.mark.parametrize("kind", list(TYPES))
def test_agrees_with_pybind(kind):
    rng = random.Random(kind)
    for _ in range(200):
        o, want = _options(kind, rng)
        assert read_options(LAYOUTS[kind], o) == want
        assert read_options(LAYOUTS[kind], o, pybind=True) == want


def test_general_path_for_everything_else():
    for kind in ("allreduce", "reduce", "reduce_scatter"):
        o = TYPES[kind]()
        o.reduceOp = dist._make_nccl_premul_sum(2.0)
        assert read_options(LAYOUTS[kind], o) is None
        assert read_options(LAYOUTS[kind], o, pybind=True) is None
    for kind, cls in TYPES.items():
        class Sub(cls):
            pass

        assert read_options(LAYOUTS[kind], None) is None
        assert read_options(LAYOUTS[kind], Sub()) is None
        other = TYPES["alltoall" if kind != "alltoall" else "allgather"]()
        assert read_options(LAYOUTS[kind], other) is None


def test_op_codes():
    for name in OPS:
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, name)
        assert _fastpath.op_of(opts.reduceOp) == (int(opts.reduceOp.op), ReduceOp[name])
    opts.reduceOp = dist._make_nccl_premul_sum(2.0)
    assert _fastpath.op_of(opts.reduceOp) == (_fastpath.PREMUL, None)
