"""tpurun's worker agent: starts a job's processes on this host, logs them, stops them, streams logs.

Shipped to every worker in the bundle (tpurun/worker/__init__.py's BUNDLE: this file, agent_files.py,
agent_supervisor.py, agent_lines.py, agent_notices.py with metaserver.py, agent_stacks.py, agent_profile.py, versions.py,
protocol.py, protocol_calls.py and hook/, beside the watchdog's files) and run there as `python3 agent.py
COMMAND ...`, so it uses the standard library only (Python >= 3.8) and imports nothing from tpurun. As in
torchelastic, a supervisor owns the processes and writes every line to files first; readers (`stream`) tail
the files, so nothing is lost when the viewer or its SSH session goes away.

What it reads and writes (the job spec, the job's state, records, events, statuses, exit codes) is protocol.py's
and protocol_calls.py's.

Commands (exit codes: protocol.AgentExit):
  start                      a JobSpec (JSON) on stdin; prints a started (or start-failed) event; returns at once
  --first COMMAND ...        COMMAND with $TPURUN_FIRST_INPUT (base64) as its input, then (if it succeeded) the
                             command that follows, in this one process (a start, then its stream: bundle.program_argv)
  stop JOB [--grace S]       stops every process; returns when none of the job's is left; prints state
  stream JOB [--offsets JSON] [--follow] [--attached]
                             framed records (JSON lines) from the per-slot .rec files
  jobs                       JSON list of this worker's jobs with their states
  preflight [--packages P] [--claim JOB]
                             a Preflight answer; with --claim, once a line on stdin says to claim this
                             worker for JOB (its end: only answer), held until stdin ends or a line tells it
                             to start JOB (protocol_calls.claim_start): then, in this same process, JOB's
                             start and (if the line says so) its stream, attached, as --first start stream
  state JOB                  the job's state.json
  stacks JOB [--timeout S]   JSON list of the job's processes here with their threads' stacks (agent_stacks.py)
  profile JOB --at T --duration S --session NAME
                             every process of the job here traced for S seconds from T (epoch seconds) by its
                             profiler server, into the job's profiles/NAME/; a ProfileAnswer (agent_profile.py)

Files in ~/.tpurun/jobs/<JOB>/ (root overridable with $TPURUN_AGENT_ROOT): spec.json, state.json,
supervisor.log, pre.log, w<W>-c<C>.log (slot C's output bytes as printed, stdout and stderr lines in
arrival order), w<W>-c<C>.rec (one line per record, protocol.encode_recs) and stacks/<PID>.txt (where a
process's faulthandler writes its stacks for `stacks`; the hook makes it).

A host launch ("launch": "host" in the spec) starts one process per worker (slot HOST, files w<W>.log
and w<W>.rec) with hook/sitecustomize.py (shipped beside this file) first on its PYTHONPATH and the name
of a log socket this supervisor listens on. Each chip process the script's spawner makes connects to it
and takes its chip's slot, with its own files, found at run time; the supervisor watches it by pid.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import sys
import threading
import time

import versions

# the bundle's files sit side by side on a worker (python3 agent.py puts their directory on sys.path)
from agent_files import (
    CHUNK,
    POLL,
    SPEC,
    STATE,
    STOP,
    AgentError,
    Pace,
    agent_root,
    backoff,
    claim,
    claim_holder,
    end_claim,
    group_members,
    job_dir,
    job_processes,
    log_base,
    now,
    pid_alive,
    read_spec,
    root_lock,
    running_jobs,
    signal_group,
    signal_pids,
    state_with_liveness,
    write_json_atomic,
    write_state,
)
from protocol import (
    FIRST_INPUT,
    TERMINAL,
    AgentExit,
    Done,
    Exit,
    JobState,
    JobStatus,
    Passages,
    ProcessStatus,
    Started,
    StartFailed,
    decode,
    encode,
    frame_recs,
)
from protocol_calls import JobSpec, Preflight, StopRequest, read_claim_start
from zygote import SUPERVISOR_NAME, name_self

HELD_STOP = 5.0  # seconds an attached stream leaves the stop to the supervisor that holds the lifeline too
STOP_LOOK = 0.1  # seconds between two looks of a stream, at most, while its job stops

# Set by the relay's zygote that forked this process: the relay streams a claimed job itself once it started
# (preflight --claim then ends with AgentExit.RELAY_STREAMS), so that no agent process runs beside the job.
RELAY_STREAMS = False

TYPE_CHECKING = False  # typing is not imported on a worker; type checkers read True
if TYPE_CHECKING:
    from collections.abc import Callable

# ---------------------------------------------------------------- commands


def cmd_start(args, claim: int | None = None, lifeline: bool = False) -> int:
    """CLAIM: the descriptor through which this process holds the worker for the job (`preflight --claim`'s).
    LIFELINE: the supervisor keeps this process's stdin and stops the job at its end (the relay that streams the
    job holds its other end: the client's Ctrl-C, or the relay gone)."""
    from agent_supervisor import Supervisor  # this command's alone (and the supervisor's, forked from it)

    try:
        data = sys.stdin.buffer.read() if args.input is None else args.input
        spec = JobSpec.from_json(data.decode())
    except ValueError as e:
        raise AgentError(f"the job spec on stdin is not one: {e}") from e
    jdir = job_dir(spec.job_id)
    with root_lock(agent_root()):
        holder = claim_holder(agent_root())
        refusal = "" if spec.allow_concurrent else _refusal(spec.job_id, holder)
        if refusal:
            sys.stderr.write(refusal + "\n")
            return AgentExit.BUSY
        if os.path.exists(os.path.join(jdir, STATE)):
            raise AgentError(f"job {spec.job_id} already exists on this worker")
        os.makedirs(jdir, exist_ok=True)
        write_json_atomic(os.path.join(jdir, SPEC), spec.to_dict())
        starting = JobState(spec.job_id, spec.worker, JobStatus.STARTING, started_at=now(), launch=spec.launch)
        write_state(jdir, starting)
        if claim is not None:
            os.close(claim)  # the job holds the worker now (its state says it starts), not this process
        elif holder is not None and holder.get("job_id") == spec.job_id:
            end_claim(agent_root(), holder, spec.job_id)  # the job holds the worker now (its state says it starts)
        rfd, wfd = os.pipe()
        import gc

        gc.freeze()  # the collector of either side then never writes to what they share: fewer pages copied
        pid = os.fork()
        if pid == 0:  # intermediate child: new session, then fork the supervisor and leave
            try:
                os.close(rfd)
                os.setsid()
                if os.fork() != 0:
                    os._exit(0)
                name_self(SUPERVISOR_NAME)
                life = os.dup(0) if lifeline else -1
                _become_daemon(jdir, keep=(wfd, life))
                Supervisor(spec, jdir, lifeline=life).run(wfd)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        os.close(wfd)
        os.waitpid(pid, 0)
    with os.fdopen(rfd) as r:
        line = r.readline()
    msg = decode(line)
    if not isinstance(msg, (Started, StartFailed)):
        tail = _tail(os.path.join(jdir, "supervisor.log"))
        raise AgentError(f"the supervisor of job {spec.job_id} died while starting: {tail}", code=AgentExit.INTERNAL)
    if spec.down and isinstance(msg, Started):
        # `train --down`: the TPU's watchdog deletes it once this job has ended, even with no client left
        import subprocess

        here = os.path.dirname(os.path.abspath(__file__))
        dn = subprocess.DEVNULL
        subprocess.call(
            [sys.executable, "-S", os.path.join(here, "watchdog.py"), "ensure"], stdin=dn, stdout=dn, stderr=dn
        )
    sys.stdout.buffer.write(encode(msg))
    sys.stdout.flush()
    return AgentExit.OK if isinstance(msg, Started) else AgentExit.INTERNAL


def _refusal(job: str, holder: dict | None) -> str:
    """Why JOB cannot start on this worker (HOLDER: who holds its claim), or ""."""
    if holder is not None and holder.get("job_id") != job:
        other = holder.get("job_id")
        return f"job {other} is starting on this worker: wait for it, or `tpurun kill-stale` if its train is gone"
    busy = running_jobs(agent_root(), exclude=job)
    if busy:
        return f"job {busy[0]} is still running on this worker: `tpurun cancel {busy[0]}` first, or wait"
    return ""


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, "rb") as f:
            return " | ".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
    except OSError:
        return "(no supervisor.log)"


