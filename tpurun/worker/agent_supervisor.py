"""The job agent's supervisor: starts a job's processes, writes every line they print to per-slot files,
follows the chip processes a host launch's spawner makes (through the hook's log socket), and stops them
all. Part of the agent bundle (stdlib only, Python >= 3.8)."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import agent_notices

# the bundle's files sit side by side on a worker (python3 agent.py puts their directory on sys.path)
from agent_files import (
    FATAL_SIGNALS,
    HOOK_DIR,
    POLL,
    Pace,
    group_members,
    job_processes,
    log_base,
    now,
    of_job,
    pdeathsig_preexec,
    pid_alive,
    proc_stat,
    read_stop,
    signal_group,
    signal_job,
    signal_pids,
    watch_exit,
    write_state,
)
from agent_lines import STDIO, Channel, Channels, pump, spawned_child, stdio_id
from protocol import (
    DEFAULT_LEASE,
    HOOK_ACCEPTED,
    HOST,
    STACKS_SIGNAL,
    FirstFailure,
    HookStream,
    JobState,
    JobStatus,
    Notice,
    Passage,
    ProcessStatus,
    SlotState,
    Source,
    Started,
    StartFailed,
    TaskEnd,
    encode,
    encode_recs,
    read_hook_header,
    read_task_end,
)
from protocol_calls import ON_STOP, JobSpec, ProcessSpec

# ---------------------------------------------------------------- the supervisor


class Slot:
    """One process slot of the job (`protocol`'s slot: HOST, a chip launch's process, a spawned chip): its
    process, log files and the threads that fill them. `index` is the slot."""

    def __init__(self, worker: int, spec: ProcessSpec, jdir: str) -> None:
        self.worker = worker
        self.index = int(spec.slot)
        self.argv = [str(a) for a in spec.argv]
        self.env = {str(k): str(v) for k, v in spec.env.items()}
        self.cwd = os.path.expanduser(spec.cwd or "~")
        base = log_base(jdir, worker, self.index)
        self.log = open(base + ".log", "ab")
        self.rec = open(base + ".rec", "ab")
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.pipes: tuple = ()  # its stdout and stderr, read ends
        self.pid: int | None = None
        self.pgid: int | None = None
        self.status = ProcessStatus.PENDING
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
        self.passages: dict[str, Passage] = {}  # rendezvous point -> its process's latest passage there
        self.last_line_at: float | None = None

    def start(self, preexec, job: str) -> None:
        env = dict(os.environ)
        env.update(self.env)
        env["TPURUN_JOB_ID"] = job  # how the agent finds every process of the job (job_processes)
        (r_out, w_out), (r_err, w_err) = os.pipe(), os.pipe()
        env[STDIO] = f"{stdio_id(w_out)},{stdio_id(w_err)}"  # the hook gives its Python descendants their own
        self.started_at = now()
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=w_out,
                stderr=w_err,
                start_new_session=True,  # own process group: signals reach its whole tree
                preexec_fn=preexec,
            )
        except OSError as e:
            for fd in (r_out, r_err):
                os.close(fd)
            # Recorded as exit 127 (the shell's "command not found"); the supervisor fails the job fast.
            self.write(Source.ERR, f"tpurun agent: cannot start {self.argv}: {e}\n".encode())
            return
        finally:
            os.close(w_out)
            os.close(w_err)
        self.pipes = (os.fdopen(r_out, "rb"), os.fdopen(r_err, "rb"))
        self.pid = self.pgid = self.proc.pid
        self.status = ProcessStatus.RUNNING

    def start_readers(self) -> None:
        if self.pipes:
            self.add_reader(Source.OUT, self.pipes[0])
            self.add_reader(Source.ERR, self.pipes[1])

    def add_reader(self, stream: Source, pipe) -> None:
        t = threading.Thread(target=pump, args=(pipe, lambda lines: self.write_lines(stream, lines)), daemon=True)
        t.start()
        self.readers.append(t)

    def write(self, stream: Source, raw: bytes) -> None:
        self.write_lines(stream, [raw])

    def write_lines(self, stream: Source, lines: list[bytes], read_at: float | None = None) -> None:
        """LINES into the slot's files, read now (or at READ_AT: lines held for their chip)."""
        # a partial last line is terminated so it never merges with the other stream
        raws = [raw if raw.endswith(b"\n") else raw + b"\n" for raw in lines]
        texts = [raw[:-1].decode("utf-8", "backslashreplace") for raw in raws]
        with self.lock:
            if self.log.closed:
                return  # the job's end is written; late bytes of a vanished process are dropped
            t = read_at or now()  # under the lock: a process's records are in time order
            self.log.write(b"".join(raws))
            self.log.flush()
            self.rec.write(encode_recs(stream, t, texts))
            self.rec.flush()
            for raw in reversed(raws):
                if raw.strip():
                    self.last_line = raw[:-1].decode("utf-8", "backslashreplace")[-500:]
                    self.last_line_at = t
                    break

    def note_end(self, pid: int) -> None:
        """PID of this chip was seen to end now (or earlier, by another witness)."""
        t = now()
        self.died_at[pid] = min(self.died_at.get(pid, t), t)

    def readers_done(self) -> bool:
        return not any(t.is_alive() for t in self.readers)

    def state(self) -> SlotState:
        return SlotState(
            self.index, self.status, self.exit_code, self.pid, self.pgid, self.started_at, self.ended_at,
            self.last_line, self.last_line_at, list(self.passages.values()), self.argv, self.spawned,
        )  # fmt: skip


