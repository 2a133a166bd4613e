"""`agent.py stacks JOB`: the stacks of every thread of every process of a job on this worker, all asked at
once. Part of the agent bundle (stdlib only, Python >= 3.8).

Two readers. py-spy, where the worker has it (on PATH, beside the job's Python, or in ~/.local/bin), reads
any Python process from outside, native frames too, where ptrace is allowed. Otherwise, and for each process
py-spy could not read, the process's own faulthandler answers: the hook registered it for `STACKS_SIGNAL`
in every Python process of the job, writing to the job's stacks/<pid>.txt. The signal goes only to a
process whose kernel record (/proc/PID/status, SigCgt), read just before, says it catches it, and whose
file the hook made: never to one that exec'd another program, or was never hooked (and that signal's
default action is to ignore it, should one exec in between).
"""

from __future__ import annotations

import linecache
import os
import re
import shutil
import subprocess
import sys
import time

from agent_files import HOOK_DIR, POLL, job_processes, proc_stat
from protocol import HOST, STACKS_SIGNAL, JobState
from protocol_calls import ProcessStack, StackSource, ThreadStack

SETTLED = 0.05  # seconds a dump file must stay the same size to be whole (faulthandler writes in one go)


def catches(pid: int, sig: int) -> bool:
    """Whether PID has a handler for SIG (its SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:300]
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    stat = proc_stat(pid)
    return int(stat[1]) if stat and len(stat) > 1 else 0


def _slot_of(pid: int, slot_pids: dict[int, int]) -> tuple[int | None, bool]:
    """PID's slot (its own, else its nearest ancestor's) and whether it is a child of that slot's process."""
    seen, p = 0, pid
    while p > 1 and seen < 64:
        if p in slot_pids:
            return slot_pids[p], p != pid
        p, seen = _ppid(p), seen + 1
    return None, True


def collect(job: str, jdir: str, state: JobState, timeout: float = 10.0) -> list[ProcessStack]:
    """Every process of JOB (its job directory JDIR, its STATE) with its stacks, asked all at once."""
    slot_pids = {s.pid: s.slot for s in state.slots if s.pid}
    out: dict[int, ProcessStack] = {}
    for pid in sorted(job_processes(job)):
        slot, child = _slot_of(pid, slot_pids)
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        out[pid] = ProcessStack(pid, _ppid(pid), slot, child, _cmdline(pid), cwd, StackSource.NONE)
    spy = _find_py_spy()
    if spy:
        _py_spy(spy, out, timeout)
    unread = {pid: ps for pid, ps in out.items() if ps.source is StackSource.NONE}
    if unread:
        spied = {pid: ps.why for pid, ps in unread.items()}  # why py-spy could not, where it was asked
        for ps in unread.values():
            ps.why = ""
        _faulthandler(jdir, unread, timeout)
        for pid, ps in unread.items():
            if ps.source is StackSource.NONE and spied[pid]:
                ps.why = f"{spied[pid]}; {ps.why}"
    return [out[p] for p in sorted(out, key=lambda p: (_order(out[p].slot), out[p].child, p))]


def _find_py_spy() -> str | None:
    """py-spy on PATH, beside this (the job's) Python, or where `pip install --user` puts it."""
    for where in (None, os.path.dirname(sys.executable), os.path.expanduser("~/.local/bin")):
        found = shutil.which("py-spy", path=where)
        if found:
            return found
    return None


def _order(slot: int | None) -> int:
    return -2 if slot == HOST else (10**9 if slot is None else slot)


