"""The job agent's files and processes: where a job's files live, how they are written, and how its
processes are found and signalled. Part of the agent bundle (stdlib only, Python >= 3.8)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator

if __package__:  # imported by tpurun (the emulator, the watchdog's tests) by its package name
    from tpurun.worker.protocol import HOST, TERMINAL, AgentExit, JobState, JobStatus
    from tpurun.worker.protocol_calls import JobSpec, StopRequest
else:  # the bundle on a worker, whose files sit side by side
    from protocol import HOST, TERMINAL, AgentExit, JobState, JobStatus  # type: ignore[no-redef]
    from protocol_calls import JobSpec, StopRequest  # type: ignore[no-redef]

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
POLL = 0.02  # seconds between checks while things happen (supervisor and stream)
IDLE_POLL = 0.25  # ... and at most, once nothing has happened for a while (`Pace`)
CHUNK = 4 << 20  # bytes read from a .rec file at once: big reads are what make streaming fast
MAX_LINE = 8 << 20  # a line longer than this is cut into records rather than held in memory
# faulthandler's names of the fatal signals it reports (a chip process's exit status, as the shell shows it)
FATAL_SIGNALS = {
    "Segmentation fault": int(signal.SIGSEGV),
    "Aborted": int(signal.SIGABRT),
    "Bus error": int(signal.SIGBUS),
    "Floating point exception": int(signal.SIGFPE),
    "Illegal instruction": int(signal.SIGILL),
}
# In the agent root: the worker's claim, locked (flock) by the `preflight --claim` process that holds this worker
# for a job about to start, and naming it; the kernel drops the lock when that process ends, however it ends.
CLAIM = ".claim"
STATE = "state.json"  # in a job's directory: its `JobState`, which the supervisor writes
SPEC = "spec.json"  # in a job's directory: its `JobSpec`, which `start` writes
STOP = "stop.json"  # in a job's directory: a `StopRequest`, which `stop` writes before it signals the supervisor
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook")


class AgentError(Exception):
    def __init__(self, message: str, code: int = AgentExit.USAGE) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------- files and processes


def agent_root(home: str | None = None) -> str:
    """Where jobs' files live: HOME's .tpurun/jobs (without HOME: $TPURUN_AGENT_ROOT/jobs, else this user's)."""
    if home is not None:
        return os.path.join(home, ".tpurun", "jobs")
    root = os.environ.get("TPURUN_AGENT_ROOT") or os.path.join(os.path.expanduser("~"), ".tpurun")
    return os.path.join(root, "jobs")


def job_dir(job: str) -> str:
    if not JOB_ID_RE.match(job):
        raise AgentError(f"invalid job id {job!r}: letters, digits, '.', '_' and '-' only")
    return os.path.join(agent_root(), job)


def write_json_atomic(path: str, data: object) -> None:
    # Readers (stream, jobs, a second start) must never see a half-written state.
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str, limit: int = 16 << 20) -> dict | None:
    """A JSON object from a regular file (never through a symlink, never blocking on a FIFO: the watchdog
    reads users' job files as root), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = json.loads(f.read(limit + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state is [0], pgrp [2]), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = proc_stat(pid)
    # A zombie is gone for our purposes (its parent may simply not have reaped it yet).
    return not (stat is not None and stat[0] in ("Z", "X"))


def group_members(pgid: int | None) -> list[int]:
    """Live (non-zombie) processes of process group PGID."""
    if not pgid:
        return []
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = proc_stat(int(name))
        if stat is not None and len(stat) > 2 and stat[2] == str(pgid) and stat[0] not in ("Z", "X"):
            members.append(int(name))
    return members


def signal_group(pgid: int | None, sig: int) -> None:
    if not pgid:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def log_base(jdir: str, worker: int, slot: int) -> str:
    """Path of a slot's files without extension: w<W>-c<C>, or w<W> for a host launch's own process."""
    return os.path.join(jdir, f"w{worker}" if slot == HOST else f"w{worker}-c{slot}")


def of_job(pid: int, job: str) -> bool:
    """Whether PID inherited JOB's TPURUN_JOB_ID (every process the job starts does)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = b"\0" + f.read()
    except OSError:
        return False
    return b"\0TPURUN_JOB_ID=" + job.encode() + b"\0" in env