class Supervisor:
    """Owns one job on this worker: pre-commands, one process per slot, fail-fast, stop, state.json."""

    def __init__(self, spec: JobSpec, jdir: str, lifeline: int = -1) -> None:
        self.spec = spec
        self.jdir = jdir
        self.job = spec.job_id
        self.worker = spec.worker
        self.grace = float(spec.grace)
        self.detach = spec.detach
        lease = spec.lease_timeout if spec.lease_timeout is not None else (None if self.detach else DEFAULT_LEASE)
        self.lease = float(lease) if lease else None
        self.slots = [Slot(self.worker, c, jdir) for c in spec.cores]
        self.launch = spec.launch
        self.slots_lock = threading.Lock()  # the log server adds chip slots while the loop runs
        self.channels = Channels()  # the own channels the hook connected (agent_lines)
        self.listener: socket.socket | None = None
        self.dirty = False  # a chip's slot appeared: state.json must show it (readers find its files there)
        self.closed = False  # finish() ran: no new chip slots
        self.pre_groups: list[int] = []
        self.status = JobStatus.RUNNING  # until every process is gone: readers trust an end status
        self.outcome: JobStatus | None = None  # the end status decided by a stop (stopped/failed), applied at the end
        self.reason = ""
        self.first_failure: FirstFailure | None = None
        self.started_at = now()
        self.ended_at: float | None = None
        self.stop_requested = False
        self.lifeline = lifeline  # where the job is attached through a relay: its end stops the job (_hold_on)
        self.pace = Pace()  # the loop's waits: short while things happen, longer while the job is quiet
        self.stop_deadline: float | None = None
        self.stop_told: set = set()  # the processes the stop's SIGTERM was sent to (never twice)
        self.killed = False
        self.saved_at = 0.0
        self.notice: Notice | None = None  # the first notice of a host event the job got (agent_notices)
        self.notices: agent_notices.NoticeWatch | None = None  # its watch, while the job runs
        self.settle_at: float | None = None  # a process ended after the notice: the others are stopped at this time
        # `train --budget`: its stop begins a grace early, so that the last process is gone when the money is spent
        self.spend_stop = None if spec.spend_for is None else self.started_at + float(spec.spend_for) - self.grace

    def snapshot(self) -> list[Slot]:
        with self.slots_lock:
            return list(self.slots)

    def host_slot(self) -> Slot | None:
        return next((c for c in self.snapshot() if c.index == HOST), None)

    # --- host launch: the chip processes' log socket

    def use_hook(self) -> None:
        """Put the hook first on every slot's PYTHONPATH (it only acts when the job asks it to)."""
        if not os.path.isfile(os.path.join(HOOK_DIR, "sitecustomize.py")):
            self.log(f"no hook in {HOOK_DIR}: chip processes will log as the host process, no --metrics")
            return
        for c in self.snapshot():
            path = c.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            c.env["PYTHONPATH"] = HOOK_DIR + (os.pathsep + path if path else "")
            c.env["TPURUN_SUPERVISOR_PID"] = str(os.getpid())  # the hook's test for "started by the agent"
            c.env["TPURUN_JOB_DIR"] = self.jdir  # where the hook writes --metrics reports, and stacks
            c.env["TPURUN_STACKS_SIGNAL"] = str(STACKS_SIGNAL)
        os.makedirs(os.path.join(self.jdir, "stacks"), exist_ok=True)

    def open_log_socket(self) -> None:
        """Listen for the hook: a host launch's chip processes, and every process's passages through
        rendezvous points; the processes tpurun starts learn the name from their env."""
        name = f"tpurun-{self.job}-{os.urandom(8).hex()}"  # (os.urandom: `secrets` would import hmac and more)
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
        """One connection of the hook (a process's own stream, a chip's, its reports): check who it is, then
        file it under its slot."""
        try:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid() or not of_job(pid, self.job):
                raise ValueError(f"refused a log connection from pid {pid} (uid {uid}): not a process of this job")
            conn.settimeout(10)
            f = conn.makefile("rb")
            try:
                slot, stream, pool = read_hook_header(f.readline(4096))
            except ValueError as e:
                raise ValueError(f"refused a log connection from pid {pid}: {e}") from None
            conn.settimeout(None)
        except (OSError, ValueError) as e:
            self.log(f"log socket: {e}")
            conn.close()
            return
        own = stream in (HookStream.OWN_OUT, HookStream.OWN_ERR)
        if own:  # read at once: its chip may be named before this thread goes on
            c = self.own_channel(pid, slot, Source.OUT if stream is HookStream.OWN_OUT else Source.ERR, f)
        else:
            c = self.slot_of(pid) if stream is HookStream.WAIT else self.chip(slot, pid, pool)
        if c is None:  # the job is over, or a passage from a process that is not that slot's
            conn.close()
            return
        try:
            conn.sendall(HOOK_ACCEPTED)  # the hook moves its output here only once accepted
        except OSError:
            conn.close()
            return
        conn.close()  # f keeps the descriptor open until the reader closes it
        if stream is HookStream.CTL:
            t = threading.Thread(target=self._read_ctl, args=(c, pid, f), daemon=True)
            t.start()
            c.readers.append(t)
        elif stream is HookStream.WAIT:
            threading.Thread(target=self._read_passages, args=(c, f), daemon=True).start()
        elif not own:
            c.add_reader(Source(stream.value), f)

    def chip(self, index: int, pid: int, pool: bool) -> Slot | None:
        """The slot of chip INDEX, made the first time one of its processes connects (None once the job
        is over). A new process on a known chip is the spawner's next round (Lightning: fit, then test)."""
        with self.slots_lock:
            if self.closed:
                return None
            c = next((x for x in self.slots if x.index == index), None)
            if c is None:
                c = Slot(self.worker, ProcessSpec(index, []), self.jdir)
                c.spawned = True
                self.slots.append(c)
            if pid not in c.pids:
                c.pids.append(pid)
                c.pid = pid
                c.started_at = now()
                c.exited_at = c.ended_at = c.exit_code = c.reported = None
                c.ctl_done, c.pool = False, pool
                c.passages = {}  # the spawner's next round: its passages are the new process's
                c.died_at.clear()
                stat = proc_stat(pid)
                c.pgid = int(stat[2]) if stat and len(stat) > 2 else c.pgid
                c.status = ProcessStatus.RUNNING
                watch_exit(functools.partial(self._ended_chip, c), pid)
                self.dirty = True
                self.log(f"chip {index}: process {pid} (group {c.pgid}) of the script's spawner")
            for ch in self.channels.of(pid):  # its own channels, from its start: the chip's now
                if ch.slot is not c and ch.thread is not None:
                    ch.bind(c)
                    c.readers.append(ch.thread)
        return c

    def own_channel(self, pid: int, index: int, source: Source, f) -> Slot | None:
        """Process PID's own channel F, read from now on and filed under slot INDEX (the one it inherited, or
        the host's: held there while the process may yet be given a chip); its slot, None once the job is over."""
        with self.slots_lock:
            if self.closed:
                return None
            host = next((x for x in self.slots if x.index == HOST), None)
            slot = next((x for x in self.slots if x.index == index), host)
            if slot is None:
                return None
            ch = Channel(pid, source, slot, slot is host and spawned_child(pid))
            self.channels.add(ch)
            slot.readers.append(ch.follow(f, self.channels.ended))
        return slot

    def slot_of(self, pid: int) -> Slot | None:
        """The slot whose process PID is (one we started, or a chip's), else None: a process's passages are
        filed by who it is, not by what its header says."""
        with self.slots_lock:
            return next((c for c in self.slots if pid == c.pid or pid in c.pids), None)

    def _read_passages(self, c: Slot, f) -> None:
        """A process's passages through rendezvous points, into the state (the latest per point, 16 points)."""
        try:
            for line in f:
                try:
                    passage = Passage.from_dict(json.loads(line))
                except ValueError:
                    continue
                with self.slots_lock:  # a new dict each time: state() reads the one it finds, unlocked
                    kept = {at: p for at, p in c.passages.items() if at != passage.at}
                    kept[passage.at] = passage
                    c.passages = dict(list(kept.items())[-16:])
                    self.dirty = True
        except OSError:
            pass
        finally:
            f.close()

    def _read_ctl(self, c: Slot, pid: int, f) -> None:
        # EOF here is the process's exit (or its last forked child's): a witness of when it ended even
        # where it ended before a pidfd could be opened for it
        try:
            for line in f:
                report = read_task_end(line)
                if report is None:
                    # faulthandler's report of a fatal signal: into the chip's log, and it crashed
                    c.write(Source.ERR, line)
                    crash = re.match(rb"Fatal Python error: (.*)", line)
                    if crash:
                        c.reported = -FATAL_SIGNALS.get(crash.group(1).strip().decode(errors="replace"), 0) or 1
                    continue
                end, code = report
                if end is TaskEnd.OK and c.reported is None:
                    c.reported = 0
                elif end is TaskEnd.FAILED:
                    c.reported = code or 1
        except OSError:
            pass  # reset by a process that died: the same as its end
        finally:
            c.note_end(pid)
            c.ctl_done = True
            f.close()

    def watch_chip(self, c: Slot) -> bool:
        """Follow a chip process of a host launch (not our child: by pid and by what the hook reports).
        True when its end was recorded."""
        if c.reported not in (None, 0) and self.stop_deadline is None:
            # its spawner task failed: stop now, the spawner would wait for every sibling first
            self.first_failure = self.first_failure or FirstFailure(c.index, c.reported, now(), self.worker)
            if not self.settling(f"chip {c.index}"):
                self.request_stop(f"chip {c.index} failed", JobStatus.FAILED)
        if c.ended_at is not None:
            return False
        if c.exited_at is None:
            if any(pid_alive(p) for p in c.pids):
                return False
            c.exited_at = now()
            for p in c.pids:
                c.note_end(p)
        host = self.host_slot()
        if c.reported is None and c.ctl_done and c.pool and host is not None and host.status == ProcessStatus.RUNNING:
            self.blame_died("while its spawner ran")
        if not (c.readers_done() or now() - c.exited_at > self.grace + 2):
            return False
        if c.reported is not None:
            c.exit_code, c.status = c.reported, (ProcessStatus.EXITED if c.reported == 0 else ProcessStatus.FAILED)
        elif host is not None and host.pid in c.pids:
            if host.exit_code is None and host.status == ProcessStatus.RUNNING:
                return False  # the host process was the chip (nprocs=1): its exit code decides
            c.exit_code, c.status = host.exit_code, host.status
        elif self.first_failure is not None and self.first_failure.slot == c.index:
            c.status = ProcessStatus.DIED
        elif self.stop_deadline is not None:
            c.status = ProcessStatus.KILLED
        else:
            c.exit_code, c.status = (host.exit_code if host else None), ProcessStatus.EXITED
        c.ended_at = now()
        self.log(f"chip {c.index} ended: {c.status} ({c.exit_code})")
        return True

    def blame_died(self, why: str) -> bool:
        """Chip processes ended without reporting how (killed or crashed; their exit status is their
        parent's to read): blame the one that ended first, as a pool then kills the others. True if any."""
        if self.stop_deadline is not None:
            return False
        host = self.host_slot()
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
        self.first_failure = self.first_failure or FirstFailure(
            first.index, first.reported, min(first.died_at.values(), default=now()), self.worker
        )
        if not self.settling(f"chip {first.index}"):
            self.request_stop(f"chip {first.index} died {why}", JobStatus.FAILED)
        return True

    # --- state

    def state(self) -> JobState:
        stopping = self.stop_deadline is not None and self.status == JobStatus.RUNNING
        return JobState(
            self.job, self.worker, self.status, os.getpid(), self.started_at, self.ended_at, stopping, self.detach,
            self.launch, self.reason, self.first_failure, [c.state() for c in self.snapshot()], notice=self.notice,
        )  # fmt: skip

    def save(self) -> None:
        self.saved_at = now()
        write_state(self.jdir, self.state())

    def log(self, message: str) -> None:
        sys.stderr.write(time.strftime("%Y-%m-%dT%H:%M:%S ") + message + "\n")
        sys.stderr.flush()

    # --- phases

    def run_pre_commands(self) -> bool:
        """xla_dist-style setup commands (the XRT server). A plain argv list runs to completion; an object
        {"argv": [...], "wait": false} is a service kept alive until the job ends."""
        pre = self.spec.pre_commands
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
                deadline = now() + float(self.spec.pre_timeout)
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

    def start_slots(self) -> None:
        preexec = pdeathsig_preexec()
        # Every process first, then the reader threads: preexec_fn is only safe while we have no threads.
        for c in self.snapshot():
            c.start(preexec, self.job)
            self.log(f"slot {c.index} started: pid {c.pid} argv {c.argv}")
        for c in self.snapshot():
            c.start_readers()
        for c in self.snapshot():
            if c.proc is None:
                self.on_exit(c, 127)

    def request_stop(self, reason: str, status: JobStatus | None) -> None:
        """Stop every process (SIGTERM, SIGKILL after the grace period); STATUS: the job's end, unless one
        was decided before (None: cleaning up what ended processes left, not an end of its own)."""
        if self.stop_deadline is not None:
            return
        asked = read_stop(self.jdir)  # `agent.py stop`'s grace, else the spec's
        grace = self.grace if asked is None else asked.grace
        self.outcome = self.outcome or status
        self.reason = self.reason or reason
        self.stop_deadline = now() + grace
        self.log(f"stopping ({reason}): SIGTERM to every process, SIGKILL after {grace:.1f} s")
        for c in self.snapshot():
            c.signalled = c.signalled or c.status == ProcessStatus.RUNNING
        # once to each process, those that left their group too: a SIGTERM handler that saves is not cut short
        self.stop_told = signal_job(self.job, [c.pgid for c in self.snapshot()], signal.SIGTERM)

    def on_notice(self, notice: Notice) -> None:
        """A host event announced for a worker of the job (a thread of the NoticeWatch's): told to the processes."""
        if self.closed:
            return
        self.notice, self.dirty = notice, True
        if notice.action == ON_STOP:
            self.reason, self.stop_requested = f"{notice.kind.value} notice for worker {notice.worker}", True
        self.pace.wake()
        did = agent_notices.deliver(notice, self.job, [c.pgid for c in self.snapshot()], self.jdir)
        self.log(f"{notice.kind.value} notice for worker {notice.worker} ({notice.detail}): {did}")

    def _ended_chip(self, c: Slot, pid: int) -> None:
        """PID, C's chip process, was seen to end (a thread of `watch_exit`'s): the loop looks now."""
        c.note_end(pid)
        self.pace.wake()

    def on_exit(self, c: Slot, rc: int) -> None:
        c.exited_at = now()
        c.exit_code = rc
        c.status = ProcessStatus.KILLED if c.signalled else ProcessStatus.EXITED
        self.log(f"slot {c.index} exited with {rc}")
        # What the process left in its group (children, data loaders) would hold the TPU; in a stop, those its
        # SIGTERM did not reach (born since): the others are not sent it twice.
        left = [p for p in group_members(c.pgid) if p not in self.stop_told]
        self.stop_told.update(left if self.stop_deadline is not None else [])
        signal_pids(left, signal.SIGTERM)
        if rc != 0 and self.stop_deadline is None:
            if c.index == HOST and self.blame_died(f"before its spawner failed with {rc}"):
                return
            self.first_failure = self.first_failure or FirstFailure(c.index, rc, now(), self.worker)
            if not self.settling(f"slot {c.index}"):
                self.request_stop(f"slot {c.index} exited with {rc}", JobStatus.FAILED)

    def settling(self, which: str) -> bool:
        """WHICH ended after the job's notice (one not to stop): the others are left to end on their own until
        `agent_notices.settle_by` (True), not stopped at once as a failure stops them."""
        if self.settle_at is None:
            self.settle_at = agent_notices.settle_by(self.notice, now())
            if self.settle_at is not None:
                self.log(f"{which} ended after the notice: the others run on for {self.settle_at - now():.0f} s at most")
        return self.settle_at is not None

    def loop(self) -> None:
        while True:
            if self.stop_requested and self.stop_deadline is None:
                self.request_stop("stop requested", JobStatus.STOPPED)
            if self.spend_stop is not None and self.stop_deadline is None and now() >= self.spend_stop:
                self.request_stop("its --budget is spent", JobStatus.SPENT)
            if self.settle_at is not None and self.stop_deadline is None and now() >= self.settle_at:
                self.request_stop("the notice's time to end is up", JobStatus.FAILED)
            changed = False
            for c in self.snapshot():
                if c.spawned:
                    changed = self.watch_chip(c) or changed
                    continue
                if c.status == ProcessStatus.RUNNING and c.proc is not None:
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
            self.channels.release_overdue()
            if self.lease and self.stop_deadline is None and self._lease_expired():
                self.request_stop(f"the attached client is gone (no stream for {self.lease:.0f} s)", JobStatus.STOPPED)
            fresh = any((c.last_line_at or 0.0) > self.saved_at for c in self.snapshot())
            if changed or self.dirty or (fresh and now() - self.saved_at > 1.0):  # last lines: once a second
                self.dirty = False
                self.save()
            if all(c.ended_at is not None for c in self.snapshot()):
                leftovers = [c.pgid for c in self.snapshot() if group_members(c.pgid)] or job_processes(self.job)
                if not leftovers:
                    break
                if self.stop_deadline is None:  # every slot ended but children linger: clean them up
                    self.request_stop("processes left behind by exited slots", None)
            ending = any(c.ended_at is None and c.exited_at is not None for c in self.snapshot())
            if changed or fresh or ending:
                self.pace.busy()
            # (a process's end wakes the loop, SIGCHLD or a chip's pidfd: a stop looks at once, not 50 times a
            # second until the end, which on a pod emulated on one machine's cores took those its processes needed)
            due = [t - now() for t in (self.spend_stop, self.stop_deadline) if t is not None and t > now()]
            self.pace.wait(min(due) if due else None)  # (one past is acted on above: no wait of 0 in a loop)

    def _lease_expired(self) -> bool:
        try:
            last = os.stat(os.path.join(self.jdir, "attached")).st_mtime
        except OSError:
            last = self.started_at
        return now() - last > self.lease  # type: ignore[operator]

    def finish(self) -> None:
        with self.slots_lock:
            self.closed = True
        if self.notices is not None:
            self.notices.stop()
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            except OSError:
                pass
            self.listener.close()
        self.channels.drain(2.0)  # before the end is written: a reader that sees it has every line
        for pgid in self.pre_groups:
            signal_group(pgid, signal.SIGTERM)
        deadline = now() + min(self.grace, 5.0)
        while any(group_members(g) for g in self.pre_groups) and now() < deadline:
            time.sleep(POLL)
        for pgid in self.pre_groups:
            signal_group(pgid, signal.SIGKILL)
        host = self.host_slot()
        for c in self.snapshot():
            if c.spawned and c.status == ProcessStatus.EXITED and c.exit_code is None and host is not None:
                c.exit_code = host.exit_code  # ended unreported before its spawner: the spawner's verdict
        if self.status == JobStatus.RUNNING:
            ok = all(c.exit_code == 0 for c in self.snapshot())
            self.status = self.outcome or (JobStatus.FINISHED if ok else JobStatus.FAILED)
        self.ended_at = now()
        self.save()
        self.log(f"job {self.status.value}")
        for c in self.snapshot():
            with c.lock:  # a reader still draining a dead chip's socket stops writing (write_lines checks)
                c.log.close()
                c.rec.close()

    def run(self, notify_fd: int) -> None:
        def on_term(signum, frame):
            self.stop_requested = True
            self.pace.wake()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, lambda signum, frame: self.pace.wake())  # a process of the job ended
        self.save()
        if not self.run_pre_commands():
            self.log(self.reason)
            self.status = JobStatus.FAILED
            for c in self.snapshot():
                c.status, c.ended_at = ProcessStatus.EXITED, now()
            self.finish()
            self._notify(notify_fd, StartFailed(self.job, self.reason))
            return
        self.use_hook()
        self.open_log_socket()  # a host launch's chip processes, and every process's passages
        for c in self.snapshot():
            c.env[agent_notices.NOTICE_FILE] = agent_notices.notice_path(self.jdir)
        self.start_slots()
        self.serve_log_socket()  # threads only now: start_slots forks with a preexec_fn
        spec = self.spec
        if spec.on_notice:
            self.notices = agent_notices.NoticeWatch(spec, self.on_notice)
            self.notices.start(self.log)
        self.save()
        self._notify(notify_fd, Started(self.job, self.worker, os.getpid(), [c.state() for c in self.snapshot()]))
        if self.lifeline >= 0:
            threading.Thread(target=self._hold_on, name="lifeline", daemon=True).start()
        self.loop()
        self.finish()

    def _hold_on(self) -> None:
        """The lifeline read to its end (nothing comes on it), then the job stopped as `agent.py stop` does."""
        try:
            while os.read(self.lifeline, 4096):
                pass
        except OSError:
            pass
        self.stop_requested = True
        self.pace.wake()

    @staticmethod
    def _notify(fd: int, message: Started | StartFailed) -> None:
        try:
            os.write(fd, encode(message))
            os.close(fd)
        except OSError:
            pass
