"""Long lines from every process of a spawner, at import (the spawned children too: they import this module
before they know their rank) and in each child's task, on stdout and stderr: each line names its process and
its number, so a test can tell a lost, doubled, mangled or misattributed line. FLOOD_SPAWNER names the
spawner: torch (torch.multiprocessing.spawn, FLOOD_PROCS children), xmp (torch_xla's xmp.spawn, which starts
each child's device before its task) or torchtpu (TorchTPU's launch: set_tpu_launch_env, then torch.multiprocessing.spawn)."""

import os
import sys

LINES = int(os.environ.get("FLOOD_LINES", "300"))
PAD = "x" * 160
ROLE = "HOST" if __name__ == "__main__" else "CHILD"  # a spawned child imports this module as __mp_main__
for i in range(LINES):
    print(f"IMPORT {ROLE} pid={os.getpid()} line={i} {PAD}")
    if i % 10 == 0:
        print(f"IMPORT-ERR {ROLE} pid={os.getpid()} line={i} {PAD}", file=sys.stderr)


def task(rank):
    print(f"RANK {rank} pid={os.getpid()}")
    for i in range(LINES):
        print(f"RUN rank={rank} pid={os.getpid()} line={i} {PAD}")
        if i % 10 == 0:
            print(f"RUN-ERR rank={rank} pid={os.getpid()} line={i} {PAD}", file=sys.stderr)
    sys.stdout.flush()
    print(f"FLOOD-DONE rank={rank} pid={os.getpid()}")


def xmp_task(index):
    import torch_xla

    torch_xla.device()


if __name__ == "__main__":
    spawner = os.environ["FLOOD_SPAWNER"]
    if spawner == "xmp":
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(xmp_task, args=())
    else:
        import torch.multiprocessing as mp

        n = int(os.environ.get("FLOOD_PROCS", "8"))
        if spawner == "torchtpu":
            from torch.tpu import distributed

            distributed.set_tpu_launch_env()  # one process per device TorchTPU finds on this host
            n = len(os.environ["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) // int(os.environ.get("NNODES", "1"))
        mp.spawn(task, nprocs=n)
