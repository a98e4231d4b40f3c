"""torchbridge._options reads torch's AllreduceOptions from the C++ struct: it must agree with
pybind's own getters for every op and asyncOp, and leave everything else to the general path."""

import datetime

import torch.distributed as dist

from torchbridge import process_group as pg
from torchbridge._options import allreduce_call


def test_enabled_on_this_torch():
    assert pg._FAST_READ, "the offsets of AllreduceOptions were not found: the latency path reads through pybind"


def test_agrees_with_pybind_for_every_op():
    for name in dist.ReduceOp.RedOpType.__members__:
        if name in ("PREMUL_SUM", "UNUSED"):
            continue
        for asynchronous in (False, True):
            for timeout in (datetime.timedelta(seconds=3), datetime.timedelta(hours=2)):
                opts = dist.AllreduceOptions()
                opts.reduceOp = getattr(dist.ReduceOp, name)
                opts.asyncOp = asynchronous
                opts.timeout = timeout
                want = pg._allreduce_call(opts)
                assert want >= 0
                assert allreduce_call(opts) == want, (name, asynchronous, timeout)
                assert pg._BY_CODE[int(opts.reduceOp.op)] == want >> 1


def test_general_path_for_everything_else():
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist._make_nccl_premul_sum(2.0)
    assert allreduce_call(opts) == -1
    assert allreduce_call(None) == -1
    assert allreduce_call(dist.BroadcastOptions()) == -1

    class Sub(dist.AllreduceOptions):
        pass

    assert allreduce_call(Sub()) == -1
