"""`tpurun stacks`: the stack of every thread of every process of a job on every worker, asked at once, and
grouped: processes whose main threads stand in the same place form one group, the smallest groups (the odd
ones out) first. The whole dump (every thread of every process, as each was read) is kept on disk.

Each worker's agent reads its processes (worker/agent_stacks.py: their own faulthandler, or py-spy where
installed) and parses what it read into `protocol_calls.ProcessStack`s; this module gathers, groups and words."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpurun.errors import ExitCode, UnreachableError, UsageError
from tpurun.fleet.interface import Call
from tpurun.fleet.targets import Target
from tpurun.job.env_contract import process_name
from tpurun.job.records import JobRecord, connect, list_records
from tpurun.naming import each_or_by_reason
from tpurun.settings import Settings
from tpurun.worker.protocol_calls import ProcessStack

ASK_TIMEOUT = 10.0  # seconds a worker's agent waits for its processes' answers


@dataclass(frozen=True)
class Frame:
    file: str
    line: int  # 0: a native frame (py-spy's), FILE its library
    function: str
    source: str = ""

    @property
    def python(self) -> bool:
        return self.line > 0


@dataclass
class Process:
    """One process of the job and what its stacks say (none: WHY)."""

    worker: int
    name: str  # w3/c1, w3 (the host process), w3/c1+4242 (a child of c1's process)
    stack: ProcessStack

    @property
    def main(self) -> list[Frame]:
        """Its main thread's frames, innermost first."""
        thread = next((t for t in self.stack.threads if t.main), None)
        return [] if thread is None else [Frame(*f) for f in thread.frames]


@dataclass
class Group:
    """Processes whose main threads stand in the same place (the same Python frames)."""

    frames: list[Frame]  # innermost first, of the first member
    members: list[Process] = field(default_factory=list)

    def where(self, cwd: str) -> str:
        """Where they stand, in the script's words: the innermost Python call, and the script's own line that
        led there (a file under the job's directory CWD)."""
        python = [f for f in self.frames if f.python]
        if not python:
            return "in no Python frame"
        inner = python[0]
        mine = next((f for f in python if _under(f.file, cwd)), None)
        if mine is None:
            return f"in {inner.function} ({Path(inner.file).name}:{inner.line})"
        at = f"{_relative(mine.file, cwd)}:{mine.line}"
        if mine is inner:  # stopped in the script's own line: a call into C (a sleep, a lock), or busy there
            return f"at {at}" + (f" ({inner.source})" if inner.source else "")
        return f"in {inner.function} at {at}"


@dataclass
class Stacks:
    """A job's stacks: the groups (odd ones out first), the processes without stacks, the whole dump's file."""

    job_id: str
    cwd: str
    groups: list[Group]
    unread: list[Process]
    path: Path
    errors: dict[str, str] = field(default_factory=dict)  # worker name -> why it could not be asked

    @property
    def exit_code(self) -> ExitCode:
        """`stacks`' exit code: 4 where a worker could not be asked, else 0 (a job with no process left included)."""
        return ExitCode.UNREACHABLE if self.errors else ExitCode.OK

    def summary(self) -> str:
        """One line: `31 processes in all_reduce at train.py:88 · w17/c2 at data.py:40 (time.sleep(60))`."""
        parts = []
        for g in self.groups:
            who = g.members[0].name if len(g.members) == 1 else f"{len(g.members)} processes"
            parts.append(f"{who} {g.where(self.cwd)}")
        return " · ".join(parts) if parts else "no stacks"

    def to_json(self) -> dict:
        return {
            "job_id": self.job_id,
            "summary": self.summary(),
            "groups": [
                {
                    "where": g.where(self.cwd),
                    "processes": [p.name for p in g.members],
                    "frames": [[f.file, f.line, f.function, f.source] for f in g.frames],
                }
                for g in self.groups
            ],
            "unread": [{"process": p.name, "why": p.stack.why} for p in self.unread],
            "dump": str(self.path),
            "errors": self.errors,
        }


def _under(file: str, cwd: str) -> bool:
    return bool(cwd) and (file + "/").startswith(cwd.rstrip("/") + "/") and "/site-packages/" not in file