def _become_daemon(jdir: str, keep: tuple[int, ...]) -> None:
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
    low = 3
    for fd in sorted({k for k in keep if k >= 3} | {maxfd}):
        os.closerange(low, fd)
        low = fd + 1
    sys.stdout = open(os.devnull, "w")
    sys.stderr = os.fdopen(2, "w", buffering=1)


def _load_state(job: str) -> JobState:
    jdir = job_dir(job)
    st = state_with_liveness(os.path.join(jdir, STATE))
    if st is None:
        raise AgentError(f"no job {job} on this worker")
    return st


def _load_spec(jdir: str) -> JobSpec:
    try:
        return read_spec(jdir)
    except ValueError as e:
        raise AgentError(f"{jdir}/{SPEC}: {e}", code=AgentExit.INTERNAL) from e


def cmd_state(args) -> int:
    print(_load_state(args.job).to_json())
    return AgentExit.OK


def _jobs() -> list[JobState]:
    root = agent_root()
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        st = state_with_liveness(os.path.join(root, name, STATE))
        if st is not None:
            out.append(st)
    return out


def cmd_jobs(args) -> int:
    print(json.dumps([st.to_dict() for st in _jobs()], sort_keys=True))
    return AgentExit.OK


def cmd_preflight(args) -> int:
    """The answer (a `Preflight`). With --claim JOB it comes once stdin says whether to claim this worker for JOB
    (a line) or not (its end), and the worker stays held, unless another job holds it, until stdin ends (the
    client's lifeline: it lets the worker go, or is gone) or JOB's start ends this process."""
    names = list(versions.DECISIVE) + [n for n in args.packages.split(",") if n]
    if args.claim:
        job_dir(args.claim)  # a valid id
    found = versions.installed(names)  # read while the client waits for its turn to claim
    root = agent_root()
    held = None
    claiming = bool(args.claim) and bool(os.read(0, 1))
    with root_lock(root):
        holder = claim_holder(root)
        busy = running_jobs(root, exclude=args.claim)
        held_by = str(holder.get("job_id") or "?") if holder is not None else (busy[0] if busy else "")
        if claiming and not held_by:
            held = claim(root, args.claim)
    answer = Preflight(_jobs(), versions.python(), sys.executable, found, held_by)
    sys.stdout.write(answer.to_json() + "\n")
    sys.stdout.flush()
    if held is None:
        return AgentExit.OK
    try:
        line = _line(0)  # the job's start, or the end: the client let the worker go, or is gone
        told = read_claim_start(line)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"tpurun agent: the claim's start is not one: {e}\n")
        return AgentExit.USAGE
    if told is None:
        return AgentExit.OK  # the claim's lock goes with this process
    args.input, stream = told
    rc = cmd_start(args, claim=held, lifeline=stream and RELAY_STREAMS)  # held from the claim to the stream
    if rc != AgentExit.OK or not stream:
        return rc
    if RELAY_STREAMS:
        return AgentExit.RELAY_STREAMS
    return cmd_stream(_parser().parse_args(["stream", args.claim, "--follow", "--attached"]))


