"""Emulated workers are TPU VMs to torch_xla: its own `_internal/tpu.py` (and Lightning's device count)
run on every worker of a booted node and must see that host's chips, its place in the slice and its peers."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tpurun.topology import parse_accelerator_type

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Runs on a worker with this machine's Python (workers see its installation read-only).
PROBE = r"""
import json, os
from torch_xla._internal import tpu
from lightning.fabric.accelerators.xla import XLAAccelerator
chips = tpu.num_available_chips()
local = tpu.num_local_processes()
out = {
    "chips": chips, "devices": tpu.num_available_devices(), "local_processes": local,
    "lightning_devices": XLAAccelerator.auto_device_count(),
    "version": tpu.version(), "worker_id": tpu.worker_id(), "worker_ips": tpu.get_worker_ips(),
    "tpu_env": tpu.get_tpu_env(),
}
tpu.configure_topology(local - 1, local)
out["last_process_env"] = {k: os.environ.get(k) for k in (
    "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID", "TPU_PROCESS_ADDRESSES",
    "TPU_VISIBLE_CHIPS", "TPU_PROCESS_PORT")}
print("PROBE " + json.dumps(out))
"""


@pytest.mark.parametrize("accel", ["v2-8", "v3-32", "v5p-8"])  # v5e, v6e, v4: tests/integration/test_launch.py
def test_torch_xla_sees_a_real_host(tpu_node, accel):
    topo = parse_accelerator_type(accel)
    node = tpu_node(accel, user="root", wait_startup=False)

    def probe(i: int) -> dict:
        r = subprocess.run(node.ssh(i, sys.executable, "-c", f"'{PROBE}'"), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("PROBE "))
        return json.loads(line[len("PROBE ") :])

    with ThreadPoolExecutor(len(node.workers)) as pool:
        seen = list(pool.map(probe, range(len(node.workers))))
    addresses = [w.address for w in node.workers]
    chips_in_slice = 1
    for i, got in enumerate(seen):
        assert got["chips"] == topo.chips_per_host
        assert got["local_processes"] == topo.chips_per_host  # xmp.spawn: one process per chip
        assert got["devices"] == got["lightning_devices"] == topo.pjrt_devices_per_host
        assert got["version"] == int(topo.generation[1])
        assert got["worker_id"] == i
        assert got["worker_ips"] == (addresses if topo.multi_host else ["localhost"])
        assert got["tpu_env"]["ACCELERATOR_TYPE"] == accel
        env = got["last_process_env"]
        bounds = [int(x) for x in env["TPU_PROCESS_BOUNDS"].split(",")]
        chips_in_slice = bounds[0] * bounds[1] * bounds[2]
        last = topo.chips_per_host - 1
        assert env["CLOUD_TPU_TASK_ID"] == str(i * topo.chips_per_host + last)
        assert env["TPU_VISIBLE_CHIPS"] == str(last)
        assert env["TPU_PROCESS_PORT"] == str(8476 + last)
        assert len(env["TPU_PROCESS_ADDRESSES"].split(",")) == topo.chips
    assert chips_in_slice == topo.chips
