"""Before a job starts: one round trip to every worker (the agent's `preflight`) says which jobs run there
and what decides a job there: the job's Python and the versions of the packages that must match across a
pod (the agent's `versions.DECISIVE`, and what the script's requirements.txt names). A job is refused on a
busy TPU, and on workers that differ (version skew) unless the user allows it."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpurun.errors import TpuBusy, TpurunError, UnreachableError, UsageError
from tpurun.job.setup import REQUIREMENTS
from tpurun.job.status import ACTIVE
from tpurun.targets import Target
from tpurun.transport import bundle
from tpurun.transport.fanout import each
from tpurun.transport.runner import Runner
from tpurun.worker.protocol import Preflight

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


def from_probe(probe: dict[str, Any]) -> Preflight | None:
    """A doctor probe's answer (env_contract.PROBE_SCRIPT's, under "python_probe") as a preflight's, to
    compare the same way; None where the probe failed."""
    p = probe.get("python_probe") or {}
    if p.get("error") or "python_version" not in p:
        return None
    return Preflight([], str(p["python_version"]), str(p.get("python")), dict(p.get("packages") or {}))


def refuse_if_busy(target: Target, answers: dict[int, Preflight]) -> None:
    """Raise TpuBusy when a job runs on any worker: before a job id is shown, code synced or a record written.
    (The agents refuse a second job on their own too, should one slip in meanwhile.)"""
    busy: dict[str, list[str]] = {}
    for w, answer in sorted(answers.items()):
        for st in answer.jobs:
            if st.get("status") in ACTIVE and st.get("supervisor_alive", True):
                busy.setdefault(str(st.get("job_id")), []).append(target.all_workers[w].name)
    if busy:
        job, where = sorted(busy.items())[0]
        raise TpuBusy(
            f"{target.name} is busy: job {job} runs on {', '.join(where)}; nothing was started",
            hint=f"`tpurun cancel {job}` first, or wait: `tpurun logs {job} --follow`",
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
