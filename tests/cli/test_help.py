"""Help text that reads as sentences: a command's summary wraps where the terminal ends, never where its
docstring's source line did."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

WIDTH = 100


def _help(*args: str) -> list[str]:
    env = dict(os.environ, COLUMNS=str(WIDTH), TERM="dumb")
    r = subprocess.run(
        [sys.executable, "-m", "tpurun", *args, "--help"], capture_output=True, text=True, env=env, timeout=60, cwd="/"
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _cut_rows(lines: list[str]) -> list[str]:
    """Rows of a command table whose text stops well short of the panel's edge and yet goes on below: a cut
    made by the source's line break, not by the terminal."""
    rows = [re.match(r"^│ (\S*)\s+(.*?)\s*│$", line) for line in lines]
    cut = []
    for here, below in zip(rows, rows[1:], strict=False):
        if here and below and not below.group(1) and below.group(2) and len(here.group(0).rstrip("│ ")) < WIDTH - 20:
            cut.append(here.group(0))
    return cut


@pytest.mark.parametrize("group", [(), ("emulator",)])
def test_command_summaries_wrap_at_the_terminal_not_mid_sentence(group):
    lines = _help(*group)
    assert any(line.startswith("│ ") for line in lines), lines
    assert _cut_rows(lines) == []


def test_a_commands_own_help_is_whole_paragraphs():
    text = "\n".join(_help("autostop"))
    assert "Idle: no tpurun job on any worker and no process holding a TPU device." in " ".join(text.split())
    # the paragraph fills the width before it wraps
    first = next(line for line in text.splitlines() if line.strip().startswith("Delete (or stop)"))
    assert len(first.rstrip()) > WIDTH - 20, first
