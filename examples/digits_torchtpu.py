"""Train a small MLP on scikit-learn's bundled digits data set with TorchTPU, one process per device.

    tpurun train examples/digits_torchtpu.py --tpu my-tpu      # every device of a TPU VM or pod slice

TorchTPU's own pattern (torch_tpu/_internal/distributed/distributed.py): this process calls
`set_tpu_launch_env()`, which reads what tpurun gives each host (TPU_WORKER_HOSTNAMES, TORCH_TPU_TOPOLOGY,
NNODES, NODE_RANK, MASTER_ADDR/PORT: docs/train.md) and derives the rest; then
torch.multiprocessing.spawn makes one process per device, which tpurun follows and tags [wN/cM]. Gradients
are averaged with TorchTPU's process group ("tpu" backend). There is no TPU where tpurun is tested: its
tests run this file on emulated TPU VMs up to the moment each device starts (tests/integration/test_torchtpu.py).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.tpu import distributed  # TorchTPU installs itself as torch.tpu


def train(index: int, per_host: int, args: argparse.Namespace) -> None:
    node = int(os.environ.get("NODE_RANK", "0"))
    world = per_host * int(os.environ.get("NNODES", "1"))
    rank = node * per_host + index
    tag = f"[rank {rank}/{world}]"
    device = torch.device("tpu")
    torch.default_generator.manual_seed(0)  # the same initial weights in every process (made on the CPU)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    dist.init_process_group("tpu", rank=rank, world_size=world)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_shard, y_shard = x_train[rank::world], y_train[rank::world]
    steps = (len(x_train) // world) // args.batch_size  # the same in every process, so the all_reduces pair up
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_shard), generator=g)
        total = 0.0
        for step in range(steps):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x_shard[idx].to(device)), y_shard[idx].to(device))
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
        print(f"{tag} epoch {epoch:2d} loss {total / max(steps, 1):.4f} test accuracy {accuracy:.3f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    distributed.set_tpu_launch_env()  # one process per device TorchTPU finds on this host
    hosts = int(os.environ.get("NNODES", "1"))
    per_host = len(os.environ["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) // hosts
    mp.spawn(train, args=(per_host, args), nprocs=per_host)


if __name__ == "__main__":
    main()
