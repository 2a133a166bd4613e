"""Train a small MLP on scikit-learn's bundled digits data set with PyTorch/XLA, one process per core.

    tpurun train examples/digits_xla.py --cores 4          # on this machine (PJRT_DEVICE=CPU)
    tpurun train examples/digits_xla.py --tpu my-tpu       # every chip of a TPU VM or pod slice

tpurun gives each process RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (docs/train.md). The data set ships
with scikit-learn (no download). Each process trains on its shard of the training set on its XLA device;
gradients are averaged across processes with torch.distributed's gloo backend on CPU copies. That path is
the same on CPU and TPU; it avoids xm.all_reduce, which on CPU would need several devices in one process
and hangs when they are driven from threads (see docs/train.md, "On the cpu runtime"). Started without tpurun it trains
alone (world size 1).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch_xla
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def xla_device() -> torch.device:
    # torch_xla.device() is the 2.x spelling; xm.xla_device() the older one.
    if hasattr(torch_xla, "device"):
        return torch_xla.device()
    import torch_xla.core.xla_model as xm

    return xm.xla_device()


def xla_sync() -> None:
    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def average_gradients(model: nn.Module, world: int) -> None:
    """One gloo all_reduce per step over a flat CPU copy of every gradient."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.detach().reshape(-1) for g in grads]).cpu()
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g).to(g.device))
        offset += n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tag = f"[rank {rank}/{world}]"
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "12355")
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    # Every process's rank + 1, summed across all of them: a process not joined to the others sees its own.
    check = torch.tensor([rank + 1.0])
    if world > 1:
        dist.all_reduce(check)
    print(f"{tag} all-reduce check: {check.item():.1f} (expected {world * (world + 1) / 2:.1f})", flush=True)

    # Same split and same initial weights on every process (fixed seeds), then each trains on its shard.
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_shard, y_shard = x_train[rank::world], y_train[rank::world]
    # Every process must take the same number of steps, or the all_reduce calls would not pair up.
    steps = (len(x_train) // world) // args.batch_size

    device = xla_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x_test_d, y_test_d = x_test.to(device), y_test.to(device)
    print(f"{tag} device {device}, {len(x_shard)} training samples, {steps} steps per epoch", flush=True)

    start = time.time()
    g = torch.Generator().manual_seed(rank)
    test_acc = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_shard), generator=g)
        total = 0.0
        for step in range(steps):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            xb, yb = x_shard[idx].to(device), y_shard[idx].to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            if world > 1:
                average_gradients(model, world)
            optimizer.step()
            xla_sync()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            test_acc = (model(x_test_d).argmax(1) == y_test_d).float().mean().item()
        print(f"{tag} epoch {epoch:2d} loss {total / max(steps, 1):.4f} test accuracy {test_acc:.3f}", flush=True)

    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(f"trained {args.epochs} epochs on {world} processes in {time.time() - start:.1f} s", flush=True)
        print(f"final test accuracy: {test_acc:.3f}", flush=True)


if __name__ == "__main__":
    main()
