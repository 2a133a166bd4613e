"""This machine's processes as the emulator sees them (/proc): parents, command lines, namespaces; and the
clean-up after a crashed emulator."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def ns(pid: int, kind: str = "pid") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def kill_orphans(state_dir: Path) -> int:
    """SIGKILL the workers left behind by a crashed emulator that used `state_dir`; returns how many.

    Kills each worker's init, booting (`_worker_init.py`) or booted (`tpurun-worker-init`): its pid namespace
    goes with it; the `unshare` above it then reaps it and exits.
    """
    markers = (str(Path(__file__).with_name("_worker_init.py")), "tpurun-worker-init ")
    wanted = str(Path(state_dir).resolve()) + "/"
    killed = 0
    for pid in all_pids():
        cmd = cmdline(pid)
        if not cmd.startswith("unshare ") and any(m in cmd for m in markers) and wanted in cmd:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed
