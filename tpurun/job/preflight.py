"""Before a job starts: the agent's `preflight` on every worker says which jobs run there and what decides a
job there: the job's Python and the versions of the packages that must match across a pod (the agent's
`versions.DECISIVE`, and what the script's requirements.txt names). A job is refused on a busy TPU, and on
workers that differ (version skew) unless the user allows it.

The same answer holds every worker for the job (`claim`) until it starts or is given up: the first worker
first, then every other at once, so that of two jobs started at once on one TPU only one holds it; the
other is refused before anything of it is synced, recorded or started. The agent that holds a worker is the one
that then starts the job there and streams it (attempt.py)."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tpurun.errors import TpuBusy, TpurunError, UnreachableError, UsageError
from tpurun.fleet.interface import Call, Session
from tpurun.fleet.targets import Target
from tpurun.job.setup import REQUIREMENTS
from tpurun.job.status import ACTIVE
from tpurun.naming import each_or_by_reason, listed
from tpurun.worker.protocol_calls import Preflight

if TYPE_CHECKING:
    from tpurun.worker.probe import DoctorAnswer

NOT_INSTALLED = "not installed"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def requirement_names(script: str, local_dir: Path) -> list[str]:
    """The distributions the requirements.txt beside SCRIPT names (none without one): what it pins must
    match on every worker too."""
    path = local_dir / Path(script).parent / REQUIREMENTS
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    names = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-") or "://" in line:  # options, other files, URLs
            continue
        m = _NAME.match(line)
        if m and m.group(0) not in names:
            names.append(m.group(0))
    return names


def _alike(target: Target, failed: dict[int, str]) -> list[str]:
    """Why the FAILED workers did not answer: each of a few, else each reason once with the workers alike."""
    return each_or_by_reason([(target.all_workers[w].name, failed[w]) for w in sorted(failed)])


def ask(target: Target, python: str, packages: list[str]) -> dict[int, Preflight]:
    """Every connected worker's answer (worker index -> answer); the agent bundle is installed where it is
    missing. Raises UnreachableError naming the workers that did not answer."""
    args = ("preflight", "--packages", ",".join(packages))
    failed: dict[int, str] = {}
    answers: dict[int, Preflight] = {}
    for w, a in target.fleet.call(Call.program_of(python, "agent.py", *args)).items():
        name = target.all_workers[w].name
        if a.rc is None:
            failed[w] = f"{name}: {a.error}"
            continue
        if a.rc != 0:
            failed[w] = f"{name}: {python}: {a.why()}"
            continue
        try:
            answers[w] = Preflight.from_json(a.out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            failed[w] = f"{name}: {exc}"
    if failed:
        raise UnreachableError("; ".join(_alike(target, failed)))
    return answers


class Claim:
    """The workers held for one job about to start: on each, the agent's `preflight --claim JOB` holds the
    worker while its stdin stays open. Closing it (`release`), or this process ending however it ends, lets the
    worker go. At the start the sessions are handed over (`hand_over`): each holding agent is told its worker's
    spec and starts the job there and streams it, the job holding the worker from then on."""

    def __init__(self) -> None:
        self.sessions: dict[int, Session] = {}
        self.lock = threading.Lock()

    def keep(self, session: Session) -> None:
        with self.lock:
            self.sessions[session.worker] = session

    def lost(self) -> list[int]:
        """The workers whose hold has ended (its process was killed: `tpurun kill-stale` ends holds)."""
        return sorted(w for w, session in self.sessions.items() if not session.alive())

    def hand_over(self) -> dict[int, Session]:
        """Every session still held, no longer this claim's: each becomes its worker's start of the job."""
        with self.lock:
            sessions, self.sessions = self.sessions, {}
        return sessions

    def release(self) -> None:
        """Let every worker go, and wait (a few seconds at most) until each has."""
        with self.lock:
            sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            session.release()
        deadline = time.monotonic() + RELEASE_WAIT
        for session in sessions:
            session.wait_end(deadline)


ANSWER_WAIT = 60.0  # seconds a worker's agent has to answer a preflight
RELEASE_WAIT = 5.0  # seconds a release waits for the holds to end


def claim(target: Target, python: str, packages: list[str], job_id: str) -> tuple[dict[int, Preflight], Claim]:
    """Every worker's answer, every worker held for JOB_ID: the agents are started on every worker at once and
    told to claim their worker in turn, the first worker first, then every other at once, so that of two jobs
    started at once on one TPU only the one that holds the first worker can hold the others (refused on the
    first, the others only answer). Raises TpuBusy when another job holds any worker (runs there, or holds it for
    its own start), and UnreachableError naming the workers that did not answer; then nothing stays held."""
    held = Claim()
    fleet = target.fleet
    call = Call.program_of(python, "agent.py", "preflight", "--packages", ",".join(packages), "--claim", job_id)
    failed: dict[int, str] = {}
    answers: dict[int, Preflight] = {}
    sessions: dict[int, Session] = {}
    try:
        for w, opened in fleet.open(call).items():
            if isinstance(opened, str):
                failed[w] = f"{target.all_workers[w].name}: {opened}"
            else:
                sessions[w] = opened
        order = sorted(sessions)
        for group in (order[:1], order[1:]):
            claiming = not failed and not any(a.held_by for a in answers.values())
            said = fleet.answer({w: sessions[w] for w in group}, b"\n" if claiming else None, ANSWER_WAIT)
            for w, line in said.items():
                try:
                    if isinstance(line, Exception):
                        raise line
                    answer = Preflight.from_json(line)
                except (TpurunError, ValueError) as exc:
                    failed[w] = f"{target.all_workers[w].name}: {python}: {exc}"
                    continue
                answers[w] = answer
                if claiming and not answer.held_by:
                    held.keep(sessions[w])
                else:
                    sessions[w].ended()  # it holds nothing: it has ended, or is ending
        if failed:
            raise UnreachableError("; ".join(_alike(target, failed)))
        refuse_if_busy(target, answers)
    except BaseException:
        held.release()
        raise
    return answers, held


def from_probe(answer: DoctorAnswer) -> Preflight | None:
    """A doctor probe's answer (what the user's Python sees, its `python_probe`) as a preflight's, to compare the
    same way; None where the probe failed."""
    p = answer.python_probe
    if p.error or p.python_version is None:
        return None
    return Preflight([], str(p.python_version), str(p.python), dict(p.packages or {}))


def refuse_if_busy(target: Target, answers: dict[int, Preflight]) -> None:
    """Raise TpuBusy when another job holds any worker (it runs there, or holds it for its start): before a job id
    is shown, code synced or a record written. (The agents refuse a second job on their own too.)"""
    busy: dict[str, list[str]] = {}
    for w, answer in sorted(answers.items()):
        if answer.held_by:
            busy.setdefault(answer.held_by, []).append(target.all_workers[w].name)
    if not busy:
        return
    job, where = sorted(busy.items())[0]
    on = listed(where)
    if any(st.job_id == job and st.status in ACTIVE for a in answers.values() for st in a.jobs):
        raise TpuBusy(
            f"{target.name} is busy: job {job} runs on {on}; nothing was started",
            hint=f"`tpurun cancel {job}` first, or wait: `tpurun logs {job} --follow`",
        )
    raise TpuBusy(
        f"{target.name} is busy: job {job} is starting on {on} (another `tpurun train`); nothing was started",
        hint=f"wait, or stop that train; once it runs, `tpurun cancel {job}` where it was started stops it",
    )


@dataclass(frozen=True)
class Skew:
    """What differs between workers: for each thing (python, a package), each version found and the workers
    that have it, the most common first."""

    rows: tuple[tuple[str, str, tuple[str, ...]], ...]  # (what, version or NOT_INSTALLED, worker names)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def to_json(self) -> list[dict[str, object]]:
        return [{"what": what, "version": v, "workers": list(names)} for what, v, names in self.rows]

    def odd_ones(self) -> list[tuple[str, str, tuple[str, ...], str]]:
        """Each version that is not the most common of its thing: (what, version, its workers, the most
        common version)."""
        common: dict[str, str] = {}
        out = []
        for what, version, names in self.rows:
            if common.setdefault(what, version) != version:
                out.append((what, version, names, common[what]))
        return out

    def summary(self) -> str:
        """One line: what differs, and where (the odd ones out)."""
        return "; ".join(f"{w} {v} on {listed(names)} ({c} elsewhere)" for w, v, names, c in self.odd_ones())


def compare(target: Target, answers: dict[int, Preflight]) -> Skew:
    """The skew between the workers' answers (none with one worker)."""
    found: dict[str, dict[str, list[str]]] = {}
    for w, answer in sorted(answers.items()):
        name = target.all_workers[w].name
        found.setdefault("python", {}).setdefault(answer.python, []).append(name)
        for package, version in answer.packages.items():
            found.setdefault(package, {}).setdefault(version or NOT_INSTALLED, []).append(name)
    rows = []
    for what, by_version in found.items():
        if len(by_version) < 2:
            continue
        counts = Counter({v: len(names) for v, names in by_version.items()})
        for version, _ in counts.most_common():
            rows.append((what, version, tuple(by_version[version])))
    return Skew(tuple(rows))


class VersionSkew(UsageError):
    """The workers differ in what decides a job: nothing was started."""

    def __init__(self, target: str, skew: Skew) -> None:
        super().__init__(
            f"the workers of {target} differ: {skew.summary()}; nothing was started",
            hint="install the same versions on every worker (`tpurun exec -- PYTHON -m pip install ...`), or pass "
            "--allow-skew to start anyway",
        )
        self.skew = skew


def refuse_skew(target: Target, skew: Skew, allow: bool) -> None:
    """Raise VersionSkew for SKEW unless ALLOW."""
    if skew and not allow:
        raise VersionSkew(target.name, skew)
