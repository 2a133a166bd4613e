"""The programs tpurun ships to workers, stdlib only: the job agent (agent.py, run there with `python3
agent.py ...`, and what it and tpurun say to each other: protocol.py and protocol_calls.py), the hook a host launch puts on its processes' PYTHONPATH (hook/sitecustomize.py) and the
TPU's watchdog (watchdog.py with watchdog_reports.py and watchdog_silent.py, and metaserver.py: how it reaches the metadata server), which ship as one bundle (below; the watchdog also rides in the startup
metadata); kill-stale and doctor's probe (probe.py, in the bundle for the watchdog too) and sync's
receiving end (sync_helper.py, in the bundle too: its compiled copy runs where the bundle is), which travel
inline on the command line."""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import io
import tarfile
from pathlib import Path

WORKER_DIR = Path(__file__).parent
AGENT_PATH = WORKER_DIR / "agent.py"
BUNDLES = ".tpurun/bin"  # where bundles are installed on a worker, under its user's home
# Installed on each worker under ~/.tpurun/bin/<bundle_name()>/ with these relative paths.
BUNDLE = (
    "agent.py",
    "agent_files.py",
    "agent_lines.py",
    "agent_notices.py",
    "agent_stacks.py",
    "agent_profile.py",
    "agent_supervisor.py",
    "protocol.py",
    "protocol_calls.py",
    "hook/sitecustomize.py",
    "metaserver.py",
    "probe.py",
    "relay.py",
    "relay_wire.py",
    "sync_helper.py",
    "versions.py",
    "watchdog.py",
    "watchdog_reports.py",
    "watchdog_silent.py",
    "zygote.py",
)


@functools.cache
def bundle_files() -> dict[str, bytes]:
    return {name: (WORKER_DIR / name).read_bytes() for name in BUNDLE}


@functools.cache
def bundle_name() -> str:
    """agent-<hash of the bundle>: a new tpurun version installs beside the old, never over a running one."""
    digest = hashlib.sha256()
    for name, data in bundle_files().items():
        digest.update(name.encode() + b"\0" + data + b"\0")
    return f"agent-{digest.hexdigest()[:12]}"


@functools.cache
def bundle_tar() -> bytes:
    """The bundle as an uncompressed tar stream (what `tar -x` on the worker unpacks)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in bundle_files().items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@functools.cache
def bundle_metadata() -> str:
    """The bundle as the startup wrapper finds it in metadata: a gzip'd tar, base64."""
    return base64.b64encode(gzip.compress(bundle_tar(), compresslevel=9, mtime=0)).decode()
