"""How tpurun shows things: rich on a terminal, plain lines when piped or with --plain, JSON on request.

The library returns data; commands hand it to these helpers, so --json and --plain come for free. The one
exception is `ask`: a worker that asks a person for a second factor at login (OS Login's 2-step verification) is
answered by the person at the terminal, while the command connects.
"""

from __future__ import annotations

import getpass
import json
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

# rich is imported where it is used, not here: commands whose output is piped (exec's lines and
# summary, --json) never need it, and it is 30 ms of every start-up


@dataclass
class UiState:
    plain: bool = False
    debug: bool = False


state = UiState()

# Held by a prompt while it waits for its answer, and by the writers of a command's lines (cli/output.py), so a
# question is never cut by other output, and questions from many workers come one at a time.
TERMINAL = threading.RLock()


def can_ask() -> bool:
    """Whether there is a person to ask: stdin and stderr are terminals."""
    return sys.stdin.isatty() and sys.stderr.isatty()


def ask(tag: str, prompts: Sequence[tuple[str, bool]]) -> list[str]:
    """The answers of the person at the terminal to PROMPTS (each its text, and whether the answer is echoed), every
    line of a prompt shown after [TAG] (the worker asking), one asker at a time; "" where stdin ended."""
    answers = []
    with TERMINAL:
        for text, echo in prompts:
            lines = text.rstrip("\n").split("\n")
            shown = "".join(f"[{tag}] {line}\n" for line in lines[:-1]) + f"[{tag}] {lines[-1]}"
            if not echo:
                answers.append(getpass.getpass(shown, stream=sys.stderr))
                continue
            sys.stderr.write(shown)
            sys.stderr.flush()
            answers.append(sys.stdin.readline().rstrip("\n"))
    return answers


def is_plain() -> bool:
    return state.plain or not sys.stdout.isatty() or os.environ.get("TERM") == "dumb"


def out() -> Console:
    from rich.console import Console

    # a new Console each time: tests swap sys.stdout, and piped output must never wrap or colour
    if is_plain():
        return Console(file=sys.stdout, color_system=None, highlight=False, soft_wrap=True, width=10_000)
    return Console(file=sys.stdout, highlight=False)


def err() -> Console:
    from rich.console import Console

    return Console(file=sys.stderr, color_system=None if _plain_err() else "auto", highlight=False, soft_wrap=True)


def _plain_err() -> bool:
    return state.plain or not sys.stderr.isatty()


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def info(message: str) -> None:
    """A status line for people; on stderr so stdout stays clean for data."""
    if not _plain_line(message):
        err().print(message, markup=False)


# What rich takes out of a line it prints: bell, backspace, vertical tab, form feed, carriage return.
_CONTROLS = str.maketrans("", "", "\a\b\v\f\r")


def _plain_line(message: str) -> bool:
    """MESSAGE written to stderr as a line where it is plain (not a terminal, or --plain), as rich would write it
    there, without importing rich (a third of a second on a small machine, on the way to a job's start); False
    where stderr is a terminal that rich styles."""
    if not _plain_err():
        return False
    sys.stderr.write(message.translate(_CONTROLS) + "\n")
    sys.stderr.flush()
    return True


def age(seconds: float) -> str:
    """12s, 3m05s, 4h10m, 2d03h."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def usd(value: float | None) -> str:
    """$1,234.56; a sum under a cent with its first digits ($0.0042), not $0.00; `-` for none."""
    if value is None:
        return "-"
    if 0 < abs(value) < 0.01:
        return f"${value:.2g}" if abs(value) >= 0.0001 else "<$0.0001"
    return f"${value:,.2f}"


def size(n: float) -> str:
    """812 B, 4.1 kB, 400.0 MB, 1.2 GB (powers of 1000)."""
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def warn(message: str) -> None:
    if not _plain_line(f"warning: {message}"):
        err().print(f"warning: {message}", markup=False, style="yellow")


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    rows = [[("" if c is None else str(c)) for c in row] for row in rows]
    if is_plain():
        # aligned plain text: easy to read and to grep
        widths = [len(c) for c in columns]
        for row in rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        if title:
            print(title)
        print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        sys.stdout.flush()
        return
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for row in rows:
        t.add_row(*row)
    out().print(t)
