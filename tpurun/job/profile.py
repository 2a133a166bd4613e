"""`tpurun profile`: every chosen process of a running job captured at the same moment by its runtime's profiler
server, into one session directory on this machine that xprof and TensorBoard open:
OUT/plugins/profile/SESSION/<worker>[-c<chip>].xplane.pb.

Every worker is asked at once, through the job's target's fleet (relayed on large pods), to capture its own
processes locally (worker/agent_profile.py, run with the job's Python, where xprof is) from one moment a little
ahead, in the workers' clock (worker 0's is read first: this machine's may differ from theirs by seconds), for
the duration asked; the files then come here through tpurun's download and are named by their process."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpurun import config
from tpurun.errors import ExitCode, UnreachableError, UsageError
from tpurun.fleet.interface import Call
from tpurun.fleet.targets import Target
from tpurun.job.env_contract import process_name
from tpurun.job.records import JobRecord, connect
from tpurun.job.stacks import latest_job
from tpurun.naming import each_or_by_reason
from tpurun.settings import Settings
from tpurun.sync.download import download, local_root
from tpurun.worker.protocol_calls import ProfileAnswer

MAX_SECONDS = 600.0  # a longer trace makes files no viewer opens (a protobuf's 2 GB)


@dataclass
class ProfileFile:
    """One process's capture, here: its process's name (w3, w3/c1) and file."""

    process: str
    path: Path
    size: int


@dataclass
class Profile:
    """What `tpurun profile` captured: the session's directory and files, the hosts left out by default, the
    processes without a capture and why, the workers not asked or not answering and why."""

    job_id: str
    out: Path  # the log directory xprof and TensorBoard open
    session: Path  # OUT/plugins/profile/SESSION
    seconds: float
    files: list[ProfileFile] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # hosts of the job not asked (a large pod's default)
    missing: dict[str, str] = field(default_factory=dict)  # process -> why no capture
    errors: dict[str, str] = field(default_factory=dict)  # worker -> why it could not be asked
    late: dict[str, float] = field(default_factory=dict)  # worker -> seconds its capture started after the others
    wall: float = 0.0  # seconds the whole command took

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def exit_code(self) -> ExitCode:
        """4 where a worker could not be asked, 1 where a process gave no capture, else 0."""
        if self.errors:
            return ExitCode.UNREACHABLE
        return ExitCode.PROGRAM_FAILED if self.missing or not self.files else ExitCode.OK

    def to_json(self) -> dict:
        return {
            "job_id": self.job_id,
            "logdir": str(self.out),
            "session": str(self.session),
            "seconds": self.seconds,
            "files": [{"process": f.process, "path": str(f.path), "bytes": f.size} for f in self.files],
            "bytes": self.total_bytes,
            "left_out": self.left_out,
            "missing": self.missing,
            "errors": self.errors,
            "late": self.late,
            "wall": round(self.wall, 3),
        }


def parse_seconds(text: str) -> float:
    """--duration: '3s', '1.5s', '500ms', '2m' or seconds, more than 0 and at most MAX_SECONDS; UsageError else."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m)?", text.strip())
    seconds = float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[m.group(2)] if m else 0.0
    if not m or not 0.01 <= seconds <= MAX_SECONDS:
        raise UsageError(f"--duration {text}: use e.g. 3s, 1.5s or 500ms (from 10ms to {MAX_SECONDS:.0f}s)")
    return seconds


def default_hosts(workers: list[int], most: int) -> list[int]:
    """A large pod's hosts profiled by default: at most MOST, spread evenly from the first to the last."""
    if len(workers) <= most:
        return list(workers)
    if most <= 1:
        return workers[:1]
    return sorted({workers[round(i * (len(workers) - 1) / (most - 1))] for i in range(most)})


def out_dir(out: str | None, job_id: str) -> Path:
    if out and out.startswith("gs://"):
        raise UsageError(f"--out {out}: a bucket is not written to; profile into a local directory and copy it")
    return Path(out) if out else Path("tpurun-profiles") / job_id


