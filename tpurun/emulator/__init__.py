"""A local emulator of the Cloud TPU v2 API whose TPU workers are real sshd hosts.

`tpurun emulator start` runs it in the background (see docs/emulator.md); tests use the pytest
plugin `tpurun.emulator.pytest_plugin`. The pieces:

* state.py -- the service model (nodes, queued resources, operations, capacity, faults);
* api.py -- the REST surface google-cloud-tpu's REST transport speaks, plus /emulator/v1 admin;
* hosts.py -- the namespace "VMs" behind each node's workers;
* cli.py / __main__.py -- `tpurun emulator ...` and the detached server process.
"""

from __future__ import annotations

ENDPOINT_ENV = "TPURUN_API_ENDPOINT"
