"""`agent.py profile JOB`: every process of a job on this worker captured at once, from the time asked, by its
runtime's profiler server (the hook started it on its slot's port). Part of the agent bundle: its module level is
stdlib only (Python >= 3.8); the capture itself is xprof's (`xprof.convert._pywrap_profiler_plugin.trace`, the
client TensorBoard's and xprof's "capture profile" button uses), imported when asked, so the command runs with the
job's Python, where xprof is installed beside the runtime.

One `trace` call asks every process's server at once; each writes its part as `<host>_<port>.xplane.pb` under a
session directory of xprof's own, which this moves, one file per process named by its slot (`host.xplane.pb`,
`c3.xplane.pb`), into the job's `profiles/<SESSION>/`, where tpurun downloads it from."""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys
import time

from agent_files import AgentError
from protocol import HOST, PROFILE_PORT, TERMINAL, JobState, ProcessStatus, profile_ports
from protocol_calls import JobSpec, ProcessProfile, ProfileAnswer

PROFILES = "profiles"  # in a job's directory: a session's captures, profiles/<SESSION>/<slot>.xplane.pb


def first_port(spec: JobSpec) -> int:
    """The first profiler port the job's processes were given (0: none: `train --no-profile`)."""
    for p in spec.cores:
        value = p.env.get(PROFILE_PORT, "")
        if value.isdigit():
            return int(value)
    return 0


def listening(pid: int) -> set[int]:
    """The TCP ports PID listens on: its sockets' inodes (/proc/PID/fd) found among the listening ones of its
    network (/proc/net/tcp, tcp6)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if len(row) > 9 and row[3] == "0A" and row[9] in inodes:  # 0A: LISTEN
                ports.add(int(row[1].rsplit(":", 1)[1], 16))
    return ports


def server_port(first: int, slot: int, pid: int) -> int:
    """The port the process PID in SLOT serves its profile on: the first of its slot's ports it listens on (0: none)."""
    mine = listening(pid)
    return next((port for port in profile_ports(first, slot) if port in mine), 0)


def file_name(slot: int) -> str:
    return ("host" if slot == HOST else f"c{slot}") + ".xplane.pb"


def capture(jdir: str, spec: JobSpec, state: JobState, at: float, seconds: float, session: str) -> ProfileAnswer:
    """Every running process of the job (its directory JDIR, its SPEC and STATE) traced for SECONDS from AT (this
    machine's clock), its files in JDIR/profiles/SESSION."""
    if not re.fullmatch(r"[\w.-]+", session) or session.startswith("."):
        raise AgentError(f"invalid session name {session!r}")
    out = os.path.join(jdir, PROFILES, session)
    home = os.path.expanduser("~")
    path = os.path.relpath(out, home) if out.startswith(home + os.sep) else out
    if state.status in TERMINAL:
        return ProfileAnswer(path, [], ended=True)
    first = first_port(spec)
    running = [(s.slot, s.pid) for s in state.slots if s.status == ProcessStatus.RUNNING and s.pid]
    if not running:
        return ProfileAnswer(path, [], ended=True)
    if not first:
        why = "started without profiler servers (train --no-profile)"
        return ProfileAnswer(path, [ProcessProfile(s, 0, why=why) for s, _ in running])
    everyone = [ProcessProfile(s, server_port(first, s, pid)) for s, pid in running]
    for p in everyone:
        if not p.port:
            p.why = "it serves no profile: its runtime (jax, torch_xla) is not loaded in it, or its server did not start"
    procs = [p for p in everyone if p.port]
    if not procs:
        return ProfileAnswer(path, everyone)
    try:
        from xprof.convert import _pywrap_profiler_plugin as xprof  # the job's Python's, not the standard library
    except ImportError as e:
        raise AgentError(f"cannot capture: xprof is not installed for {sys.executable}; pip install xprof") from e
    raw = os.path.join(jdir, PROFILES, session + ".raw")
    addresses = ",".join(f"localhost:{p.port}" for p in procs)
    late = time.time() - at
    error = ""
    try:
        # each server starts tracing at AT (xprof's delay: its start time, sent with the request), so every process
        # of every worker starts within the clocks' agreement, however long this took to get here
        xprof.trace(addresses, raw, "", True, int(seconds * 1000), 1, {"delay_ms": max(0, int(-late * 1000))})
    except RuntimeError as e:
        error = str(e).strip() or "the profiler servers answered with no trace"
    os.makedirs(out, exist_ok=True)
    for p in procs:
        found = glob.glob(os.path.join(raw, "plugins", "profile", "*", f"*_{p.port}.xplane.pb"))
        if found:
            p.file = file_name(p.slot)
            os.replace(found[0], os.path.join(out, p.file))
            p.size = os.path.getsize(os.path.join(out, p.file))
        else:
            p.why = error or f"no trace from its profiler server (port {p.port}): its runtime is not loaded, or gave none"
    shutil.rmtree(raw, ignore_errors=True)
    return ProfileAnswer(path, everyone, late=max(0.0, late))
