"""What a sync sends, in words: the warning before a large one (above TPURUN_SYNC_WARN_MB, naming the largest
files and the line that leaves them out) and the one line after it, for `tpurun sync` and `train` alike.

The words are made here and handed to a callback or returned; the command prints them.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpurun import config, ignore, ui
from tpurun.errors import UsageError
from tpurun.sync.stream import Manifest, Needs, WorkerStats

LARGEST = 3  # files the warning names at most: the largest, each more than 1/SHARE of what a worker is sent
SHARE = 20


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def warn_limit() -> float:
    """TPURUN_SYNC_WARN_MB in bytes (0: no warning), refused before anything is sent when it is no number."""
    raw = config.SYNC_WARN_MB.raw()
    try:
        limit = float(raw)
    except ValueError:
        limit = -1.0
    if not limit >= 0:  # (NaN too)
        raise UsageError(
            f"{config.SYNC_WARN_MB.name}={raw!r} is not a size: set it to a number of megabytes "
            "(the most a sync sends to a worker without a warning; 0: never warn)"
        )
    return limit * 1e6


def _ignore_file(src: Path) -> str:
    """SRC's .tpurunignore as the user would type it from here."""
    path = src / ".tpurunignore"
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def size_warning(manifest: Manifest, needs: Sequence[Sequence[int]], src: Path, limit: float) -> str | None:
    """The warning for a sync of SRC whose workers need NEEDS (indexes into MANIFEST's files), when one of
    them needs more than LIMIT bytes: how much, the largest files, and the command that leaves them out of
    every later sync (their exact paths in SRC's .tpurunignore); None below it."""
    files = manifest.files
    most = max((sum(files[i].size for i in need) for need in needs), default=0)
    if not limit or most <= limit:
        return None
    count = max(len(need) for need in needs)
    sent = sorted({i for need in needs for i in need}, key=lambda i: (-files[i].size, files[i].path))
    largest = [files[i] for i in sent[:LARGEST] if files[i].size * SHARE >= most] or [files[sent[0]]]
    named = ", ".join(f"{f.path} ({ui.size(f.size)})" for f in largest)
    rules = " ".join(shlex.quote(ignore.pattern(f.path)) for f in largest)
    whom = "each worker" if len({tuple(need) for need in needs}) == 1 else "a worker"
    return (
        f"this sync sends {ui.size(most)} in {_count(count, 'file')} to {whom}, more than "
        f"{config.SYNC_WARN_MB.name}={config.SYNC_WARN_MB.raw()} MB; the largest: {named}. To leave "
        f"{'it' if len(largest) == 1 else 'them'} out of the next syncs and trains: "
        f"printf '%s\\n' {rules} >> {shlex.quote(_ignore_file(src))}"
    )


def size_check(src: Path, warn: Callable[[str], None]) -> Needs:
    """A callback for push(on_needs=...): WARN hears size_warning's line when a sync of SRC sends more than
    TPURUN_SYNC_WARN_MB to a worker. The limit is read (and a bad one refused) now, before anything is sent."""
    limit = warn_limit()

    def check(manifest: Manifest, needs: list[tuple[int, ...]]) -> None:
        text = size_warning(manifest, needs, src, limit)
        if text:
            warn(text)

    return check


@dataclass(frozen=True)
class Totals:
    """What one sync sent, over the workers it reached: to the worker sent the most."""

    workers: int
    files: int  # files and symlinks written
    nbytes: int
    unchanged: int  # files and symlinks that worker had already
    even: bool  # every worker was sent the same

    def line(self) -> str:
        """`3 files (400.0 MB) sent to each of 4 workers, 12 unchanged`."""
        up_to, least = ("", "") if self.even else ("up to ", "at least ")
        whom = f"each of {self.workers} workers" if self.workers > 1 else "the worker"
        return f"{up_to}{_count(self.files, 'file')} ({ui.size(self.nbytes)}) sent to {whom}, {least}{self.unchanged} unchanged"


def totals(stats: Sequence[WorkerStats]) -> Totals:
    """The Totals of STATS, leaving out the workers that could not be synced at all."""
    reached = [s for s in stats if not s.error]
    most = max(reached, key=lambda s: (s.bytes_sent, s.files_sent), default=None)
    if most is None:
        return Totals(0, 0, 0, 0, True)
    even = len({(s.files_sent, s.bytes_sent) for s in reached}) == 1
    return Totals(len(reached), most.files_sent, most.bytes_sent, most.files_total - most.files_sent, even)
