"""torchrun-style: every process is one replica (tpurun --launch chip gives each its chip and ranks)."""

import os

import torch_xla

device = torch_xla.device()
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} on {device}", flush=True)
