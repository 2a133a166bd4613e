"""torch_xla >= 2.5's torch_xla.launch: the same process model as xmp.spawn."""

import torch_xla


def _mp_fn(index):
    device = torch_xla.device()
    print(f"replica {index} on {device}", flush=True)


if __name__ == "__main__":
    torch_xla.launch(_mp_fn, args=())