def job_processes(job: str) -> list[int]:
    """Live processes started for JOB, found by the TPURUN_JOB_ID every one of them inherits: also those
    that left their process group (setsid) or were orphaned by a spawner that died."""
    me = os.getpid()
    return [
        int(name)
        for name in (os.listdir("/proc") if os.path.isdir("/proc") else [])
        if name.isdigit() and int(name) != me and of_job(int(name), job) and pid_alive(int(name))
    ]


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_job(job: str, groups: list, sig: int) -> set:
    """SIG to every process of JOB once: to each of its process GROUPS (the pgids the supervisor started) as a
    whole, then by pid to those of its processes that were outside them (they left with setsid, or joined a
    group of their own). Both are picked in one look at /proc made before the groups are signalled: a process
    seen in a group then gets the group's signal and not a second one (a handler that puts its default back
    and saves would die of the second), and one that appears after the look (a child a handler started, with
    setsid or not) was born after the signal and is not sent it. A group's signal reaches a process the kernel
    is forking in it meanwhile, as killpg's does. The pids the look found, for whoever must not signal them
    again."""
    pgids = {g for g in groups if g}
    inside, outside = set(), []
    me = os.getpid()
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) == me:
            continue
        pid, stat = int(name), proc_stat(int(name))
        if stat is None or len(stat) < 3 or stat[0] in ("Z", "X"):
            continue
        if stat[2].isdigit() and int(stat[2]) in pgids:
            inside.add(pid)
        elif of_job(pid, job):
            outside.append(pid)
    for pgid in sorted(pgids):
        signal_group(pgid, sig)
    signal_pids(outside, sig)
    return inside | set(outside)


def now() -> float:
    return time.time()


def running_jobs(root: str, exclude: str = "") -> list[str]:
    """Jobs under ROOT (an agent root's jobs directory) that are starting or whose supervisor lives."""
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [name for name in names if name != exclude and job_running(root, name)]


def job_running(root: str, name: str) -> bool:
    """Whether job NAME under ROOT is starting or its supervisor lives (this boot's: an older pid may be reused)."""
    st = read_state(os.path.join(root, name, STATE))
    if st is None or st.status in TERMINAL:
        return False
    started = st.started_at or 0.0
    if started < boot_time():
        return False
    starting = st.status == JobStatus.STARTING and now() - started < 120
    return starting or pid_alive(st.supervisor_pid)


@contextlib.contextmanager
def root_lock(root: str) -> Iterator[None]:
    """The agent root's lock: starts and claims on this worker, one at a time (two concurrent starts must not
    both see "nothing running")."""
    import fcntl  # Unix only, like the rest of the agent

    for d in (os.path.dirname(root), root):  # the user's job files are theirs alone (makedirs' mode is the leaf's)
        os.makedirs(d, mode=0o700, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def claim(root: str, job: str) -> int | None:
    """Claim this worker for JOB (under `root_lock`): the descriptor that holds the claim until it is closed or
    this process ends; None when another process holds it."""
    import fcntl

    fd = os.open(os.path.join(root, CLAIM), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"job_id": job, "pid": os.getpid()}).encode())
    return fd


def claim_holder(root: str) -> dict | None:
    """Who holds this worker's claim (under `root_lock`): {"job_id", "pid"} as its holder wrote them, or None."""
    import fcntl

    path = os.path.join(root, CLAIM)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken: nobody holds it (closing the file drops it)
        return None
    except OSError:
        return read_json(path) or {"job_id": "", "pid": None}
    finally:
        os.close(fd)


def end_claim(root: str, holder: dict, job: str) -> None:
    """Ends the process that holds the claim for JOB (HOLDER: `claim_holder`'s, read under ROOT): the job has taken
    the worker over. The process named is signalled only while it has the claim's file open: a pid used again
    since by another process is not (an agent's command line need not say so: a relay's zygote forks them)."""
    pid = holder.get("pid")
    if holder.get("job_id") == job and isinstance(pid, int) and _holds_open(pid, os.path.join(root, CLAIM)):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass  # gone already


def _holds_open(pid: int, path: str) -> bool:
    """Whether PID has the file at PATH open (one of its descriptors is it)."""
    path = os.path.realpath(path)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for n in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{n}") == path:
                return True
        except OSError:
            continue
    return False


