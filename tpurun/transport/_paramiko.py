"""paramiko, imported once for the whole transport layer, without `invoke`.

paramiko imports `invoke` (and with it asyncio, unittest.mock and a YAML parser: ~35 ms of every
command's start) only to run `Match exec` lines of ssh_config files, which tpurun never reads. The
import is refused while paramiko loads (it then leaves that feature off) and allowed again after.
"""

from __future__ import annotations

import sys

_refuse_invoke = "invoke" not in sys.modules
if _refuse_invoke:
    sys.modules["invoke"] = None  # type: ignore[assignment]
try:
    import paramiko
finally:
    if _refuse_invoke:
        del sys.modules["invoke"]

__all__ = ["paramiko"]
