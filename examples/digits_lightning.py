"""The digits example as a PyTorch Lightning module, launched by tpurun (one process per core).

tpurun starts the processes itself and gives each one torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID), so Lightning runs as
under torchrun: it joins the process group instead of spawning its own processes. On this machine
(no TPU: PJRT_DEVICE=CPU) the strategy is DDP over gloo; on a TPU VM (PJRT_DEVICE=TPU) the same
script asks Lightning for its XLA accelerator.

    tpurun train examples/digits_lightning.py --cores 2
"""

from __future__ import annotations

import os
import time

import lightning as L
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = int(os.environ.get("DIGITS_EPOCHS", "15"))


def datasets() -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()  # bundled with scikit-learn: no download
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


class Digits(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.loss = nn.CrossEntropyLoss()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        acc = (self.net(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", acc, on_epoch=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        metrics = self.trainer.callback_metrics
        if "train_loss" in metrics:  # every rank prints, so each core's log shows its progress
            print(
                f"[rank {self.global_rank}/{self.trainer.world_size}] epoch {self.current_epoch + 1} "
                f"loss {float(metrics['train_loss']):.4f} test accuracy {float(metrics['val_acc']):.3f}",
                flush=True,
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def main() -> None:
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on_tpu = os.environ.get("PJRT_DEVICE") == "TPU"
    train, test = datasets()
    trainer = L.Trainer(
        accelerator="tpu" if on_tpu else "cpu",
        devices="auto" if on_tpu else local_world,
        num_nodes=max(1, world // local_world),
        strategy="auto" if on_tpu or world == 1 else "ddp",
        max_epochs=EPOCHS,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    started = time.time()
    model = Digits()
    # Lightning shards both loaders across processes (DistributedSampler) under DDP
    trainer.fit(model, DataLoader(train, batch_size=32, shuffle=True), DataLoader(test, batch_size=256))
    accuracy = float(trainer.callback_metrics["val_acc"])
    if trainer.global_rank == 0:
        print(f"trained {EPOCHS} epochs on {trainer.world_size} processes in {time.time() - started:.1f} s", flush=True)
        print(f"final test accuracy: {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
