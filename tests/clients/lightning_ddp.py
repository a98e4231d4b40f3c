"""PyTorch Lightning's DDPStrategy with process_group_backend="engine" trains like one process on the
full batches.

    torchrun --nproc-per-node 3 tests/clients/lightning_ddp.py
"""

import os

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy

import common


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = common.model()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        return common.loss(self, x, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=common.LR)

    def train_dataloader(self):
        # Each rank's shard of every full batch, in order (the sampler is ours, not Lightning's).
        shards = [common.shard(b, self.global_rank, self.trainer.world_size) for b in common.batches()]
        return torch.utils.data.DataLoader(shards, batch_size=None)


def main():
    size = int(os.environ["WORLD_SIZE"])
    module = Net()
    trainer = pl.Trainer(accelerator="cpu", devices=size, strategy=DDPStrategy(process_group_backend="engine"),
                         max_steps=common.STEPS, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module)
    assert dist.get_backend() == "engine", dist.get_backend()
    assert trainer.global_step == common.STEPS, trainer.global_step
    params = [p.detach().clone() for p in module.net.parameters()]
    common.report(f"lightning ddp {common.launcher_name()}", params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
