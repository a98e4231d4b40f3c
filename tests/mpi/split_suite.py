"""dist.split_group on backend "engine" (torch 2.15 splits CPU groups; earlier torches only on an
accelerator): the new groups' ranks, sizes and tables, collectives checked against each rank's own
reference, a rank outside every split, the order of a split's ranks, a split of a split, and a split
group destroyed. Not collected by the MPI suites: tests/test_launchers.py runs it at 3 ranks under
mpiexec (a group made through MPI splits through MPI) and under torchrun (through torch's store), on
shared memory and TCP."""

import os

import pytest
import torch
import torch.distributed as dist

import torch_world
from engine.launcher import detect_launcher

R, P, _ = torch_world.init()
THROUGH_MPI = detect_launcher() is not None   # (the world was made through MPI: so are its splits)
pytestmark = pytest.mark.skipif(P != 3, reason="written for 3 ranks")


def sum_of(ranks, n=5):
    """all_reduce of (rank + 1) * [1..n] over `ranks`, as each rank computes it itself."""
    return sum(r + 1 for r in ranks) * torch.arange(1, n + 1, dtype=torch.float32)


def check_group(group, ranks):
    """group is the split of the world's `ranks`, in that order: its rank, size, torch's table and
    collectives (all_reduce, all_gather, broadcast from its last rank)."""
    me = ranks.index(R)
    assert (group.rank(), group.size(), dist.get_rank(group)) == (me, len(ranks), me)
    assert dist.get_process_group_ranks(group) == ranks
    assert dist.get_backend(group) == "engine"
    comm = group.communicator
    assert (comm.mpi_comm is not None) == THROUGH_MPI
    assert comm.transport == os.environ.get("ENGINE_TRANSPORT", "shm") or len(ranks) == 1, comm.transport
    t = (R + 1) * torch.arange(1, 6, dtype=torch.float32)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, sum_of(ranks)), (ranks, t)
    out = torch.zeros(len(ranks) * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.full((3,), R, dtype=torch.int64), group=group)
    assert out.tolist() == [r for r in ranks for _ in range(3)]
    b = torch.full((4,), float(R))
    dist.broadcast(b, src=ranks[-1], group=group)
    assert torch.equal(b, torch.full((4,), float(ranks[-1])))


def test_split_into_two_groups_each_rank_in_its_own():
    group = dist.split_group(split_ranks=[[0, 2], [1]])
    mine = [0, 2] if R in (0, 2) else [1]
    check_group(group, mine)
    dist.destroy_process_group(group)
    dist.barrier()


def test_a_rank_in_no_split_gets_no_group_and_the_others_run():
    group = dist.split_group(split_ranks=[[0, 1]])
    if R == 2:
        assert group is dist.GroupMember.NON_GROUP_MEMBER
    else:
        check_group(group, [0, 1])
    dist.barrier()


def test_a_splits_order_gives_its_ranks():
    group = dist.split_group(split_ranks=[[2, 0, 1]])
    check_group(group, [2, 0, 1])
    dist.barrier()


def test_a_split_of_a_split():
    outer = dist.split_group(split_ranks=[[1, 2], [0]])
    if R == 0:
        check_group(outer, [0])
    else:
        check_group(outer, [1, 2])
        inner = dist.split_group(outer, split_ranks=[[1], [0]])   # (ranks of the parent: world ranks 2, 1)
        check_group(inner, [R])
    dist.barrier()


def test_ranks_that_pass_different_splits_fail_naming_the_rank():
    """Ranks 0 and 1 split into [0, 1, 2], rank 2 into [2] alone: ranks 0 and 1 fail at once naming rank
    2's split (rather than waiting for it in the store until its timeout); rank 2's group of one is made."""
    if R < 2:
        with pytest.raises(ValueError, match=r"rank 2 split into ranks \[2\] where this rank \(\d\) split into "
                                             r"\[0, 1, 2\]: every rank must pass the same split_ranks"):
            dist.split_group(split_ranks=[[0, 1, 2]])
    else:
        check_group(dist.split_group(split_ranks=[[2], [0, 1]]), [2])
    check_group(dist.split_group(split_ranks=[[0, 1, 2]]), [0, 1, 2])   # (the next split meets as before)
    dist.barrier()


def test_every_member_must_pass_a_valid_split():
    with pytest.raises(ValueError, match="duplicate"):
        dist.split_group(split_ranks=[[0, 0]])
    with pytest.raises(ValueError, match="ranks must be distinct ranks of the group, 0-2; got"):
        dist.split_group(split_ranks=[[R, 7]])


def test_the_same_split_again_after_its_group_is_destroyed():
    for _ in range(3):
        group = dist.split_group(split_ranks=[[0, 1, 2]])
        check_group(group, [0, 1, 2])
        dist.destroy_process_group(group)
    dist.barrier()
