"""SPMD: one process per host drives every chip of the host (torch_xla's sharding API)."""

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()
n = xr.global_runtime_device_count()
mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
t = torch.randn(8 * n, 4).to(torch_xla.device())
xs.mark_sharding(t, mesh, ("data", None))
print("sharded over", n, "devices", flush=True)
