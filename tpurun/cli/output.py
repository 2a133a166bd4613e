"""How commands show what happens on many workers: prefixed lines, per-worker summaries, progress, and
Ctrl-C turned into a clean stop."""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from tpurun import ui
from tpurun.cli import grouped
from tpurun.cli.grouped import Unreachable
from tpurun.errors import ExitCode
from tpurun.job.env_contract import process_name
from tpurun.job.preflight import Skew
from tpurun.job.stacks import Stacks
from tpurun.naming import EACH_UP_TO, each_or_by_reason, listed, names_them, which, worker_name
from tpurun.remote import ExecResult, RunResult

_COLOURS = ["cyan", "magenta", "green", "yellow", "blue", "red"]
_ANSI = {"cyan": 36, "magenta": 35, "green": 32, "yellow": 33, "blue": 34, "red": 31}


class LineWriter:
    """Whole prefixed lines to stdout/stderr, one writer at a time: lines are never split or merged.
    NAMES: how each worker index is shown (w3, or s1/w1 in a multislice TPU)."""

    def __init__(self, colour: bool, names: Mapping[int, str] | None = None) -> None:
        self.colour = colour
        self.names = names or {}
        self.lock = threading.Lock()

    def prefix(self, tag: str, index: int) -> str:
        if not self.colour:
            return f"[{tag}] "
        code = _ANSI[_COLOURS[index % len(_COLOURS)]]
        return f"\x1b[{code}m[{tag}]\x1b[0m "

    def __call__(self, worker: int, stream: str, line: str) -> None:
        self.write(self.names.get(worker) or worker_name(worker), worker, stream, line)

    def write(self, tag: str, index: int, stream: str, line: str) -> None:
        target = sys.stdout if stream == "out" else sys.stderr
        text = self.prefix(tag, index) + line + "\n"
        with self.lock, ui.TERMINAL:
            try:
                target.write(text)
                target.flush()
            except BrokenPipeError:
                pass


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event, interrupted: threading.Event | None = None) -> Iterator[dict[str, bool]]:
    """SIGINT and SIGTERM set STOP (remote groups are then stopped) instead of killing tpurun outright, and
    INTERRUPTED (which, unlike STOP, nothing but a signal sets: exec's fail-fast sets STOP too)."""
    seen = {"interrupted": False}

    def handler(signum: int, frame: object) -> None:
        if seen["interrupted"]:
            ui.info("still stopping remote processes… (they are killed after the grace period)")
        seen["interrupted"] = True
        if interrupted is not None:
            interrupted.set()
        stop.set()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield seen
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def summarize(
    done: ExecResult,
    names: Mapping[int, str] | None = None,
    command: Sequence[str] = (),
    *,
    by_worker: bool = False,
    unreachable: Unreachable | None = None,
) -> ExitCode:
    """Print the summary of an exec of COMMAND on stderr and return its exit code, DONE's: a row per worker for a
    few workers or BY_WORKER, else a row per outcome; the reasons UNREACHABLE held back; why it failed."""
    results = done.results
    names = names or {}

    def name(r: RunResult) -> str:
        return names.get(r.worker) or worker_name(r.worker)

    unreached = [r for r in results if r.exit_code is None]
    failed = [r for r in results if r.exit_code not in (0, None)]
    failures = [(name(r), r.error) for r in unreached]
    # a relay lost with its subtree: its reason names them all, said once under the rows rather than in each
    subtrees = {why for why in {e for _, e in failures} if names_them([f for f in failures if f[1] == why], 2)}
    if by_worker or len(results) <= EACH_UP_TO:
        if len(results) > 1 or failed or unreached:
            grouped.table(
                None,
                ["worker", "result", "time"],
                [(name(r), _status(r, reason=r.error not in subtrees), f"{r.duration:.1f} s") for r in results],
            )
    else:
        rows = []
        for status, members in grouped.by_outcome((r, _status(r, reason=False)) for r in results):
            time = "-" if status == "unreachable" else grouped.span([r.duration for r in members])
            rows.append((status, f"{len(members):,}", which([name(r) for r in members]), time))
        grouped.table(None, ["result", "workers", "which", "time"], rows)
    rows_say_why = by_worker or len(results) <= EACH_UP_TO
    (unreachable or Unreachable()).rest(failures, every=not rows_say_why, also=subtrees)
    if done.exit_code is not ExitCode.PROGRAM_FAILED:
        return done.exit_code
    codes = sorted({r.exit_code for r in failed if r.exit_code is not None})
    where = listed([name(r) for r in sorted(failed, key=lambda r: r.worker)])
    if len(results) == 1:
        scope = where
    elif len(failed) == len(results):
        scope = f"every worker ({where})"
    else:
        scope = f"{len(failed):,} of {len(results):,} workers ({where})"
    said = f"exit code {codes[0]}" if len(codes) == 1 else "exit codes " + ", ".join(map(str, codes))
    ui.err().print(f"error: the command failed on {scope} with {said}", markup=False)
    if 127 in codes and len(command) == 1 and SHELL_WORDS.search(command[0]):
        ui.err().print(
            "hint: exec runs its command without a shell, so the whole string was taken as one program's name; "
            f"for pipes, redirections or variables: tpurun exec -- bash -c {shlex.quote(command[0])}",
            markup=False,
        )
    return done.exit_code


def _status(r: RunResult, reason: bool = True) -> str:
    """How R ended, in a word or two (and why it could not run, with REASON)."""
    if r.exit_code is None:
        return f"unreachable: {r.error}" if reason else "unreachable"
    if r.stopped and r.exit_code != 0:
        return f"stopped (exit {r.exit_code})"
    return f"exit {r.exit_code}"


