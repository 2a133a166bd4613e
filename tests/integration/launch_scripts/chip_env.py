"""What torch_xla's spawner gives each chip process of this host, without making them: each child xmp.spawn
makes calls torch_xla's own `configure_topology(local_rank, local_world_size)` on the host's environment
before its device starts; this one process calls it for every local rank in turn, each on the host's
environment as it was, and prints one `CHIP-ENV {json}` line per rank: a generation's chip contract at the
cost of one process per host instead of one per chip and host."""

import json
import os

from torch_xla._internal import tpu

VARS = (
    "TPU_VISIBLE_CHIPS", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
)  # fmt: skip

host = dict(os.environ)
local = tpu.num_local_processes()  # what xmp.spawn starts on this host
for rank in range(local):
    tpu.configure_topology(rank, local)
    env = {k: os.environ.get(k) for k in VARS}
    report = {"rank": rank, "local": local, "env": env, "worker_id": tpu.worker_id(), "worker_ips": tpu.get_worker_ips()}
    print("CHIP-ENV " + json.dumps(report, sort_keys=True), flush=True)
    os.environ.clear()
    os.environ.update(host)
