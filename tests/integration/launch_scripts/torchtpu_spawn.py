"""TorchTPU's pattern (torch_tpu/_internal/distributed/distributed.py): the parent sets the launch
environment once, then torch.multiprocessing.spawn makes one process per device."""

import json
import os

import torch
import torch.multiprocessing as mp
from torch.tpu import distributed


def _device(index):
    torch.ones(1, device="tpu")  # the device starts here
    print(f"device {index} ran", flush=True)


if __name__ == "__main__":
    distributed.set_tpu_launch_env()  # one process per device TorchTPU finds on this host
    n = len(os.environ["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) // int(os.environ.get("NNODES", "1"))
    names = ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID", "NNODES",
             "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
    print("LAUNCH-ENV " + json.dumps({k: os.environ.get(k) for k in names}), flush=True)
    mp.spawn(_device, nprocs=n)