def boot_time() -> float:
    try:
        with open("/proc/uptime") as f:
            return now() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def watch_exit(on_end: Callable[[int], None], pid: int) -> None:
    """Note when PID ends, at once where Linux gives a pidfd (3.9+): which of several chip processes
    ended first decides which one the job's failure is blamed on."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return
    try:
        fd = opener(pid)
    except OSError:
        return

    def wait() -> None:
        import select

        try:
            select.select([fd], [], [])
            on_end(pid)
        finally:
            os.close(fd)

    threading.Thread(target=wait, daemon=True).start()


def pdeathsig_preexec():
    """A preexec_fn that makes the child die with SIGKILL when the supervisor dies (Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except Exception:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(137)

    return preexec


def read_state(path: str) -> JobState | None:
    """The job's state in PATH (its state.json), or None where there is none or it is not one."""
    data = read_json(path)
    try:
        return None if data is None else JobState.from_dict(data)
    except ValueError:
        return None


def read_spec(jdir: str, limit: int = 16 << 20) -> JobSpec:
    """The spec of the job in JDIR (its SPEC file, read as `read_json` reads: LIMIT bytes at most), or ValueError."""
    return JobSpec.from_dict(read_json(os.path.join(jdir, SPEC), limit))


def started_down(jdir: str, limit: int = 16 << 20) -> bool:
    """Whether the job in JDIR was started with `train --down` (its spec's `JobSpec.down`), read from that field
    alone: the TPU's watchdog may be older than the agent that wrote the spec, whose other fields it need not
    know (a spec that is not one says no)."""
    data = read_json(os.path.join(jdir, SPEC), limit)
    return isinstance(data, dict) and data.get("down") is True


def read_stop(jdir: str) -> StopRequest | None:
    """The stop asked of the job in JDIR (its STOP file), or None where none was asked (or it is not one)."""
    data = read_json(os.path.join(jdir, STOP))
    try:
        return None if data is None else StopRequest.from_dict(data)
    except ValueError:
        return None


def write_state(jdir: str, state: JobState) -> None:
    """STATE as the job's state.json in JDIR (without what the agent's readers add)."""
    data = state.to_dict()
    data.pop("supervisor_alive", None)
    data.pop("status_before_stop", None)
    write_json_atomic(os.path.join(jdir, STATE), data)


def state_with_liveness(path: str) -> JobState | None:
    """A job's state.json, LOST where it says RUNNING and its supervisor is gone. A supervisor writes its last
    state and then exits: a state read before that write, with the death seen after it, is read again first."""
    st = read_state(path)
    if st is None:
        return None
    alive = pid_alive(st.supervisor_pid)
    if st.status == JobStatus.RUNNING and not alive:
        st = read_state(path) or st
        if st.status == JobStatus.RUNNING:
            st.status = JobStatus.LOST  # the supervisor was killed: nobody watches the processes any more
    st.supervisor_alive = alive
    return st


def backoff(looks: int) -> float:
    """How long to wait after LOOKS quiet looks: POLL at first, then longer and longer, IDLE_POLL at most."""
    return min(IDLE_POLL, POLL * 1.5**looks)


class Pace:
    """How long a loop that looks for changes (the supervisor's, a stream's) waits between looks: POLL while
    things happen, then longer and longer while nothing does, up to IDLE_POLL (a quiet job's hundreds of loops on a
    host, or thousands on the emulated pods of one machine, cost little); `wake` ends a wait at once (a signal, a
    process's end, the client's lifeline cut). It wakes through a pipe of its own, not a lock: a signal handler
    runs in the thread that may be waiting, where a threading.Event's lock would be held already."""

    def __init__(self) -> None:
        self.idle = 0
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def busy(self) -> None:
        """Something happened: the next waits are short again."""
        self.idle = 0

    def delay(self) -> float:
        """How long the next wait lasts, at most; each one after a quiet look is longer."""
        delay = backoff(self.idle)
        self.idle = min(self.idle + 1, 16)
        return delay

    def wake(self) -> None:
        """End the wait under way, or the next one (safe in a signal handler and from any thread)."""
        try:
            os.write(self._w, b"!")
        except OSError:
            pass  # full: a wake is pending already

    def wait(self, most: float | None = None) -> None:
        """Wait for the next look (MOST seconds at most: a deadline the loop keeps), or until woken."""
        delay = self.delay()
        if most is not None:
            delay = max(0.0, min(delay, most))
        select.select([self._r], [], [], delay)
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:
            pass  # drained
