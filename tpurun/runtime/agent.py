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
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
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
        self.argv = [str(a) for a in spec["argv"]]
        self.env = {str(k): str(v) for k, v in (spec.get("env") or {}).items()}
        self.cwd = os.path.expanduser(spec.get("cwd") or "~")
        base = os.path.join(jdir, f"w{worker}-c{self.index}")
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

    def start(self, preexec) -> None:
        env = dict(os.environ)
        env.update(self.env)
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
                chunk = read(1 << 16)
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
            "reason": self.reason,
            "first_failure": self.first_failure,
            "cores": [c.to_dict() for c in self.cores],
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
        for c in self.cores:
            c.start(preexec)
            self.log(f"core {c.index} started: pid {c.pid} argv {c.argv}")
        for c in self.cores:
            c.start_readers()
        for c in self.cores:
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
        for c in self.cores:
            if c.status == "running":
                c.signalled = True
            signal_group(c.pgid, signal.SIGTERM)

    def on_exit(self, c: Core, rc: int) -> None:
        c.exited_at = now()
        c.exit_code = rc
        c.status = "killed" if c.signalled else "exited"
        self.log(f"core {c.index} exited with {rc}")
        # Whatever the core left behind in its group (children, data loaders) would hold the TPU.
        if group_members(c.pgid):
            signal_group(c.pgid, signal.SIGTERM)
        if rc != 0 and self.stop_deadline is None:
            self.first_failure = {"worker": self.worker, "core": c.index, "exit_code": rc}
            self.request_stop(f"core {c.index} exited with {rc}", "failed")

    def loop(self) -> None:
        while True:
            if self.stop_requested and self.stop_deadline is None:
                self.request_stop("stop requested", "stopped")
            changed = False
            for c in self.cores:
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
            if self.stop_deadline is not None and not self.killed and now() >= self.stop_deadline:
                self.killed = True
                for c in self.cores:
                    if group_members(c.pgid):
                        self.log(f"core {c.index}: SIGKILL to group {c.pgid}")
                        signal_group(c.pgid, signal.SIGKILL)
            if self.lease and self.stop_deadline is None and self._lease_expired():
                self.request_stop(f"the attached client is gone (no stream for {self.lease:.0f} s)", "stopped")
            if changed:
                self.save()
            if all(c.ended_at is not None for c in self.cores):
                leftovers = [c for c in self.cores if group_members(c.pgid)]
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
        for pgid in self.pre_groups:
            signal_group(pgid, signal.SIGTERM)
        deadline = now() + min(self.grace, 5.0)
        while any(group_members(g) for g in self.pre_groups) and now() < deadline:
            time.sleep(POLL)
        for pgid in self.pre_groups:
            signal_group(pgid, signal.SIGKILL)
        if self.status == "running":
            ok = all(c.exit_code == 0 for c in self.cores)
            self.status = self.outcome or ("finished" if ok else "failed")
        self.ended_at = now()
        self.save()
        self.log(f"job {self.status}")
        for c in self.cores:
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
            for c in self.cores:
                c.status, c.ended_at = "exited", now()
            self.finish()
            self._notify(notify_fd, {"event": "failed", "job": self.job, "reason": self.reason})
            return
        self.start_cores()
        self.save()
        self._notify(
            notify_fd,
            {
                "event": "started",
                "job": self.job,
                "worker": self.worker,
                "supervisor_pid": os.getpid(),
                "cores": [c.to_dict() for c in self.cores],
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
        if not sup_alive and not left:
            break
        if not sup_alive or now() > deadline:
            if not killed:  # nobody else will: SIGKILL what is left
                for g in left:
                    signal_group(g, signal.SIGKILL)
                if sup_alive and sup:
                    os.kill(sup, signal.SIGKILL)
                killed = True
            elif now() > deadline + 10:
                raise AgentError(f"processes of job {job} survive SIGKILL: {left}", code=1)
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
    cores = [int(c["core"]) for c in spec.get("cores", [])]
    readers = {c: _RecReader(worker, c, os.path.join(jdir, f"w{worker}-c{c}.rec"), offsets.get(c, 0)) for c in cores}
    out = sys.stdout.buffer
    stdin_closed = threading.Event()
    if args.attached:
        _watch_stdin(stdin_closed)
        lease = os.path.join(jdir, "attached")
        signal.signal(signal.SIGHUP, lambda s, f: stdin_closed.set())
        signal.signal(signal.SIGTERM, lambda s, f: stdin_closed.set())
    else:
        signal.signal(signal.SIGHUP, lambda s, f: sys.exit(0))
    reported: set = set()
    stopping = False
    last_touch = 0.0
    try:
        while True:
            st = _load_state(args.job)  # read before draining: lines precede the state that ends a core
            got = _drain(readers, out, until_empty=False)
            ended = {int(c["core"]): c for c in st.get("cores", []) if c.get("ended_at") is not None}
            for c in cores:
                if c in ended and c not in reported:
                    _drain(readers, out, only=c)
                    rec = {
                        "event": "exit",
                        "w": worker,
                        "c": c,
                        "code": ended[c].get("exit_code"),
                        "status": ended[c].get("status"),
                    }
                    out.write((json.dumps(rec) + "\n").encode())
                    reported.add(c)
            over = st.get("status") in TERMINAL and len(reported) == len(cores)
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
