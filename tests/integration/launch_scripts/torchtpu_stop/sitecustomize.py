"""Test-only: stop a TorchTPU device process where TorchTPU starts its device, and say what it was given.

No TPU exists here. A process's first operation on a TorchTPU device calls TorchTPU's device module
`_lazy_init` (torch's lazy start of a PrivateUse1 device), and right after it libtpu's PJRT client, which
aborts the process ("TPU initialization failed: No jellyfish device found"). This module (on PYTHONPATH,
loaded in every process of the job) wraps exactly that `_lazy_init`: it prints one `TPU-START {json}` line
with the process's launch variables and what TorchTPU's own hardware code sees, opens the device's file
as libtpu would (so kill-stale has a holder to find), and blocks there until it is killed. Nothing TorchTPU,
torch or the script does before that point is changed. With TPU_STOP_BUSY=<device>, that device's process
fails there instead, with the error libtpu gives when another process holds the TPU.
"""

import importlib.abc
import json
import os
import socket
import sys
import threading

_VARS = (
    "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID", "TPU_WORKER_HOSTNAMES",
    "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "TPURUN_CORE", "TPURUN_WORKER_ID",
)  # fmt: skip
_held = []


def _device_start(lazy_init):
    def _lazy_init(cls):
        from torch_tpu._internal.utils import hardware

        env = {k: os.environ.get(k) for k in _VARS}
        device = int(env["LOCAL_RANK"] or env["TPURUN_CORE"] or 0)
        report = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "env": env,
            "device": device,
            "host_devices": hardware.get_tpu_device_count(),
            "host_topology": hardware.get_tpu_topology(),
        }
        if os.environ.get("TPU_STOP_BUSY") == str(device):
            raise RuntimeError(
                f"TPU initialization failed: The TPU is already in use by process with pid {os.getppid()}"
            )
        path = f"/dev/vfio/{device}"
        if os.path.exists(path):
            _held.append(open(path, "rb"))
        print("TPU-START " + json.dumps(report, sort_keys=True), flush=True)
        threading.Event().wait()  # "device start-up" never ends here: the test stops the job
        return lazy_init(cls)

    return classmethod(_lazy_init)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps _DeviceModule._lazy_init once TorchTPU's device module has loaded (before anything calls it)."""

    NAME = "torch_tpu._internal.device._device_module"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.NAME:
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
            cls = module._DeviceModule
            cls._lazy_init = _device_start(cls.__dict__["_lazy_init"].__func__)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
