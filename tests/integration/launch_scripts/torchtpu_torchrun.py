"""torchrun-style TorchTPU: every process is one device, its launcher (torchrun, or tpurun --launch chip)
gave it its rank and what set_tpu_launch_env would have derived in a parent."""

import torch

torch.ones(1, device="tpu")  # the device starts here
print("device ran", flush=True)
