"""Many workers on one screen: results grouped by outcome, each outcome once with its folded set of workers
(`w[0-4,6-2047]`, as `clush -b` and `dshbak -c` gather identical output); a row per worker where there are
few of them (EACH_UP_TO) or where asked; why workers cannot be reached, each reason once; exec's
`--gather`."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from tpurun import ui
from tpurun.naming import EACH_UP_TO, by_reason, fold, reason, which, worker_name

PROCESSES_UP_TO = 32  # the same for a job's processes (8 workers of 4 chips)

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def by_outcome(pairs: Iterable[tuple[T, K]]) -> list[tuple[K, list[T]]]:
    """(who, outcome) PAIRS as each outcome with who had it, in their order: the most common outcome first,
    ties in the order they first came."""
    found: dict[K, list[T]] = {}
    for name, outcome in pairs:
        found.setdefault(outcome, []).append(name)
    order = {k: i for i, k in enumerate(found)}
    return sorted(found.items(), key=lambda kv: (-len(kv[1]), order[kv[0]]))


def each_or_grouped(pairs: Sequence[tuple[T, K]], many: bool) -> list[tuple[K, list[T]]]:
    """(who, outcome) PAIRS grouped by outcome where MANY, else each alone, in order."""
    return by_outcome(pairs) if many else [(outcome, [who]) for who, outcome in pairs]


def span(seconds: Sequence[float]) -> str:
    """`0.1 s`, or `0.1–0.4 s` from the shortest to the longest."""
    lo, hi = f"{min(seconds):.1f}", f"{max(seconds):.1f}"
    return f"{lo} s" if lo == hi else f"{lo}–{hi} s"


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """A table on stderr (summaries go there: stdout is the workers' own lines)."""
    with contextlib.redirect_stdout(sys.stderr):
        ui.table(title, columns, rows)


class Unreachable:
    """Why a worker cannot be reached, said on stderr as it comes for the first EACH_UP_TO reasons (once each:
    what differs only in the workers named is one reason); the others are held and said at the end (`rest`),
    each reason once (`by_reason`)."""

    def __init__(self) -> None:
        self.said: Counter[str] = Counter()
        self.held: Counter[str] = Counter()
        self.reasons: set[str] = set()

    def __call__(self, why: str) -> None:
        kind = reason(why)
        if kind not in self.reasons and len(self.reasons) < EACH_UP_TO:
            ui.err().print(f"error: {why}", markup=False)
            self.said[why] += 1
            self.reasons.add(kind)
        else:
            self.held[why] += 1

    def rest(self, failures: Sequence[tuple[str, str]], every: bool, also: Collection[str] = ()) -> None:
        """The held reasons, with their workers' names from FAILURES ((name, why) of each unreachable worker,
        in order); EVERY: also those of the workers lost after their start (no row of the summary says why), and
        ALSO those reasons whatever EVERY."""
        said, held, rest = Counter(self.said), Counter(self.held), []
        for name, why in failures:
            if why in also and self.said[why]:
                continue  # a relay's subtree: said already, in words that name every worker of it
            if said[why] > 0:
                said[why] -= 1
            elif every or held[why] > 0 or why in also:
                held[why] -= 1
                rest.append((name, why))
        for line in by_reason(rest):
            ui.err().print(f"error: {line}", markup=False)


def processes(title: str, ended: Sequence[tuple[str, str, int | None, float, str]]) -> None:
    """How a job's processes ended, on stderr: ENDED is (name, status, exit code, seconds, last line) each; a
    row each for a few (PROCESSES_UP_TO), else a row per (status, exit code) with its folded processes, the
    last line where they all share it."""
    rows: list[tuple[object, ...]]
    if len(ended) <= PROCESSES_UP_TO:
        rows = [
            (name, status, "-" if code is None else code, f"{t:.1f} s" if t else "-", last[:60])
            for name, status, code, t, last in ended
        ]
        table(title, ["core", "status", "exit", "time", "last line"], rows)
        return
    groups = by_outcome((row, (row[1], row[2])) for row in ended)
    rows = []
    for (status, code), members in groups:
        times = [t for _, _, _, t, _ in members if t]
        lasts = {last for *_, last in members}
        rows.append(
            (
                status,
                "-" if code is None else code,
                f"{len(members):,}",
                which([m[0] for m in members]),
                span(times) if times else "-",
                lasts.pop()[:60] if len(lasts) == 1 else "",
            )
        )
    table(title, ["status", "exit", "processes", "which", "time", "last line"], rows)


class Gathered:
    """`exec --gather`: every worker's lines kept (a sink), then printed once per distinct output under the
    workers that printed it, as `clush -b` does: a header with their folded set and how many, then the
    lines (stdout's on stdout, stderr's on stderr), in the order of each group's first worker."""

    RULE = "-" * 15

    def __init__(self) -> None:
        self.lines: dict[int, list[tuple[str, str]]] = {}
        self.lock = threading.Lock()

    def __call__(self, worker: int, stream: str, line: str) -> None:
        with self.lock:
            self.lines.setdefault(worker, []).append((stream, line))

    def print(self, names: Mapping[int, str]) -> None:
        groups: dict[tuple[tuple[str, str], ...], list[int]] = {}
        for w in sorted(self.lines):
            groups.setdefault(tuple(self.lines[w]), []).append(w)
        for lines, workers in sorted(groups.items(), key=lambda kv: kv[1][0]):
            members = [names.get(w) or worker_name(w) for w in workers]
            head = f"{self.RULE}\n{fold(members)} ({len(members):,})\n{self.RULE}\n"
            try:
                sys.stdout.write(head)
                last = "out"
                for stream, text in lines:
                    if stream != last:  # the worker's order kept where stdout and stderr go to one place
                        (sys.stdout if last == "out" else sys.stderr).flush()
                        last = stream
                    (sys.stdout if stream == "out" else sys.stderr).write(text + "\n")
                sys.stdout.flush()
                sys.stderr.flush()
            except BrokenPipeError:
                return
