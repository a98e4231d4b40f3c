"""torch's parallelism on backend engine, each checked against the same model run whole in every
process: DeviceMesh (1-D and 2-D), FSDP2 (fully_shard, on a 1-D mesh and HSDP's 2-D one), FSDP1
(FullyShardedDataParallel), ZeroRedundancyOptimizer under DDP, tensor parallelism (parallelize_module),
pipeline parallelism (torch.distributed.pipelining: GPipe, interleaved 1F1B) and distributed
checkpointing (DCP) of a sharded model.

Not in the per-file glob of tests/test_mpi_suites.py (each case costs ~3 s of torch's own setup): that
file and tests/test_launchers.py run it under mpiexec (shm at 3 ranks, MPI at 2) and torchrun (4 ranks,
2-D mesh)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torch_world

R, P, GLOO = torch_world.init()


def mlp(seed=0, width=16):
    torch.manual_seed(seed)  # the same on every rank: the reference is the whole model
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))


def data(steps, batch=4 * 12):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(batch, 8, generator=gen), torch.randn(batch, 4, generator=gen)) for _ in range(steps)]


def test_device_mesh_groups_reduce_over_their_ranks():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("dp",))
    t = torch.full((5,), float(R + 1))
    dist.all_reduce(t, group=mesh.get_group("dp"))
    assert torch.equal(t, torch.full((5,), P * (P + 1) / 2))
    if P % 2 == 0:
        mesh2 = init_device_mesh("cpu", (2, P // 2), mesh_dim_names=("dp", "tp"))
        row, col = divmod(R, P // 2)
        t = torch.full((3,), float(R))
        dist.all_reduce(t, group=mesh2.get_group("tp"))  # the ranks of my row
        assert torch.equal(t, torch.full((3,), float(sum(row * (P // 2) + c for c in range(P // 2)))))
        t = torch.full((3,), float(R))
        dist.all_reduce(t, group=mesh2.get_group("dp"))  # the ranks of my column
        assert torch.equal(t, torch.full((3,), float(col + (col + P // 2))))


def train(model, batches, opt=None, my_rows=False):
    """opt's steps (SGD's by default) on each batch whole, or on this rank's equal share of its rows
    (48 rows, P in 1..4), whose gradients DDP and FSDP average into the whole batch's."""
    if opt is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches:
        if my_rows:
            mine = slice(R * len(x) // P, (R + 1) * len(x) // P)
            x, y = x[mine], y[mine]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.parametrize("mesh_dims", [1, 2])
def test_fsdp2_trains_like_one_process_on_the_full_batch(mesh_dims):
    """FSDP2 on a 1-D mesh of every rank, and on HSDP's 2-D one: replicated over its first dimension and
    sharded over its second (2x2 at 4 ranks, 2x1 at 2, 1x3 at 3). The widths (16) don't divide by 3:
    the shards are padded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    batches = data(4)
    ref = train(mlp(), batches)
    model = mlp()
    if mesh_dims == 1:
        mesh = init_device_mesh("cpu", (P,))
    else:
        replicas = 2 if P % 2 == 0 else 1
        mesh = init_device_mesh("cpu", (replicas, P // replicas), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # FSDP2 then asks the group's backend whether it allocates the staging buffers
    # (backend.supports_tensor_alloc(device)); the DCP test below keeps FSDP2's default
    for module in (model[0], model[2], model[4]):
        module.set_allocate_memory_from_process_group_for_comm(True)
    train(model, batches, my_rows=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp1_full_shard_trains_like_one_process_on_the_full_batch():
    """FullyShardedDataParallel (FSDP1), each Linear wrapped, flat parameters padded to the ranks."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    batches = data(4)
    whole = train(mlp(width=20), batches)
    model = FSDP(mlp(width=20), device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    train(model, batches, my_rows=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        state = model.state_dict()
    for name, q in whole.state_dict().items():
        torch.testing.assert_close(state[name], q, rtol=1e-5, atol=1e-6, msg=name)


def test_zero_redundancy_optimizer_under_ddp_trains_like_one_process_on_the_full_batch():
    """ZeroRedundancyOptimizer: each rank steps its share of the parameters, then broadcasts them."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    batches = data(4)
    whole = mlp(width=20)
    train(whole, batches, torch.optim.Adam(whole.parameters(), lr=0.01))
    model = torch.nn.parallel.DistributedDataParallel(mlp(width=20))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    train(model, batches, zero, my_rows=True)
    for (name, p), q in zip(model.module.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    zero.consolidate_state_dict(to=0)
    if R == 0:
        assert len(zero.state_dict()["state"]) == len(list(whole.parameters()))


def test_tensor_parallel_mlp_matches_the_whole_one():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    width = 4 * 3 * P  # divisible by the mesh
    ref = nn.Sequential(*list(mlp(1, width))[:3])  # Linear, Tanh, Linear(width, width)
    model = nn.Sequential(*list(mlp(1, width))[:3])
    mesh = init_device_mesh("cpu", (P,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    out = model(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), ref[0].weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(P < 2, reason="a pipeline needs two or more ranks")
@pytest.mark.parametrize("schedule,per_rank", [("ScheduleGPipe", 1), ("ScheduleInterleaved1F1B", 2)])
def test_pipeline_stages_give_the_whole_models_loss_and_gradients(schedule, per_rank):
    """per_rank stages a rank (rank r holds stages r, r + P, ...), micro-batches sent both ways by
    batch_isend_irecv: the loss, the output and every stage's gradients, against the whole model."""
    import torch.distributed.pipelining as pipelining
    stages = per_rank * P

    def layers():
        torch.manual_seed(5)
        return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(stages)]

    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(24, 8, generator=gen), torch.randn(24, 8, generator=gen)
    whole = nn.Sequential(*layers())
    want = nn.functional.mse_loss(whole(x), y)
    want.backward()
    mine = list(range(R, stages, P))
    parts = layers()
    made = [pipelining.PipelineStage(parts[i], i, stages, torch.device("cpu")) for i in mine]
    run = getattr(pipelining, schedule)(made if per_rank > 1 else made[0], n_microbatches=2 * P,
                                        loss_fn=nn.functional.mse_loss)
    losses = []
    out = run.step(*((x,) if R == 0 else ()), **(dict(target=y, losses=losses) if R == P - 1 else {}))
    if R == P - 1:
        torch.testing.assert_close(torch.stack(losses).mean(), want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, whole(x).detach(), rtol=1e-5, atol=1e-6)
    for i in mine:
        for (name, p), q in zip(parts[i].named_parameters(), whole[i].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"stage {i} {name}")
    dist.barrier()


def test_distributed_checkpoint_of_a_sharded_model_round_trips():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (P,))
    model = mlp(2)
    fully_shard(model, mesh=mesh)
    where = [tempfile.mkdtemp(prefix="engine-dcp-") if R == 0 else None]
    dist.broadcast_object_list(where, src=0)
    try:
        dcp.save(get_model_state_dict(model), checkpoint_id=where[0])
        other = mlp(3)  # different weights, then loaded from the checkpoint
        fully_shard(other, mesh=mesh)
        state = get_model_state_dict(other)
        dcp.load(state, checkpoint_id=where[0])
        set_model_state_dict(other, state)
        for p, q in zip(model.parameters(), other.parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor())
    finally:
        dist.barrier()
        if R == 0:
            for f in os.listdir(where[0]):
                os.remove(os.path.join(where[0], f))
            os.rmdir(where[0])