def _line(fd: int) -> bytes:
    """What comes on FD up to its first newline (b"" at its end). The client says nothing after the line
    until it closes the descriptor, so nothing read past the newline is lost."""
    got = b""
    while not got.endswith(b"\n"):
        data = os.read(fd, 65536)
        if not data:
            return b""
        got += data
    return got


def cmd_stacks(args) -> int:
    """Every process of the job here with its threads' stacks (JSON: a list of `ProcessStack`s)."""
    import agent_stacks

    st = _load_state(args.job)
    found = agent_stacks.collect(args.job, job_dir(args.job), st, args.timeout)
    print(json.dumps([ps.to_dict() for ps in found]))
    return AgentExit.OK


def cmd_profile(args) -> int:
    """Every process of the job here captured for --duration seconds from --at (a `ProfileAnswer`, its last line;
    xprof prints its own progress before it)."""
    import agent_profile

    jdir = job_dir(args.job)
    st = _load_state(args.job)
    answer = agent_profile.capture(jdir, _load_spec(jdir), st, args.at, args.duration, args.session)
    sys.stdout.write("\n" + answer.to_json() + "\n")
    return AgentExit.OK


def stop_job(job: str, grace: float | None) -> JobState:
    """Stop JOB and return once none of its processes is left (the supervisor's own escalation first,
    ours if it is gone or hangs)."""
    jdir = job_dir(job)
    st = _load_state(job)
    before = st.status
    if grace is None:
        grace = _load_spec(jdir).grace
    sup = st.supervisor_pid
    if st.status == JobStatus.STARTING and not sup:
        deadline = now() + 10
        while now() < deadline and not st.supervisor_pid:
            time.sleep(POLL)
            st = _load_state(job)
        sup = st.supervisor_pid
    if sup and pid_alive(sup):
        write_json_atomic(os.path.join(jdir, STOP), StopRequest(grace, now()).to_dict())
        try:
            os.kill(sup, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = now() + grace + 10
    pgids = [s.pgid for s in st.slots]
    killed = False
    # each look reads /proc: 20 ms apart at first, further apart while the job's processes take their time
    # to end (the relays of a pod stop hundreds of jobs on a host's cores at once, each looking so)
    looks = 0
    while True:
        st = _load_state(job)
        pgids = list({*pgids, *(s.pgid for s in st.slots)})
        sup_alive = st.supervisor_alive
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
                raise AgentError(f"processes of job {job} survive SIGKILL: {left + marked}", code=AgentExit.INTERNAL)
        time.sleep(backoff(looks))
        looks += 1
    if st.status not in TERMINAL or st.status == JobStatus.LOST:
        # The supervisor did not write the end (it was killed): record it ourselves. A lost job stays lost: its end
        # came before this stop, which only took what it left behind.
        if st.status != JobStatus.LOST:
            st.status = JobStatus.STOPPED
        st.ended_at = st.ended_at or now()
        for s in st.slots:
            if s.status == ProcessStatus.RUNNING:
                s.status, s.ended_at = ProcessStatus.KILLED, now()
        write_state(jdir, st)
        st.supervisor_alive = False
    st.status_before_stop = before
    return st


def cmd_stop(args) -> int:
    print(stop_job(args.job, args.grace).to_json(), flush=True)
    return AgentExit.OK


class _RecReader:
    """Tails one slot's .rec file from a byte offset; yields complete records only."""

    def __init__(self, worker: int, slot: int, path: str, offset: int) -> None:
        self.worker, self.slot = worker, slot
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
        out, self.offset = frame_recs(self.worker, self.slot, self.offset, data[:cut].split(b"\n")[:-1])
        return out


def cmd_stream(args) -> int:
    offsets = {}
    if args.offsets:
        try:
            offsets = {int(k): int(v) for k, v in json.loads(args.offsets).items()}
        except (ValueError, AttributeError) as e:
            raise AgentError(f"--offsets must be a JSON object {{slot: byte offset}}: {e}") from e
    pace = Pace()
    lifeline = _lifeline(pace) if args.attached else None
    if not args.attached:
        signal.signal(signal.SIGHUP, lambda s, f: sys.exit(0))
    try:
        return stream_job(args.job, sys.stdout.buffer, pace, follow=args.follow, lifeline=lifeline, offsets=offsets)
    except BrokenPipeError:
        # The client is gone. An attached job goes with it; a detached one keeps running.
        _silence_stdout()
        if args.attached:
            stop_job(args.job, None)
        return AgentExit.OK


def stream_job(
    job: str, out, pace: Pace, follow: bool, lifeline: threading.Event | None, offsets: dict, held: bool = False
) -> int:
    """JOB's records to OUT (`write`, `flush`) from OFFSETS ({slot: byte offset}) on, until its end where FOLLOW.
    Attached (a LIFELINE: set once the client is gone or asks the job to stop, waking PACE), the job is stopped
    then and its last records still sent. HELD: the job's supervisor holds the lifeline too and stops the job at
    its end; this stream stops it only where that supervisor died first (what the job left is taken then) or
    the job has not ended HELD_STOP seconds later (its supervisor hung). The stream of `stream`, or of the relay
    that forked a claim's agent."""
    jdir = job_dir(job)
    st = _load_state(job)
    spec = _load_spec(jdir)
    worker = spec.worker
    slots: list[int] = []
    readers: dict[int, _RecReader] = {}

    def follow_slots(state: JobState) -> None:
        # a host launch's chip slots appear while it runs
        for c in [p.slot for p in spec.cores] + [s.slot for s in state.slots]:
            if c not in readers:
                slots.append(c)
                readers[c] = _RecReader(worker, c, log_base(jdir, worker, c) + ".rec", offsets.get(c, 0))

    follow_slots(st)
    lease = os.path.join(jdir, "attached")
    sent_passages: dict[int, list] = {}  # slot -> its passages through rendezvous points (the state's), as last sent
    reported: dict[int, float] = {}  # slot -> the end sent (a chip may run again: the spawner's next round)
    stopping = False
    stop_at = None  # once the lifeline is cut: when this stream stops the job (`stop_job`), unless it ended
    told = False  # the job's notice of a host event, sent
    last_touch = 0.0
    while True:
        st = _load_state(job)  # read before draining: lines precede the state that ends a slot
        follow_slots(st)
        got = _drain(readers, out, until_empty=False)
        if st.notice is not None and not told:
            told = True
            out.write(encode(st.notice))
        for s in st.slots:  # compared as read each poll; a record only when they changed
            if s.passages and sent_passages.get(s.slot) != s.passages:
                sent_passages[s.slot] = s.passages
                out.write(encode(Passages(worker, s.slot, s.passages)))
        ended = {s.slot: s for s in st.slots if s.ended_at is not None}
        for c in slots:
            if c in ended and reported.get(c) != ended[c].ended_at:
                _drain(readers, out, only=c)
                out.write(encode(Exit(worker, c, ended[c].exit_code, ended[c].status)))
                reported[c] = ended[c].ended_at
                got = True
        # over once every process's end was sent; a lost job's at once (its supervisor, which would have
        # written the rest, is gone: no more will come, and a follower must not wait for it)
        over = st.status in TERMINAL and (st.status == JobStatus.LOST or all(c in reported for c in slots))
        if over:
            if st.status == JobStatus.LOST and lifeline is not None and lifeline.is_set() and not stopping:
                _quiet_stop(job)  # its supervisor died before it stopped the job: what it left is taken here
            _drain(readers, out)
            out.write(encode(Done(worker, st)))
            out.flush()
            return AgentExit.OK
        out.flush()
        if not follow:
            return AgentExit.OK
        if lifeline is not None:
            if now() - last_touch > 1.0:
                _touch(lease)
                last_touch = now()
            if lifeline.is_set() and stop_at is None:
                stop_at = now() + (HELD_STOP if held else 0.0)
            if stop_at is not None and not stopping and now() >= stop_at:
                stopping = True
                _stop_async(job)
        if got or st.status != JobStatus.RUNNING or not all(r.offset for r in readers.values()):
            pace.busy()  # lines come, the job starts or ends, a process's first line is awaited: look soon
        if not got:
            # while the job stops, a look each STOP_LOOK at least (its end is awaited), not each POLL: a pod's
            # hundreds of streams looking 50 times a second would take the cores its processes need to end
            most = None if stop_at is None else STOP_LOOK if stopping else max(0.0, min(STOP_LOOK, stop_at - now()))
            pace.wait(most)


def _drain(readers: dict, out, only: int | None = None, until_empty: bool = True) -> bool:
    """Write the complete records now readable (one chunk per slot, or until none is left), merged
    across slots by time. True if there were any."""
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


def _lifeline(pace: Pace) -> threading.Event:
    """An attached stream's lifeline: set once its stdin ends or it is hung up on (SIGHUP, SIGTERM); each wakes PACE."""
    closed = threading.Event()
    _watch_stdin(closed, pace.wake)

    def hangup(signum: int, frame: object) -> None:
        closed.set()
        pace.wake()

    signal.signal(signal.SIGHUP, hangup)
    signal.signal(signal.SIGTERM, hangup)
    return closed


def _watch_stdin(closed: threading.Event, wake: Callable[[], None]) -> None:
    def watch() -> None:
        # os.read on the raw descriptor: a daemon thread blocked inside sys.stdin's buffered reader
        # would hold its lock and abort the interpreter at exit.
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        closed.set()
        wake()

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


def _parser() -> argparse.ArgumentParser:
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
    p = sub.add_parser("preflight", help="before a job: the jobs here, this Python and its packages' versions")
    p.add_argument("--packages", default="", help="comma-separated names to report besides versions.DECISIVE")
    p.add_argument("--claim", default="", metavar="JOB", help="hold this worker for JOB (a line on stdin: claim it)")
    p = sub.add_parser("state", help="a job's state")
    p.add_argument("job")
    p = sub.add_parser("stacks", help="the stacks of every thread of every process of a job here")
    p.add_argument("job")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for every process's answer")
    p = sub.add_parser("profile", help="every process of a job here captured by its profiler server")
    p.add_argument("job")
    p.add_argument("--at", type=float, required=True, help="when the capture starts (epoch seconds)")
    p.add_argument("--duration", type=float, required=True, help="seconds")
    p.add_argument("--session", required=True, help="the session's name (its directory under the job's profiles/)")
    return parser


COMMANDS = {
    "start": cmd_start,
    "stop": cmd_stop,
    "stream": cmd_stream,
    "jobs": cmd_jobs,
    "preflight": cmd_preflight,
    "state": cmd_state,
    "stacks": cmd_stacks,
    "profile": cmd_profile,
}


def _command(parser: argparse.ArgumentParser, argv: list[str], given: bytes | None = None) -> int:
    """The command ARGV, with GIVEN in place of its stdin where it reads one (start)."""
    args = parser.parse_args(argv)
    if args.command not in COMMANDS:
        parser.print_usage(sys.stderr)
        return AgentExit.USAGE
    args.input = given
    try:
        return COMMANDS[args.command](args)
    except AgentError as e:
        sys.stderr.write(f"tpurun agent: {e}\n")
        return e.code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv[:1] == ["--first"] and len(argv) >= 2:  # a first command and its input, then the rest if it succeeded
        try:
            given = base64.b64decode(os.environ.pop(FIRST_INPUT, ""), validate=True)
        except ValueError:
            sys.stderr.write(f"tpurun agent: {FIRST_INPUT} is not base64\n")
            return AgentExit.USAGE
        rc = _command(parser, argv[1:2], given)
        if rc != AgentExit.OK or len(argv) == 2:
            return rc
        argv = argv[2:]
    return _command(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