def capture(s: Settings, job_id: str | None, seconds: float, *, worker: str | None, out: str | None) -> Profile:
    """JOB_ID (None: the newest started from here) on WORKER (a --worker spec; None: every host of the job, at
    most TPURUN_PROFILE_HOSTS of a large pod) captured for SECONDS into OUT (None: ./tpurun-profiles/JOB)."""
    started = time.monotonic()
    record = JobRecord.load(s.home_path, job_id or latest_job(s))
    dest = out_dir(out, record.job_id)
    if record.end is not None:
        raise UsageError(f"job {record.job_id} has ended ({record.end.value}): there is nothing to profile")
    left_out: list[str] = []
    if worker is None:
        chosen = default_hosts(sorted(record.workers), config.PROFILE_HOSTS.integer())
        left_out = [f"w{w}" for w in sorted(set(record.workers) - set(chosen))]
        worker = ",".join(str(w) for w in chosen)
    target = record.target(s, worker)
    try:
        connect(target, record)
        profile = _capture(target, record, seconds, dest)
    finally:
        target.close()
    profile.left_out = left_out
    profile.wall = time.monotonic() - started
    return profile


def workers_clock(target: Target) -> float:
    """How far the workers' clock (worker 0's of TARGET) is ahead of this machine's, in seconds: asked once, its
    answer taken as of the middle of the round trip."""
    first = target.workers[0].index
    a = target.fleet.call(Call.command(["date", "+%s.%N"]), timeout=30, only=[first])[first]
    try:
        return float(a.out.decode().strip()) - (a.sent + a.answered) / 2
    except ValueError:
        return 0.0  # no answer here: the capture's own call says why


def _capture(target: Target, record: JobRecord, seconds: float, dest: Path) -> Profile:
    session = time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime())  # xprof's own session names: its start, UTC
    at = time.time() + workers_clock(target) + config.PROFILE_LEAD.number()
    args = ("profile", record.job_id, "--at", f"{at:.3f}", "--duration", str(seconds), "--session", session)
    call = Call.program_of(record.python, "agent.py", *args)
    names = target.worker_names
    profile = Profile(record.job_id, dest, dest / "plugins" / "profile" / session, seconds)
    answers: dict[int, ProfileAnswer] = {}
    timeout = config.PROFILE_LEAD.number() + seconds + 120  # the servers' own serialising takes a while
    for w, a in target.fleet.call(call, timeout=timeout).items():
        if a.rc != 0:
            profile.errors[names[w]] = a.why()
            continue
        try:
            answers[w] = ProfileAnswer.from_json(a.out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            profile.errors[names[w]] = str(exc)
    if answers and all(a.ended for a in answers.values()):
        raise UsageError(f"job {record.job_id} has ended: there is nothing to profile (`tpurun jobs` says how)")
    if profile.errors and not answers:
        said = [(w, f"{w}: {why}") for w, why in profile.errors.items()]
        raise UnreachableError("; ".join(each_or_by_reason(said)))
    for w, answer in answers.items():
        if answer.late > 0.05:
            profile.late[names[w]] = round(answer.late, 3)
        for p in answer.processes:
            if not p.file:
                profile.missing[process_name(w, p.slot, names[w])] = p.why
    _bring(target, answers, profile)
    return profile


def _bring(target: Target, answers: dict[int, ProfileAnswer], profile: Profile) -> None:
    """The captured files from every worker that has some, into the session's directory, each named by its
    process (w3.xplane.pb, w3-c1.xplane.pb)."""
    having = {w: a for w, a in answers.items() if any(p.file for p in a.processes)}
    if not having:
        return
    names = target.worker_names
    paths = {a.path for a in having.values()}
    staging = profile.out / f".tpurun-download-{profile.session.name}"
    profile.session.mkdir(parents=True, exist_ok=True)
    try:
        for path in paths:  # the same path on every worker but where their homes differ
            fleet = target.fleet
            got = download(fleet, path, staging)
            many = len(fleet.workers) > 1
            for g in got:
                answer = having.get(g.worker)
                if answer is None or answer.path != path:
                    continue  # nothing there, or in another path
                if g.error:
                    profile.errors[g.name] = g.error
                    continue
                root = Path(g.local) if g.tree else local_root(staging, g.name, many)
                for p in answer.processes:
                    if not p.file:
                        continue
                    name = process_name(g.worker, p.slot, names[g.worker])
                    final = profile.session / (name.replace("/", "-") + ".xplane.pb")
                    shutil.move(str(root / p.file), final)
                    profile.files.append(ProfileFile(name, final, final.stat().st_size))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