def _faulthandler(jdir: str, procs: dict[int, ProcessStack], timeout: float) -> None:
    files = {}
    for pid, ps in procs.items():
        path = os.path.join(jdir, "stacks", f"{pid}.txt")
        if not os.path.exists(path):
            ps.why = "no stacks handler: not a Python process of the job's (or it started without tpurun's hook)"
            continue
        size = os.path.getsize(path)
        if not catches(pid, STACKS_SIGNAL):  # read at once before the signal: it may have exec'd since
            ps.why = "no stacks handler: it no longer runs the Python that registered one (exec)"
            continue
        try:
            os.kill(pid, STACKS_SIGNAL)
            files[pid] = (path, size)
        except OSError:
            ps.why = "it ended before it was asked"
    sizes: dict[int, tuple[int, float]] = {}  # pid -> (size, since when it is that size)
    deadline = time.monotonic() + timeout
    waiting = set(files)
    while waiting and time.monotonic() < deadline:
        time.sleep(POLL)
        t = time.monotonic()
        for pid in list(waiting):
            path, start = files[pid]
            size = os.path.getsize(path)
            before = sizes.get(pid)
            if before is None or before[0] != size:
                sizes[pid] = (size, t)
            elif size > start and t - before[1] >= SETTLED:
                with open(path, "rb") as f:
                    f.seek(start)
                    procs[pid].dump = f.read(size - start).decode("utf-8", "replace")
                procs[pid].source = StackSource.FAULTHANDLER
                procs[pid].threads = parse_faulthandler(procs[pid].dump)
                waiting.discard(pid)
    for pid in waiting:
        procs[pid].why = f"no answer in {timeout:.0f} s"


def _py_spy(spy: str, procs: dict[int, ProcessStack], timeout: float) -> None:
    """py-spy's dump of each process (Python frames, native ones too), all at once."""
    running = {}
    for pid in procs:
        argv = [spy, "dump", "--pid", str(pid), "--native", "--full-filenames"]
        running[pid] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    for pid, p in running.items():
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            procs[pid].why = f"py-spy gave no answer in {timeout:.0f} s"
            continue
        if p.returncode == 0:
            procs[pid].dump, procs[pid].source = out.decode("utf-8", "replace"), StackSource.PY_SPY
            procs[pid].threads = parse_py_spy(procs[pid].dump)
        else:
            procs[pid].why = "py-spy: " + (err.decode("utf-8", "replace").strip().splitlines() or ["failed"])[-1]


# faulthandler: a header per thread ("Current thread" for the one that took the signal), the main thread
# last; then one line per frame, innermost first
_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)\b.*:$")
_FH_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
# py-spy: 'Thread 463 (idle): "MainThread"', then '    function (file:line)' or a native '    function (library)'
_SPY_THREAD = re.compile(r'^Thread (\S+) \(([\w+]+)\)(?:: "(.*)")?$')  # (idle), (active), (active+gil)
_SPY_FRAME = re.compile(r"^    (.*) \((.*?)(?::(\d+))?\)$")


def _frame(file: str, line: int, function: str) -> list:
    return [file, line, function, linecache.getline(file, line).strip() if line else ""]


def _ours(file: str) -> bool:
    """A frame of tpurun's hook (the wrappers that report rendezvous passages): not shown."""
    return file.startswith(HOOK_DIR + os.sep)


def parse_faulthandler(text: str) -> list[ThreadStack]:
    threads: list[ThreadStack] = []
    for raw in text.splitlines():
        head, frame = _FH_THREAD.match(raw), _FH_FRAME.match(raw)
        if head:
            threads.append(ThreadStack(head.group(2), False, []))
        elif frame and threads and not _ours(frame.group(1)):
            threads[-1].frames.append(_frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    if threads:
        threads[-1].main = True  # the interpreter's oldest thread, which faulthandler lists last
    return threads


def parse_py_spy(text: str) -> list[ThreadStack]:
    threads: list[ThreadStack] = []
    for raw in text.splitlines():
        head, frame = _SPY_THREAD.match(raw), _SPY_FRAME.match(raw)
        if head:
            name = head.group(3) or head.group(1)
            threads.append(ThreadStack(name, name == "MainThread", []))
        elif frame and threads and not _ours(frame.group(2)):
            line = int(frame.group(3) or 0)
            threads[-1].frames.append(
                _frame(frame.group(2), line, frame.group(1)) if line else [frame.group(2), 0, frame.group(1), ""]
            )
    if threads and not any(t.main for t in threads):
        threads[0].main = True
    return threads