def _relative(file: str, cwd: str) -> str:
    return file[len(cwd.rstrip("/")) + 1 :] if _under(file, cwd) else file


def latest_job(s: Settings) -> str:
    """The job `stacks` means without one named: the newest started from here on the settings' TPU (any TPU,
    none set)."""
    tpu = s.tpu.value
    records = [r for r in list_records(s.home_path) if not tpu or r.tpu == tpu]
    if not records:
        raise UsageError("no job to look at: name one (`tpurun jobs` lists them)")
    return max(records, key=lambda r: (r.created, r.job_id)).job_id


def collect(s: Settings, job_id: str | None, *, worker: str = "all") -> Stacks:
    """Every process of JOB_ID (None: `latest_job`) on WORKER (a --worker spec) with its stacks, grouped; the
    whole dump written under tpurun's home."""
    record = JobRecord.load(s.home_path, job_id or latest_job(s))
    target = record.target(s, worker)
    try:
        connect(target, record)
        return gather(target, record.python, record.job_id, s.home_path)
    finally:
        target.close()


def gather(target: Target, python: str, job_id: str, home: Path) -> Stacks:
    """Every process of JOB_ID on TARGET's workers (connected, checked to be the job's TPU) with its stacks,
    grouped; the whole dump written under HOME. Raises UnreachableError when no worker answered."""
    answers: dict[int, list[ProcessStack]] = {}
    errors: dict[int, str] = {}

    args = ("stacks", job_id, "--timeout", str(ASK_TIMEOUT))
    for w, a in target.fleet.call(Call.program_of(python, "agent.py", *args), timeout=ASK_TIMEOUT + 60).items():
        if a.rc is None:
            errors[w] = a.error
        elif a.rc != 0:
            errors[w] = (a.err.strip().splitlines() or [f"the agent exited {a.rc}"])[-1]
        else:
            try:
                answers[w] = [ProcessStack.from_dict(p) for p in json.loads(a.out.decode())]
            except ValueError as exc:
                errors[w] = str(exc)
    names = {w.index: w.name for w in target.all_workers}
    if errors and not answers:
        said = [(names[w], f"{names[w]}: {why}") for w, why in sorted(errors.items())]
        raise UnreachableError("; ".join(each_or_by_reason(said)))
    processes = [Process(w, _name(w, ps, names[w]), ps) for w in sorted(answers) for ps in answers[w]]
    stacks = group(job_id, processes, home / "stacks")
    stacks.errors = {names[w]: why for w, why in sorted(errors.items())}
    return stacks


def _name(worker: int, ps: ProcessStack, worker_name: str) -> str:
    if ps.slot is None:
        return f"{worker_name}+{ps.pid}"
    name = process_name(worker, ps.slot, worker_name)
    return f"{name}+{ps.pid}" if ps.child else name


def group(job_id: str, processes: list[Process], where: Path) -> Stacks:
    """PROCESSES grouped by where their main threads stand (the Python frames: native addresses differ
    between processes), the smallest groups first; the whole dump written under WHERE."""
    groups: dict[tuple, Group] = {}
    unread = []
    for p in processes:
        if not p.stack.threads:
            unread.append(p)
            continue
        main = p.main
        key = tuple((f.file, f.line, f.function) for f in main if f.python)
        groups.setdefault(key, Group(main)).members.append(p)
    ordered = sorted(groups.values(), key=lambda g: (len(g.members), g.members[0].worker, g.members[0].name))
    path = _write(job_id, processes, where)
    cwd = next((p.stack.cwd for p in processes if p.stack.slot is not None and not p.stack.child), "")
    return Stacks(job_id, cwd, ordered, unread, path)


def _write(job_id: str, processes: list[Process], where: Path) -> Path:
    """The whole dump: every process as its reader wrote it, under a header naming it."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{job_id}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    with path.open("w") as f:
        for p in processes:
            ps = p.stack
            f.write(f"== {p.name} pid {ps.pid} (parent {ps.ppid}): {ps.argv}\n")
            f.write(f"-- read by {ps.source}" + (f": {ps.why}" if ps.why else "") + "\n")
            f.write(ps.dump.rstrip("\n") + "\n\n")
    return path