# what only a shell understands: a one-argument command holding any of it was meant for one
SHELL_WORDS = re.compile(r"[\s|&;<>$`*?]")


@contextlib.contextmanager
def progress_display() -> Iterator[Callable[[str], None]]:
    """A spinner with the latest state on a terminal; one stderr line per change otherwise."""
    from tpurun.cloud import provision  # not at import: exec and train never load the Cloud TPU client

    if ui.is_plain() or not sys.stderr.isatty():
        yield provision.StatusLines(lambda text: ui.info(text))
        return
    with ui.err().status("starting…") as status:
        yield provision.StatusLines(lambda text: status.update(text))


# What a runtime prints once per process and tells a user nothing: hidden on the terminal unless asked
# (--debug); the job's log files keep every line.
CHATTER = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+"
)


class Renderer:
    """Lines to stdout as `[wN/cM] line`, coloured on a terminal; whole lines only; CHATTER only if asked."""

    COLOURS = [36, 35, 32, 33, 34, 31]

    def __init__(self, colour: bool, quiet: bool = False, chatter: bool = False, live: bool = False) -> None:
        self.colour = colour
        self.quiet = quiet
        self.chatter = chatter
        self.live = live  # a status line stays under the lines, redrawn (stderr is a terminal)
        self.status = ""
        self._names: Mapping[int, str] = {}  # worker index -> name, when not wN (a multislice TPU: sS/wN)
        self.tags: dict[tuple[int, int], str] = {}  # (worker, slot) -> its lines' [tag], made once
        self.lock = threading.Lock()
        self.buffer: list[str] = []
        self.last_flush = time.monotonic()

    def lines(self, worker: int, lines: list[tuple[int, str]]) -> None:
        """WORKER's LINES, (slot, text) each, in their order."""
        if self.quiet:
            return
        tags = self.tags
        texts = []
        for slot, text in lines:
            if not self.chatter and text.startswith("[Gloo]") and CHATTER.fullmatch(text):
                continue
            tag = tags.get((worker, slot))
            if tag is None:
                tag = tags[worker, slot] = self._tag(worker, slot)
            texts.append(f"{tag} {text}\n")
        with self.lock:
            self.buffer += texts
            if len(self.buffer) > 512 or time.monotonic() - self.last_flush > 0.05:
                self._flush()

    def _tag(self, worker: int, slot: int) -> str:
        tag = f"[{process_name(worker, slot, self.names.get(worker))}]"
        if self.colour:
            tag = f"\x1b[{self.COLOURS[worker % len(self.COLOURS)]}m{tag}\x1b[0m"
        return tag

    @property
    def names(self) -> Mapping[int, str]:
        return self._names

    @names.setter
    def names(self, names: Mapping[int, str]) -> None:
        self._names, self.tags = names, {}

    def _flush(self) -> None:
        if self.buffer:
            with ui.TERMINAL:  # not while a worker's question waits for its answer
                self._write_buffer()
        self.last_flush = time.monotonic()

    def _write_buffer(self) -> None:
        self._erase()
        try:
            sys.stdout.write("".join(self.buffer))
            sys.stdout.flush()
        except BrokenPipeError:
            pass
        self.buffer.clear()
        self._draw()

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def set_status(self, text: str) -> None:
        """The live line under the lines ("" removes it)."""
        with self.lock:
            self._flush()
            self._erase()
            self.status = text
            self._draw()

    def above(self, write: Callable[[], None]) -> None:
        """WRITE (a status line of tpurun's) between the lines and the live line."""
        with self.lock:
            self._flush()
            self._erase()
            write()
            self._draw()

    def _erase(self) -> None:
        if self.live and self.status:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()

    def _draw(self) -> None:
        if self.live and self.status:
            from rich.cells import cell_len, set_cell_size

            width = shutil.get_terminal_size().columns - 1  # one row: never wrapped, so one erase removes it
            text = self.status if cell_len(self.status) <= width else set_cell_size(self.status, width - 1) + "…"
            sys.stderr.write(text)
            sys.stderr.flush()


def skew_table(skew: Skew) -> None:
    """Who differs from whom (train's refusal, doctor): each thing that differs, each version and its workers,
    the most common first."""
    rows: list[list[str]] = []
    last = None
    for what, version, names in skew.rows:
        shown = ", ".join(names) if len(names) <= EACH_UP_TO else f"{len(names):,} workers: {which(names)}"
        rows.append(["" if what == last else what, version, shown])
        last = what
    ui.table("the workers differ", ["what", "version", "workers"], rows)


SHOWN_FRAMES = 12  # frames of a group's stack printed (innermost first); the dump on disk has them all


def stacks_report(stacks: Stacks) -> None:
    """A job's stacks on stdout: the one-line summary, then each group (odd ones out first) with its members
    and its main thread's frames, innermost first; then the processes without stacks and the dump's file."""
    print(stacks.summary())
    for g in stacks.groups:
        names = [p.name for p in g.members]
        shown = listed(names)
        print(f"\n{len(names)} process{'es' if len(names) > 1 else ''} {g.where(stacks.cwd)}: {shown}")
        for f in g.frames[:SHOWN_FRAMES]:
            place = f"{f.file}:{f.line}" if f.python else f.file
            print(f"    {place} in {f.function}" + (f": {f.source}" if f.source else ""))
        if len(g.frames) > SHOWN_FRAMES:
            print(f"    ... {len(g.frames) - SHOWN_FRAMES} more frames in the dump")
    if stacks.unread:
        print()
        unread = [
            (p.name, f"no stacks from {p.name} (pid {p.stack.pid}, {p.stack.argv[:60]}): {p.stack.why}")
            for p in stacks.unread
        ]
        for line in each_or_by_reason(unread):  # a few a line each; more, each reason once
            print(line)
    sys.stdout.flush()
