"""Before a job starts: the agent's `preflight` on every worker says which jobs run there and what decides a
job there: the job's Python and the versions of the packages that must match across a pod (the agent's
`versions.DECISIVE`, and what the script's requirements.txt names). A job is refused on a busy TPU, and on
workers that differ (version skew) unless the user allows it.

The same answer holds every worker for the job (`claim`) until it starts or is given up: the first worker
first, then every other at once, so that of two jobs started at once on one TPU only one holds it; the
other is refused before anything of it is synced, recorded or started."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tpurun.errors import TpuBusy, TpurunError, UnreachableError, UsageError
from tpurun.job.setup import REQUIREMENTS
from tpurun.job.status import ACTIVE
from tpurun.targets import Target
from tpurun.transport import bundle
from tpurun.transport.fanout import each
from tpurun.transport.runner import Runner, Stream, open_stream
from tpurun.worker.protocol import AgentExit
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


def ask(target: Target, python: str, packages: list[str]) -> dict[int, Preflight]:
    """Every connected worker's answer (worker index -> answer); the agent bundle is installed where it is
    missing. Raises UnreachableError naming the workers that did not answer."""
    args = ("preflight", "--packages", ",".join(packages))
    failed: dict[int, str] = {}

    def one(runner: Runner) -> Preflight | None:
        try:
            rc, out, err = bundle.run_program(runner, python, "agent.py", *args)
            if rc == 0:
                return Preflight.from_json(out.decode().strip().splitlines()[-1])
            why = err.strip().splitlines()[-1:] or [f"exit {rc}"]
            failed[runner.worker.index] = f"{runner.worker.name}: {python}: {why[0]}"
        except (TpurunError, OSError, EOFError, ValueError, IndexError) as exc:
            failed[runner.worker.index] = f"{runner.worker.name}: {exc}"
        return None

    answers = each(target.runners, one, name="preflight")
    if failed:
        raise UnreachableError("; ".join(failed[w] for w in sorted(failed)))
    return {w: a for w, a in answers.items() if a is not None}


class Claim:
    """The workers held for one job about to start: on each, the agent's `preflight --claim JOB` holds the
    worker while its stdin stays open. Closing it (`release`), or this process ending however it ends, lets the
    worker go; the job's start on a worker ends that worker's hold (the job holds the worker from then on)."""

    def __init__(self) -> None:
        self.streams: dict[int, Stream] = {}
        self.lock = threading.Lock()

    def keep(self, worker: int, stream: Stream) -> None:
        with self.lock:
            self.streams[worker] = stream

    def lost(self) -> list[int]:
        """The workers whose hold has ended (its process was killed: `tpurun kill-stale` ends holds)."""
        return sorted(w for w, stream in self.streams.items() if stream.read(0) is None)

    def release(self) -> None:
        """Let every worker go, and wait (a few seconds at most) until each has."""
        with self.lock:
            streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            stream.close_stdin()
        deadline = time.monotonic() + RELEASE_WAIT
        for stream in streams:
            try:
                while time.monotonic() < deadline:
                    if stream.read(0.1) is None:
                        stream.wait()
                        break
            except (TpurunError, OSError, EOFError):
                pass


ANSWER_WAIT = 60.0  # seconds a worker's agent has to answer a preflight
RELEASE_WAIT = 5.0  # seconds a release waits for the holds to end


def claim(target: Target, python: str, packages: list[str], job_id: str) -> tuple[dict[int, Preflight], Claim]:
    """Every worker's answer, every worker held for JOB_ID: the agents are started on every worker at once and
    told to claim their worker in turn, the first worker first, then every other at once, so that of two jobs
    started at once on one TPU only the one that holds the first worker can hold the others (refused on the
    first, the others only answer). Raises TpuBusy when another job holds any worker (runs there, or holds it for
    its own start), and UnreachableError naming the workers that did not answer; then nothing stays held."""
    held = Claim()
    argv = bundle.program_argv(python, "agent.py", "preflight", "--packages", ",".join(packages), "--claim", job_id)
    failed: dict[int, str] = {}
    asks: dict[int, _Ask] = {}

    def start(runner: Runner) -> None:
        try:
            asks[runner.worker.index] = _Ask(runner, argv)
        except (TpurunError, OSError, EOFError) as exc:
            failed[runner.worker.index] = f"{runner.worker.name}: {exc}"

    def turn(claiming: bool) -> Callable[[Runner], Preflight | None]:
        def one(runner: Runner) -> Preflight | None:
            w = runner.worker.index
            try:
                answer = asks[w].answer(claiming) if w in asks else None
            except (TpurunError, OSError, EOFError, ValueError) as exc:
                failed[w] = f"{runner.worker.name}: {python}: {exc}"
                return None
            if answer is not None and claiming and not answer.held_by:
                held.keep(w, asks[w].stream)
            return answer

        return one

    answers: dict[int, Preflight] = {}
    try:
        each(target.runners, start, name="preflight")
        for group in (target.runners[:1], target.runners[1:]):
            claiming = not failed and not any(a.held_by for a in answers.values())
            answers.update((w, a) for w, a in each(group, turn(claiming), name="claim").items() if a is not None)
        if failed:
            raise UnreachableError("; ".join(failed[w] for w in sorted(failed)))
        refuse_if_busy(target, answers)
    except BaseException:
        held.release()
        raise
    return answers, held


class _Ask:
    """One worker's `preflight --claim`, started at once: it answers when told whether to claim the worker (a
    line on its stdin) or not (its stdin closed). The bundle is installed where it is missing."""

    def __init__(self, runner: Runner, argv: list[str]) -> None:
        self.runner, self.argv = runner, argv
        self.stream = open_stream(runner, argv)

    def answer(self, claiming: bool) -> Preflight:
        for installed in (False, True):
            try:
                if claiming:
                    self.stream.write(b"\n")
                else:
                    self.stream.close_stdin()
            except (OSError, EOFError):
                pass  # it has ended: reading says why
            line = self._line()
            if line is not None:
                answer = Preflight.from_json(line)
                if not claiming or answer.held_by:
                    self.stream.wait()  # it holds nothing: it has ended, or is ending
                return answer
            rc = self.stream.wait()
            if rc == AgentExit.MISSING and not installed:
                bundle.install(self.runner)
                self.stream = open_stream(self.runner, self.argv)
                continue
            why = self.stream.stderr_text().strip().splitlines()[-1:] or [f"exit {rc}"]
            raise UnreachableError(why[0])
        raise AssertionError("the bundle was installed")

    def _line(self) -> str | None:
        """The answer's line, or None when the agent ended without one."""
        buf = b""
        deadline = time.monotonic() + ANSWER_WAIT
        while b"\n" not in buf:
            data = self.stream.read(0.2)
            if data is None:
                return None
            buf += data
            if time.monotonic() > deadline:
                self.stream.kill()
                raise UnreachableError(f"its agent did not answer within {ANSWER_WAIT:.0f} s")
        return buf.split(b"\n", 1)[0].decode()


def from_probe(answer: DoctorAnswer) -> Preflight | None:
    """A doctor probe's answer (env_contract.PROBE_SCRIPT's, its `python_probe`) as a preflight's, to
    compare the same way; None where the probe failed."""
    p = answer.python_probe
    if p.get("error") or "python_version" not in p:
        return None
    return Preflight([], str(p["python_version"]), str(p.get("python")), dict(p.get("packages") or {}))


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
    on = ", ".join(where)
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
        return "; ".join(f"{w} {v} on {', '.join(names)} ({c} elsewhere)" for w, v, names, c in self.odd_ones())


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
