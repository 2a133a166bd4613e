"""paramiko, imported once for the whole transport layer, without `invoke`.

Its own log lines never reach the terminal (below).

paramiko imports `invoke` (and with it asyncio, unittest.mock and a YAML parser: ~35 ms of every
command's start) only to run `Match exec` lines of ssh_config files, which tpurun never reads. The
import is refused while paramiko loads (it then leaves that feature off) and allowed again after.
"""

from __future__ import annotations

import logging
import sys

_refuse_invoke = "invoke" not in sys.modules
if _refuse_invoke:
    sys.modules["invoke"] = None  # type: ignore[assignment]
try:
    import paramiko
finally:
    if _refuse_invoke:
        del sys.modules["invoke"]

# paramiko logs a failed handshake from its transport's thread (an ERROR line and a traceback), which Python would
# print on stderr for want of a handler: tpurun says what failed in its own words (UnreachableError)
logging.getLogger("paramiko").addHandler(logging.NullHandler())

__all__ = ["paramiko"]
