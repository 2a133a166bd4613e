"""tpurun's worker agent: starts a job's core processes on this host, logs them, stops them, streams logs.

Shipped to every worker as this single file and run there as `python3 agent.py COMMAND ...`, so it uses
the standard library only (Python >= 3.8) and imports nothing from tpurun. As in torchelastic, a
supervisor owns the processes and writes every line to files first; readers (`stream`) tail the files,
so nothing is lost when the viewer or its SSH session goes away.

Commands (exit 0 on success, 2 bad usage / unknown job, 3 another job runs here, 1 internal error):
  start                      job spec JSON on stdin; prints {"event":"started",...}; returns at once
  stop JOB [--grace S]       stops every core; returns when no process of the job is left; prints state
  stream JOB [--offsets JSON] [--follow] [--attached]
                             framed records (JSON lines) from the per-core .rec files
  jobs                       JSON list of this worker's jobs with their states
  state JOB                  the job's state.json

Files in ~/.tpurun/jobs/<JOB>/ (root overridable with $TPURUN_AGENT_ROOT): spec.json, state.json,
supervisor.log, pre.log, w<W>-c<C>.log (the core's output bytes as printed, stdout and stderr lines in
arrival order) and w<W>-c<C>.rec (one JSON object per line: {"s":"out"|"err","t":UNIX_TIME,"l":TEXT}).

A host launch ("launch": "host" in the spec) starts one process per worker (core HOST, files w<W>.log
and w<W>.rec) with hook/sitecustomize.py (shipped beside this file) first on its PYTHONPATH and the name
of a log socket this supervisor listens on. Each chip process the script's spawner makes connects to it
and becomes a core of the job with its own files, found at run time; the supervisor watches it by pid.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

TERMINAL = ("finished", "stopped", "failed", "lost")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
POLL = 0.02  # seconds between checks when nothing happens (supervisor and stream)
CHUNK = 4 << 20  # bytes read from a .rec file at once: big reads are what make streaming fast
MAX_LINE = 8 << 20  # a line longer than this is cut into records rather than held in memory
DEFAULT_GRACE = 5.0
DEFAULT_PRE_TIMEOUT = 300.0
DEFAULT_LEASE = 60.0  # attached jobs: no stream alive for this long means the client is gone
# faulthandler's names of the fatal signals it reports (a chip process's exit status, as the shell shows it)
FATAL_SIGNALS = {
    "Segmentation fault": int(signal.SIGSEGV),
    "Aborted": int(signal.SIGABRT),
    "Bus error": int(signal.SIGBUS),
    "Floating point exception": int(signal.SIGFPE),
    "Illegal instruction": int(signal.SIGILL),
}
HOST = -1  # core index of a host launch's one process per worker (see tpurun.job.plan.HOST)
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook")


class AgentError(Exception):
    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------- files and processes


def agent_root() -> str:
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


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _proc_stat(pid: int) -> list[str] | None:
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
    stat = _proc_stat(pid)
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
        stat = _proc_stat(int(name))
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


def log_base(jdir: str, worker: int, core: int) -> str:
    """Path of a core's files without extension: w<W>-c<C>, or w<W> for a host launch's own process."""
    return os.path.join(jdir, f"w{worker}" if core == HOST else f"w{worker}-c{core}")


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


def _watch_exit(c: Core, pid: int) -> None:
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
            c.note_end(pid)
        finally:
            os.close(fd)

    threading.Thread(target=wait, daemon=True).start()


def _pdeathsig_preexec():
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


def now() -> float:
    return time.time()


# ---------------------------------------------------------------- the supervisor


class Core:
    """One core process of the job, its log files and the threads that fill them."""

    def __init__(self, worker: int, spec: dict, jdir: str) -> None:
        self.worker = worker
        self.index = int(spec["core"])
        self.argv = [str(a) for a in spec.get("argv") or []]
        self.env = {str(k): str(v) for k, v in (spec.get("env") or {}).items()}
        self.cwd = os.path.expanduser(spec.get("cwd") or "~")
        base = log_base(jdir, worker, self.index)
        self.log = open(base + ".log", "ab")
        self.rec = open(base + ".rec", "ab")
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.pgid: int | None = None
        self.status = "pending"
        self.exit_code: int | None = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.exited_at: float | None = None  # when the process ended, before its output was drained
        self.last_line = ""
        self.signalled = False
        self.readers: list[threading.Thread] = []
        self.spawned = False  # a chip process of a host launch: made by the script's spawner, not by us
        self.reported: int | None = None  # how its spawner task ended, as the hook reported (0 ok, 1 failed)
        self.pids: list[int] = []  # a chip's processes (one per round of the spawner)
        self.died_at: dict[int, float] = {}  # pid -> when it was seen to end (pidfd: at once)
        self.ctl_done = False  # its report stream is closed: `reported` is final
        self.pool = False  # its replica runs as a process-pool task, whose end the hook reports

    def start(self, preexec, job: str) -> None:
        env = dict(os.environ)
        env.update(self.env)
        env["TPURUN_JOB_ID"] = job  # how the agent finds every process of the job (job_processes)
        self.started_at = now()
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own process group: signals reach its whole tree
                preexec_fn=preexec,
            )
        except OSError as e:
            # Recorded as exit 127 (the shell's "command not found"); the supervisor fails the job fast.
            self.write("err", f"tpurun agent: cannot start {self.argv}: {e}\n".encode())
            return
        self.pid = self.pgid = self.proc.pid
        self.status = "running"

    def start_readers(self) -> None:
        if self.proc is None:
            return
        for stream, pipe in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            self.add_reader(stream, pipe)

    def add_reader(self, stream: str, pipe) -> None:
        t = threading.Thread(target=self._pump, args=(stream, pipe), daemon=True)
        t.start()
        self.readers.append(t)

    def _pump(self, stream: str, pipe) -> None:
        # Whatever the pipe holds is written at once (every complete line of it, then flushed): no line
        # ever waits in a buffer for more output, and a flood costs one write per chunk, not per line.
        read = pipe.read1 if hasattr(pipe, "read1") else pipe.read
        rest = b""
        try:
            while True:
                try:
                    chunk = read(1 << 16)
                except OSError:  # a chip process's socket, reset as it died
                    chunk = b""
                if not chunk:
                    break
                data = rest + chunk
                cut = data.rfind(b"\n") + 1
                if cut == 0 and len(data) < MAX_LINE:
                    rest = data
                    continue
                if cut == 0:  # an endless line: cut it into records rather than hold it all
                    lines, rest = [data], b""
                else:
                    lines = [line + b"\n" for line in data[:cut].split(b"\n")[:-1]]
                    rest = data[cut:]
                self.write_lines(stream, lines)
            if rest:
                self.write_lines(stream, [rest])  # the partial last line, at EOF
        finally:
            pipe.close()

    def write(self, stream: str, raw: bytes) -> None:
        self.write_lines(stream, [raw])

    def write_lines(self, stream: str, lines: list[bytes]) -> None:
        tag = stream.encode()
        raws = []
        recs = []
        with self.lock:
            if self.log.closed:
                return  # the job's end is written; late bytes of a vanished process are dropped
            t = now()  # taken under the lock so a core's records are in time order
            for raw in lines:
                if not raw.endswith(b"\n"):
                    raw += b"\n"  # a partial last line: terminated so it never merges with the other stream
                text = raw[:-1].decode("utf-8", "backslashreplace")
                raws.append(raw)
                recs.append(b'{"s":"%s","t":%.6f,"l":%s}\n' % (tag, t, json.dumps(text).encode()))
            self.log.write(b"".join(raws))
            self.log.flush()
            self.rec.write(b"".join(recs))
            self.rec.flush()
            for raw in reversed(raws):
                if raw.strip():
                    self.last_line = raw[:-1].decode("utf-8", "backslashreplace")[-500:]
                    break

    def note_end(self, pid: int) -> None:
        """PID of this chip was seen to end now (or earlier, by another witness)."""
        t = now()
        self.died_at[pid] = min(self.died_at.get(pid, t), t)

    def readers_done(self) -> bool:
        return not any(t.is_alive() for t in self.readers)

    def to_dict(self) -> dict:
        return {
            "core": self.index,
            "pid": self.pid,
            "pgid": self.pgid,
            "status": self.status,
            "exit_code": self.exit_code,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "last_line": self.last_line,
            "argv": self.argv,
            "spawned": self.spawned,
        }


class Supervisor:
    """Owns one job on this worker: pre-commands, one process per core, fail-fast, stop, state.json."""

    def __init__(self, spec: dict, jdir: str) -> None:
        self.spec = spec
        self.jdir = jdir
        self.job = spec["job_id"]
        self.worker = int(spec.get("worker", 0))
        self.grace = float(spec.get("grace", DEFAULT_GRACE))
        self.detach = bool(spec.get("detach", False))
        lease = spec.get("lease_timeout", None if self.detach else DEFAULT_LEASE)
        self.lease = float(lease) if lease else None
        self.cores = [Core(self.worker, c, jdir) for c in spec["cores"]]
        self.launch = str(spec.get("launch", "chip"))
        self.cores_lock = threading.Lock()  # the log server adds chip cores while the loop runs
        self.listener: socket.socket | None = None
        self.dirty = False  # a chip core appeared: state.json must show it (readers find its files there)
        self.closed = False  # finish() ran: no new chip cores
        self.pre_groups: list[int] = []
        self.status = "running"  # stays "running" until every process is gone: readers trust an end status
        self.outcome: str | None = None  # the end status decided by a stop (stopped/failed), applied at the end
        self.reason = ""
        self.first_failure: dict | None = None
        self.started_at = now()
        self.ended_at: float | None = None
        self.stop_requested = False
        self.stop_deadline: float | None = None
        self.killed = False

    def snapshot(self) -> list[Core]:
        with self.cores_lock:
            return list(self.cores)

    def host_core(self) -> Core | None:
        return next((c for c in self.snapshot() if c.index == HOST), None)

    # --- host launch: the chip processes' log socket

    def use_hook(self) -> None:
        """Put the hook first on every core's PYTHONPATH (it only acts when the job asks it to)."""
        if not os.path.isfile(os.path.join(HOOK_DIR, "sitecustomize.py")):
            self.log(f"no hook in {HOOK_DIR}: chip processes will log as the host process, no --metrics")
            return
        for c in self.snapshot():
            path = c.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            c.env["PYTHONPATH"] = HOOK_DIR + (os.pathsep + path if path else "")
            c.env["TPURUN_SUPERVISOR_PID"] = str(os.getpid())  # the hook's test for "started by the agent"
            c.env["TPURUN_JOB_DIR"] = self.jdir  # where the hook writes --metrics reports

    def open_log_socket(self) -> None:
        """Listen for the chip processes of a host launch; the host process learns the name from its env."""
        name = f"tpurun-{self.job}-{secrets.token_hex(8)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + name)  # abstract: nothing on disk; peers are checked on accept
        self.listener.listen(256)
        for c in self.snapshot():
            c.env["TPURUN_LOG_SOCKET"] = name

    def serve_log_socket(self) -> None:
        listener = self.listener
        if listener is None:
            return

        def accept_loop() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return  # closed at the end of the job
                threading.Thread(target=self._attach, args=(conn,), daemon=True).start()

        threading.Thread(target=accept_loop, daemon=True).start()

    def _attach(self, conn: socket.socket) -> None:
        """One stream (out, err or ctl) of a chip process: check who it is, then file it under its core."""
        try:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid() or not of_job(pid, self.job):
                raise ValueError(f"refused a log connection from pid {pid} (uid {uid}): not a process of this job")
            conn.settimeout(10)
            f = conn.makefile("rb")
            header = json.loads(f.readline(4096) or b"null")
            conn.settimeout(None)
            core, stream = int(header["core"]), str(header["stream"])
            if core < 0 or stream not in ("out", "err", "ctl"):
                raise ValueError(f"refused a log connection from pid {pid}: {header}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.log(f"log socket: {e}")
            conn.close()
            return
        c = self.chip(core, pid, bool(header.get("pool")))
        if c is None:  # the job is over
            conn.close()
            return
        try:
            conn.sendall(b"ok\n")  # the hook moves its output here only once accepted
        except OSError:
            conn.close()
            return
        conn.close()  # f keeps the descriptor open until the reader closes it
        if stream == "ctl":
            t = threading.Thread(target=self._read_ctl, args=(c, pid, f), daemon=True)
            t.start()
            c.readers.append(t)
        else:
            c.add_reader(stream, f)

    def chip(self, index: int, pid: int, pool: bool) -> Core | None:
        """The core of chip INDEX, made the first time one of its processes connects (None once the job
        is over). A new process on a known chip is the spawner's next round (Lightning: fit, then test)."""
        with self.cores_lock:
            if self.closed:
                return None
            c = next((x for x in self.cores if x.index == index), None)
            if c is None:
                c = Core(self.worker, {"core": index}, self.jdir)
                c.spawned = True
                self.cores.append(c)
            if pid not in c.pids:
                c.pids.append(pid)
                c.pid = pid
                c.started_at = now()
                c.exited_at = c.ended_at = c.exit_code = c.reported = None
                c.ctl_done, c.pool = False, pool
                c.died_at.clear()
                stat = _proc_stat(pid)
                c.pgid = int(stat[2]) if stat and len(stat) > 2 else c.pgid
                c.status = "running"
                _watch_exit(c, pid)
                self.dirty = True
                self.log(f"chip {index}: process {pid} (group {c.pgid}) of the script's spawner")
        return c

    def _read_ctl(self, c: Core, pid: int, f) -> None:
        # EOF here is the process's exit (or its last forked child's): a witness of when it ended even
        # where it ended before a pidfd could be opened for it
        try:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    # faulthandler's report of a fatal signal: into the chip's log, and it crashed
                    c.write("err", line)
                    crash = re.match(rb"Fatal Python error: (.*)", line)
                    if crash:
                        c.reported = -FATAL_SIGNALS.get(crash.group(1).strip().decode(errors="replace"), 0) or 1
                    continue
                if not isinstance(event, dict):
                    continue
                if event.get("event") == "ok" and c.reported is None:
                    c.reported = 0
                elif event.get("event") == "failed":
                    c.reported = int(event.get("code") or 1)
        except OSError:
            pass  # reset by a process that died: the same as its end
        finally:
            c.note_end(pid)
            c.ctl_done = True
            f.close()

    def watch_chip(self, c: Core) -> bool:
        """Follow a chip process of a host launch (not our child: by pid and by what the hook reports).
        True when its end was recorded."""
        if c.reported not in (None, 0) and self.stop_deadline is None:
            # its spawner task failed: stop now, the spawner would wait for every sibling first
            self.first_failure = {"worker": self.worker, "core": c.index, "exit_code": c.reported}
            self.request_stop(f"chip {c.index} failed", "failed")
        if c.ended_at is not None:
            return False
        if c.exited_at is None:
            if any(pid_alive(p) for p in c.pids):
                return False
            c.exited_at = now()
            for p in c.pids:
                c.note_end(p)
        host = self.host_core()
        if c.reported is None and c.ctl_done and c.pool and host is not None and host.status == "running":
            self.blame_died("while its spawner ran")
        if not (c.readers_done() or now() - c.exited_at > self.grace + 2):
            return False
        if c.reported is not None:
            c.exit_code, c.status = c.reported, ("exited" if c.reported == 0 else "failed")
        elif host is not None and host.pid in c.pids:
            if host.exit_code is None and host.status == "running":
                return False  # the host process was the chip (nprocs=1): its exit code decides
            c.exit_code, c.status = host.exit_code, host.status
        elif (self.first_failure or {}).get("core") == c.index:
            c.status = "died"
        elif self.stop_deadline is not None:
            c.status = "killed"
        else:
            c.exit_code, c.status = (host.exit_code if host else None), "exited"
        c.ended_at = now()
        self.log(f"chip {c.index} ended: {c.status} ({c.exit_code})")
        return True

    def blame_died(self, why: str) -> bool:
        """Chip processes ended without reporting how (killed or crashed; their exit status is their
        parent's to read): blame the one that ended first, as a pool then kills the others. True if any."""
        if self.stop_deadline is not None:
            return False
        host = self.host_core()
        gone = [
            x
            for x in self.snapshot()
            if x.spawned
            and x.pool
            and x.reported is None
            and x.pids
            and (host is None or host.pid not in x.pids)
            and not any(pid_alive(p) for p in x.pids)
        ]
        reported = [x for x in self.snapshot() if x.spawned and x.reported not in (None, 0)]
        if reported:  # a chip that said it failed or crashed comes before any that just vanished
            gone = reported
        if not gone:
            return False
        for x in gone:
            for p in x.pids:
                x.note_end(p)
        first = min(gone, key=lambda x: min(x.died_at.values(), default=now()))
        self.first_failure = {"worker": self.worker, "core": first.index, "exit_code": first.reported}
        self.request_stop(f"chip {first.index} died {why}", "failed")
        return True

    # --- state

    def state(self) -> dict:
        return {
            "job_id": self.job,
            "worker": self.worker,
            "supervisor_pid": os.getpid(),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "status": self.status,
            "stopping": self.stop_deadline is not None and self.status == "running",
            "detach": self.detach,
            "launch": self.launch,
            "reason": self.reason,
            "first_failure": self.first_failure,
            "cores": [c.to_dict() for c in self.snapshot()],
        }

    def save(self) -> None:
        write_json_atomic(os.path.join(self.jdir, "state.json"), self.state())

    def log(self, message: str) -> None:
        sys.stderr.write(time.strftime("%Y-%m-%dT%H:%M:%S ") + message + "\n")
        sys.stderr.flush()

    # --- phases

    def run_pre_commands(self) -> bool:
        """xla_dist-style setup commands (the XRT server). A plain argv list runs to completion; an object
        {"argv": [...], "wait": false} is a service kept alive until the job ends."""
        pre = self.spec.get("pre_commands") or []
        if not pre:
            return True
        with open(os.path.join(self.jdir, "pre.log"), "ab") as out:
            for item in pre:
                argv = item["argv"] if isinstance(item, dict) else item
                wait = item.get("wait", True) if isinstance(item, dict) else True
                self.log(f"pre-command {argv}")
                try:
                    p = subprocess.Popen(
                        [str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
                    )
                except OSError as e:
                    self.reason = f"pre-command {argv} could not start: {e}"
                    return False
                self.pre_groups.append(p.pid)
                if not wait:
                    continue
                deadline = now() + float(self.spec.get("pre_timeout", DEFAULT_PRE_TIMEOUT))
                while p.poll() is None and now() < deadline and not self.stop_requested:
                    time.sleep(POLL)
                code = p.poll()
                if code is None:
                    signal_group(p.pid, signal.SIGKILL)
                    p.wait()
                    self.reason = (
                        f"stopped during pre-command {argv}"
                        if self.stop_requested
                        else f"pre-command {argv} did not finish in time"
                    )
                    return False
                if code != 0:
                    self.reason = f"pre-command {argv} exited {code} (see pre.log)"
                    return False
        return True

    def start_cores(self) -> None:
        preexec = _pdeathsig_preexec()
        # Every process first, then the reader threads: preexec_fn is only safe while we have no threads.
        for c in self.snapshot():
            c.start(preexec, self.job)
            self.log(f"core {c.index} started: pid {c.pid} argv {c.argv}")
        for c in self.snapshot():
            c.start_readers()
        for c in self.snapshot():
            if c.proc is None:
                self.on_exit(c, 127)

    def request_stop(self, reason: str, status: str) -> None:
        if self.stop_deadline is not None:
            return
        grace = self.grace
        req = read_json(os.path.join(self.jdir, "stop.json"))
        if req and req.get("grace") is not None:
            grace = float(req["grace"])
        self.outcome = self.outcome or status
        self.reason = self.reason or reason
        self.stop_deadline = now() + grace
        self.log(f"stopping ({reason}): SIGTERM to every core, SIGKILL after {grace:.1f} s")
        for c in self.snapshot():
            if c.status == "running":
                c.signalled = True
            signal_group(c.pgid, signal.SIGTERM)
        signal_pids(job_processes(self.job), signal.SIGTERM)  # those that left their group

    def on_exit(self, c: Core, rc: int) -> None:
        c.exited_at = now()
        c.exit_code = rc
        c.status = "killed" if c.signalled else "exited"
        self.log(f"core {c.index} exited with {rc}")
        # Whatever the core left behind in its group (children, data loaders) would hold the TPU.
        if group_members(c.pgid):
            signal_group(c.pgid, signal.SIGTERM)
        if rc != 0 and self.stop_deadline is None:
            if c.index == HOST and self.blame_died(f"before its spawner failed with {rc}"):
                return
            self.first_failure = {"worker": self.worker, "core": c.index, "exit_code": rc}
            self.request_stop(f"core {c.index} exited with {rc}", "failed")

    def loop(self) -> None:
        while True:
            if self.stop_requested and self.stop_deadline is None:
                self.request_stop("stop requested", "stopped")
            changed = False
            for c in self.snapshot():
                if c.spawned:
                    changed = self.watch_chip(c) or changed
                    continue
                if c.status == "running" and c.proc is not None:
                    rc = c.proc.poll()
                    if rc is not None:
                        self.on_exit(c, rc)
                if c.ended_at is None and c.exited_at is not None:
                    # Record the end only once its output is in the files, so a reader that sees the end
                    # in state.json and then drains the .rec file has every line (bounded wait).
                    if c.readers_done() or now() - c.exited_at > self.grace + 2:
                        c.ended_at = now()
                        changed = True
            if self.stop_deadline is not None and now() >= self.stop_deadline:
                # each round after the deadline: a spawner that is dying may still have started one more
                if not self.killed:
                    self.log("grace period over: SIGKILL to what is left")
                self.killed = True
                for c in self.snapshot():
                    if group_members(c.pgid):
                        signal_group(c.pgid, signal.SIGKILL)
                signal_pids(job_processes(self.job), signal.SIGKILL)
            if self.lease and self.stop_deadline is None and self._lease_expired():
                self.request_stop(f"the attached client is gone (no stream for {self.lease:.0f} s)", "stopped")
            if changed or self.dirty:
                self.dirty = False
                self.save()
            if all(c.ended_at is not None for c in self.snapshot()):
                leftovers = [c.pgid for c in self.snapshot() if group_members(c.pgid)] or job_processes(self.job)
                if not leftovers:
                    break
                if self.stop_deadline is None:  # every core ended but children linger: clean them up
                    self.request_stop("processes left behind by exited cores", "")
            time.sleep(POLL)

    def _lease_expired(self) -> bool:
        try:
            last = os.stat(os.path.join(self.jdir, "attached")).st_mtime
        except OSError:
            last = self.started_at
        return now() - last > self.lease  # type: ignore[operator]

    def finish(self) -> None:
        with self.cores_lock:
            self.closed = True
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            except OSError:
                pass
            self.listener.close()
        for pgid in self.pre_groups:
            signal_group(pgid, signal.SIGTERM)
        deadline = now() + min(self.grace, 5.0)
        while any(group_members(g) for g in self.pre_groups) and now() < deadline:
            time.sleep(POLL)
        for pgid in self.pre_groups:
            signal_group(pgid, signal.SIGKILL)
        host = self.host_core()
        for c in self.snapshot():
            if c.spawned and c.status == "exited" and c.exit_code is None and host is not None:
                c.exit_code = host.exit_code  # ended unreported before its spawner: the spawner's verdict
        if self.status == "running":
            ok = all(c.exit_code == 0 for c in self.snapshot())
            self.status = self.outcome or ("finished" if ok else "failed")
        self.ended_at = now()
        self.save()
        self.log(f"job {self.status}")
        for c in self.snapshot():
            with c.lock:  # a reader still draining a dead chip's socket stops writing (write_lines checks)
                c.log.close()
                c.rec.close()

    def run(self, notify_fd: int) -> None:
        def on_term(signum, frame):
            self.stop_requested = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.save()
        if not self.run_pre_commands():
            self.log(self.reason)
            self.status = "failed"
            for c in self.snapshot():
                c.status, c.ended_at = "exited", now()
            self.finish()
            self._notify(notify_fd, {"event": "failed", "job": self.job, "reason": self.reason})
            return
        self.use_hook()
        if self.launch == "host":
            self.open_log_socket()
        self.start_cores()
        self.serve_log_socket()  # threads only now: start_cores forks with a preexec_fn
        self.save()
        self._notify(
            notify_fd,
            {
                "event": "started",
                "job": self.job,
                "worker": self.worker,
                "supervisor_pid": os.getpid(),
                "cores": [c.to_dict() for c in self.snapshot()],
            },
        )
        self.loop()
        self.finish()

    @staticmethod
    def _notify(fd: int, message: dict) -> None:
        try:
            os.write(fd, (json.dumps(message) + "\n").encode())
            os.close(fd)
        except OSError:
            pass


# ---------------------------------------------------------------- commands


def _running_jobs(exclude: str) -> list[str]:
    root = agent_root()
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name == exclude:
            continue
        st = read_json(os.path.join(root, name, "state.json"))
        if not st or st.get("status") in TERMINAL:
            continue
        starting = st.get("status") == "starting" and now() - float(st.get("started_at") or 0) < 120
        if starting or pid_alive(st.get("supervisor_pid")):
            found.append(name)
    return found


def cmd_start(args) -> int:
    try:
        spec = json.loads(sys.stdin.read())
    except ValueError as e:
        raise AgentError(f"the job spec on stdin is not JSON: {e}") from e
    if not isinstance(spec, dict) or not spec.get("job_id") or not spec.get("cores"):
        raise AgentError("the job spec needs job_id and a non-empty cores list")
    jdir = job_dir(str(spec["job_id"]))
    os.makedirs(agent_root(), exist_ok=True)
    import fcntl  # Unix only, like the rest of the supervisor

    with open(os.path.join(agent_root(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two concurrent starts must not both see "nothing running"
        if not spec.get("allow_concurrent"):
            busy = _running_jobs(exclude=str(spec["job_id"]))
            if busy:
                sys.stderr.write(
                    f"job {busy[0]} is still running on this worker: `tpurun cancel {busy[0]}` first, or wait\n"
                )
                return 3
        if os.path.exists(os.path.join(jdir, "state.json")):
            raise AgentError(f"job {spec['job_id']} already exists on this worker")
        os.makedirs(jdir, exist_ok=True)
        write_json_atomic(os.path.join(jdir, "spec.json"), spec)
        write_json_atomic(
            os.path.join(jdir, "state.json"),
            {
                "job_id": spec["job_id"],
                "worker": spec.get("worker", 0),
                "status": "starting",
                "supervisor_pid": None,
                "started_at": now(),
                "cores": [],
            },
        )
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # intermediate child: new session, then fork the supervisor and leave
            try:
                os.close(rfd)
                os.setsid()
                if os.fork() != 0:
                    os._exit(0)
                _become_daemon(jdir, keep=wfd)
                Supervisor(spec, jdir).run(wfd)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        os.close(wfd)
        os.waitpid(pid, 0)
    with os.fdopen(rfd) as r:
        line = r.readline()
    if not line:
        tail = _tail(os.path.join(jdir, "supervisor.log"))
        raise AgentError(f"the supervisor of job {spec['job_id']} died while starting: {tail}", code=1)
    msg = json.loads(line)
    print(json.dumps(msg), flush=True)
    return 0 if msg.get("event") == "started" else 1


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, "rb") as f:
            return " | ".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
    except OSError:
        return "(no supervisor.log)"


def _become_daemon(jdir: str, keep: int) -> None:
    """Detach from the SSH session: its stdin/stdout/stderr and every other inherited descriptor."""
    os.chdir(jdir)
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.open(os.path.join(jdir, "supervisor.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(log, 2)
    for fd in (devnull, log):
        os.close(fd)
    try:
        maxfd = os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        maxfd = 1024
    os.closerange(3, keep)
    os.closerange(keep + 1, maxfd)
    sys.stdout = open(os.devnull, "w")
    sys.stderr = os.fdopen(2, "w", buffering=1)


def _load_state(job: str) -> dict:
    jdir = job_dir(job)
    st = read_json(os.path.join(jdir, "state.json"))
    if st is None:
        raise AgentError(f"no job {job} on this worker")
    return _with_liveness(st)


def _with_liveness(st: dict) -> dict:
    alive = pid_alive(st.get("supervisor_pid"))
    st["supervisor_alive"] = alive
    if st.get("status") == "running" and not alive:
        st["status"] = "lost"  # the supervisor was killed: nobody watches the cores any more
    return st


def cmd_state(args) -> int:
    print(json.dumps(_load_state(args.job), sort_keys=True))
    return 0


def cmd_jobs(args) -> int:
    root = agent_root()
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        st = read_json(os.path.join(root, name, "state.json"))
        if st is not None:
            out.append(_with_liveness(st))
    print(json.dumps(out, sort_keys=True))
    return 0


def stop_job(job: str, grace: float | None) -> dict:
    """Stop JOB and return once none of its processes is left (the supervisor's own escalation first,
    ours if it is gone or hangs)."""
    jdir = job_dir(job)
    st = _load_state(job)
    before = st.get("status")
    if grace is None:
        grace = float((read_json(os.path.join(jdir, "spec.json")) or {}).get("grace", DEFAULT_GRACE))
    sup = st.get("supervisor_pid")
    if st.get("status") == "starting" and not sup:
        deadline = now() + 10
        while now() < deadline and not st.get("supervisor_pid"):
            time.sleep(POLL)
            st = _load_state(job)
        sup = st.get("supervisor_pid")
    if sup and pid_alive(sup):
        write_json_atomic(os.path.join(jdir, "stop.json"), {"grace": grace, "at": now()})
        try:
            os.kill(sup, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = now() + grace + 10
    pgids = [c.get("pgid") for c in st.get("cores", [])]
    killed = False
    while True:
        st = _load_state(job)
        pgids = list({*pgids, *(c.get("pgid") for c in st.get("cores", []))})
        sup_alive = st["supervisor_alive"]
        left = [g for g in pgids if group_members(g)]
        marked = job_processes(job)
        if not sup_alive and not left and not marked:
            break
        if not sup_alive or now() > deadline:
            # nobody else will: SIGKILL what is left (again each round: a dying spawner may start more)
            for g in left:
                signal_group(g, signal.SIGKILL)
            signal_pids(marked, signal.SIGKILL)
            if not killed and sup_alive and sup:
                os.kill(sup, signal.SIGKILL)
            if not killed:
                killed = True
            elif now() > deadline + 10:
                raise AgentError(f"processes of job {job} survive SIGKILL: {left + marked}", code=1)
        time.sleep(POLL)
    if st.get("status") not in TERMINAL or st.get("status") == "lost":
        # The supervisor did not write the end (it was killed): record it ourselves.
        st["status"] = "stopped"
        st["ended_at"] = now()
        for c in st.get("cores", []):
            if c.get("status") == "running":
                c["status"], c["ended_at"] = "killed", now()
        st.pop("supervisor_alive", None)
        write_json_atomic(os.path.join(jdir, "state.json"), st)
        st["supervisor_alive"] = False
    st["status_before_stop"] = before
    return st


def cmd_stop(args) -> int:
    print(json.dumps(stop_job(args.job, args.grace), sort_keys=True), flush=True)
    return 0


class _RecReader:
    """Tails one core's .rec file from a byte offset; yields complete records only."""

    def __init__(self, worker: int, core: int, path: str, offset: int) -> None:
        self.prefix = b'{"w":%d,"c":%d,"o":' % (worker, core)
        self.path = path
        self.offset = offset  # bytes of the file consumed (complete records only)
        self.f: io.BufferedReader | None = None
        self.pending = b""

    def read(self) -> list[tuple[float, bytes]]:
        if self.f is None:
            try:
                self.f = open(self.path, "rb")
            except OSError:
                return []
            self.f.seek(self.offset)
        chunk = self.f.read(CHUNK)
        if not chunk:
            return []
        data = self.pending + chunk
        cut = data.rfind(b"\n") + 1
        self.pending = data[cut:]
        out = []
        off = self.offset
        prefix = self.prefix
        for line in data[:cut].split(b"\n")[:-1]:
            off += len(line) + 1
            # The record is '{"s":"out","t":T,...': splice our fields in front instead of re-encoding JSON.
            tend = line.find(b",", 15)
            try:
                t = float(line[15:tend])
            except ValueError:
                t = 0.0
            out.append((t, prefix + b"%d," % off + line[1:] + b"\n"))
        self.offset = off
        return out


def cmd_stream(args) -> int:
    jdir = job_dir(args.job)
    st = _load_state(args.job)
    spec = read_json(os.path.join(jdir, "spec.json")) or {}
    worker = int(spec.get("worker", st.get("worker", 0)))
    offsets = {}
    if args.offsets:
        try:
            offsets = {int(k): int(v) for k, v in json.loads(args.offsets).items()}
        except (ValueError, AttributeError) as e:
            raise AgentError(f"--offsets must be a JSON object {{core: byte offset}}: {e}") from e
    cores: list[int] = []
    readers: dict[int, _RecReader] = {}

    def follow_cores(state: dict) -> None:
        # a host launch's chip cores appear while it runs
        for c in [int(c["core"]) for c in spec.get("cores", [])] + [int(c["core"]) for c in state.get("cores", [])]:
            if c not in readers:
                cores.append(c)
                readers[c] = _RecReader(worker, c, log_base(jdir, worker, c) + ".rec", offsets.get(c, 0))

    follow_cores(st)
    out = sys.stdout.buffer
    stdin_closed = threading.Event()
    if args.attached:
        _watch_stdin(stdin_closed)
        lease = os.path.join(jdir, "attached")
        signal.signal(signal.SIGHUP, lambda s, f: stdin_closed.set())
        signal.signal(signal.SIGTERM, lambda s, f: stdin_closed.set())
    else:
        signal.signal(signal.SIGHUP, lambda s, f: sys.exit(0))
    reported: dict[int, float] = {}  # core -> the end sent (a chip may run again: the spawner's next round)
    stopping = False
    last_touch = 0.0
    try:
        while True:
            st = _load_state(args.job)  # read before draining: lines precede the state that ends a core
            follow_cores(st)
            got = _drain(readers, out, until_empty=False)
            ended = {int(c["core"]): c for c in st.get("cores", []) if c.get("ended_at") is not None}
            for c in cores:
                if c in ended and reported.get(c) != ended[c]["ended_at"]:
                    _drain(readers, out, only=c)
                    rec = {
                        "event": "exit",
                        "w": worker,
                        "c": c,
                        "code": ended[c].get("exit_code"),
                        "status": ended[c].get("status"),
                    }
                    out.write((json.dumps(rec) + "\n").encode())
                    reported[c] = ended[c]["ended_at"]
            over = st.get("status") in TERMINAL and all(c in reported for c in cores)
            if over:
                _drain(readers, out)
                out.write((json.dumps({"event": "done", "w": worker, "state": st}) + "\n").encode())
                out.flush()
                return 0
            out.flush()
            if not args.follow:
                return 0
            if args.attached:
                if now() - last_touch > 1.0:
                    _touch(lease)
                    last_touch = now()
                if stdin_closed.is_set() and not stopping:
                    stopping = True
                    _stop_async(args.job)
            if not got:
                time.sleep(POLL)
    except BrokenPipeError:
        # The client is gone. An attached job goes with it; a detached one keeps running.
        _silence_stdout()
        if args.attached:
            stop_job(args.job, None)
        return 0


def _drain(readers: dict, out, only: int | None = None, until_empty: bool = True) -> bool:
    """Write the complete records now readable (one chunk per core, or until none is left), merged
    across cores by time. True if there were any."""
    any_data = False
    while True:
        batches = [r.read() for c, r in readers.items() if only is None or c == only]
        batches = [b for b in batches if b]
        if not batches:
            return any_data
        any_data = True
        if len(batches) == 1:
            out.write(b"".join(rec for _, rec in batches[0]))
        else:
            import heapq

            out.write(b"".join(rec for _, rec in heapq.merge(*batches, key=lambda x: x[0])))
        if not until_empty:
            return True


def _watch_stdin(closed: threading.Event) -> None:
    def watch() -> None:
        # os.read on the raw descriptor: a daemon thread blocked inside sys.stdin's buffered reader
        # would hold its lock and abort the interpreter at exit.
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        closed.set()

    threading.Thread(target=watch, daemon=True).start()


def _stop_async(job: str) -> None:
    # Stop in the background and keep streaming: the client that closed stdin on purpose (Ctrl-C)
    # still reads the last lines and the final "done" record.
    threading.Thread(target=lambda: _quiet_stop(job), daemon=True).start()


def _quiet_stop(job: str) -> None:
    try:
        stop_job(job, None)
    except AgentError:
        pass


def _touch(path: str) -> None:
    try:
        with open(path, "a"):
            pass
        os.utime(path, None)
    except OSError:
        pass


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent.py", description="tpurun worker agent")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("start", help="start a job from the JSON spec on stdin")
    p = sub.add_parser("stop", help="stop a job and wait until none of its processes is left")
    p.add_argument("job")
    p.add_argument("--grace", type=float, default=None)
    p = sub.add_parser("stream", help="framed records of a job's output")
    p.add_argument("job")
    p.add_argument("--offsets", default=None, help='JSON {"CORE": byte offset in w<W>-c<CORE>.rec}')
    p.add_argument("--follow", action="store_true")
    p.add_argument("--attached", action="store_true", help="stop the job when stdin reaches EOF")
    sub.add_parser("jobs", help="every job on this worker")
    p = sub.add_parser("state", help="a job's state")
    p.add_argument("job")
    args = parser.parse_args(argv)
    commands = {"start": cmd_start, "stop": cmd_stop, "stream": cmd_stream, "jobs": cmd_jobs, "state": cmd_state}
    if args.command not in commands:
        parser.print_usage(sys.stderr)
        return 2
    try:
        return commands[args.command](args)
    except AgentError as e:
        sys.stderr.write(f"tpurun agent: {e}\n")
        return e.code


if __name__ == "__main__":
    sys.exit(main())
