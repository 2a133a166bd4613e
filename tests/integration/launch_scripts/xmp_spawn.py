"""pytorch/xla's pattern: one process per host, xmp.spawn makes one replica per chip."""

import torch_xla
import torch_xla.distributed.xla_multiprocessing as xmp


def _mp_fn(index):
    device = torch_xla.device()
    print(f"replica {index} on {device}", flush=True)


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=())
