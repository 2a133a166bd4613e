"""Test-only: stop a process at TPU device start-up and say what it was given (torch_xla or TorchTPU).

There is no TPU here. This module (on PYTHONPATH, loaded in every process of the job) wraps the first step
of starting the device in each runtime, before anything calls it:

- torch_xla: no libtpu exists in its environment, so a process with PJRT_DEVICE=TPU gets as far as torch_xla
  asking its TPU plugin for libtpu's path (`TpuPlugin.library_path`), the first step of creating the client.
- TorchTPU: a process's first operation on a device calls TorchTPU's device module `_lazy_init` (torch's lazy
  start of a PrivateUse1 device), and right after it libtpu's PJRT client, which aborts the process ("TPU
  initialization failed: No jellyfish device found").

There it prints one `TPU-START {json}` line with the process's launch variables and what the runtime's own
hardware code sees, opens the device's file as libtpu would (so kill-stale has a holder to find), and
blocks until it is killed. Nothing the runtime, Lightning, torch or the script does before that point is
changed. With TPU_STOP_BUSY=<chip or device>, that process fails there instead, with the error libtpu gives
when another process holds the TPU.
"""

import importlib.abc
import json
import os
import socket
import sys
import threading

_XLA_VARS = (
    "TPU_VISIBLE_CHIPS", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS", "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT", "PJRT_DEVICE",
    "TPURUN_CORE", "TPURUN_WORKER_ID", "XLA_USE_SPMD", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK",
)  # fmt: skip
_TORCHTPU_VARS = (
    "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID", "TPU_WORKER_HOSTNAMES",
    "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "TPURUN_CORE", "TPURUN_WORKER_ID",
)  # fmt: skip
_held = []


def _stop(report, busy, files):
    """The device start-up that never ends: fail as a held TPU does (BUSY), or hold FILES, report, block."""
    if busy:
        raise RuntimeError(f"TPU initialization failed: The TPU is already in use by process with pid {os.getppid()}")
    for path in files:  # as libtpu opens its devices
        if os.path.exists(path):
            _held.append(open(path, "rb"))
    print(
        "TPU-START " + json.dumps(dict(report, pid=os.getpid(), host=socket.gethostname()), sort_keys=True), flush=True
    )
    threading.Event().wait()  # the test stops the job


def _xla_device_start(module):
    plugin_library_path = module.TpuPlugin.library_path

    def library_path(self):
        tpu = module
        env = {k: os.environ.get(k) for k in _XLA_VARS}
        visible = env["TPU_VISIBLE_CHIPS"]
        chips = [int(c) for c in visible.split(",")] if visible else list(range(tpu.num_available_chips()))
        report = {
            "ppid": os.getppid(),
            "env": env,
            "chips": chips,
            "host_chips": tpu.num_available_chips(),
            "worker_id": tpu.worker_id(),
            "worker_ips": tpu.get_worker_ips(),
        }
        busy = visible is not None and os.environ.get("TPU_STOP_BUSY") == visible
        _stop(report, busy, [f"/dev/{kind}{chip}" for chip in chips for kind in ("accel", "vfio/")])
        return plugin_library_path(self)

    module.TpuPlugin.library_path = library_path


def _torchtpu_device_start(module):
    cls = module._DeviceModule
    lazy_init = cls.__dict__["_lazy_init"].__func__

    def _lazy_init(cls):
        from torch_tpu._internal.utils import hardware

        env = {k: os.environ.get(k) for k in _TORCHTPU_VARS}
        device = int(env["LOCAL_RANK"] or env["TPURUN_CORE"] or 0)
        report = {
            "env": env,
            "device": device,
            "host_devices": hardware.get_tpu_device_count(),
            "host_topology": hardware.get_tpu_topology(),
        }
        _stop(report, os.environ.get("TPU_STOP_BUSY") == str(device), [f"/dev/vfio/{device}"])
        return lazy_init(cls)

    cls._lazy_init = classmethod(_lazy_init)


_WRAP = {
    "torch_xla._internal.tpu": _xla_device_start,
    "torch_tpu._internal.device._device_module": _torchtpu_device_start,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps a runtime's device start once its module has loaded (before anything calls it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _WRAP:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _WRAP[fullname](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
