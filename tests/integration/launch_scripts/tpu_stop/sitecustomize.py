"""Test-only: stop a torch_xla process at TPU device start-up and say what it was given.

No libtpu exists here, so a process with PJRT_DEVICE=TPU gets as far as torch_xla asking its TPU plugin
for libtpu's path, the first step of creating the device client. This module (on PYTHONPATH, loaded in
every process of the job) wraps exactly that call: it prints one `TPU-START {json}` line with the
process's TPU variables and what torch_xla's own tpu.py sees, opens the chip's device file as libtpu
would (so kill-stale has a holder to find), and blocks there until it is killed. Nothing torch_xla,
Lightning or the script does before that point is changed. With TPU_STOP_BUSY=<chip>, that chip's
process fails there instead, with the error libtpu gives when another process holds the chip.
"""

import importlib.abc
import json
import os
import socket
import sys
import threading

_VARS = (
    "TPU_VISIBLE_CHIPS", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS", "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT", "PJRT_DEVICE",
    "TPURUN_CORE", "TPURUN_WORKER_ID", "XLA_USE_SPMD", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK",
)  # fmt: skip
_held = []


def _device_start(plugin_library_path):
    def library_path(self):
        from torch_xla._internal import tpu

        env = {k: os.environ.get(k) for k in _VARS}
        visible = env["TPU_VISIBLE_CHIPS"]
        chips = [int(c) for c in visible.split(",")] if visible else list(range(tpu.num_available_chips()))
        report = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "host": socket.gethostname(),
            "env": env,
            "chips": chips,
            "host_chips": tpu.num_available_chips(),
            "worker_id": tpu.worker_id(),
            "worker_ips": tpu.get_worker_ips(),
        }
        if visible is not None and os.environ.get("TPU_STOP_BUSY") == visible:
            raise RuntimeError(
                f"TPU initialization failed: The TPU is already in use by process with pid {os.getppid()}"
            )
        for chip in chips:  # as libtpu opens its chips
            for path in (f"/dev/accel{chip}", f"/dev/vfio/{chip}"):
                if os.path.exists(path):
                    _held.append(open(path, "rb"))
        print("TPU-START " + json.dumps(report, sort_keys=True), flush=True)
        threading.Event().wait()  # "device start-up" never ends here: the test stops the job
        return plugin_library_path(self)

    return library_path


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps TpuPlugin.library_path once torch_xla's tpu module has loaded (before anything calls it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch_xla._internal.tpu":
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
            module.TpuPlugin.library_path = _device_start(module.TpuPlugin.library_path)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
