"""The documentation runs as written: the README's tour against a real `tpurun emulator start`, and every
terminal transcript of docs/ (a ```text or ```console block whose first line starts with `$ `).

Both run from a fresh directory holding a copy of examples/ and the venv of README command 1 (.venv),
with their own HOME and nothing of the test session's environment (PATH is the system's; the tour
activates the venv itself).

A transcript's lines after a `$ COMMAND` line are what the command prints (stdout and stderr as a
terminal shows them), in order and whole, with these allowances: a `...` line stands for any lines;
runs of spaces match any run of spaces; a decimal number with a fraction (a time, an accuracy) matches
any such number; `~` stands for the HOME the command ran with.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tpurun.emulator.pytest_plugin import standalone_slots_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _workspace(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    work, home = tmp_path / "repo", tmp_path / "home"
    home.mkdir()
    work.mkdir()
    shutil.copytree(ROOT / "examples", work / "examples")
    (work / ".venv").symlink_to(Path(sys.prefix))  # the venv of README command 1 (scripts/test runs in it)
    env = {"HOME": str(home), "PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "TERM": "dumb", "USER": "root"}
    env |= standalone_slots_env()  # its emulator's addresses are none of the session emulators'
    return work, env


def readme_tour() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## A short tour\n.*?^```bash\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no tour block"
    return m.group(1)


def test_readme_tour_runs_as_written(tmp_path):
    work, env = _workspace(tmp_path)
    (tmp_path / "tour.sh").write_text("set -euo pipefail\n" + readme_tour())
    try:
        r = subprocess.run(
            ["bash", str(tmp_path / "tour.sh")],
            cwd=work, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    finally:
        # whatever happened, nothing of the tour's emulator may outlive the test
        subprocess.run(
            [str(work / ".venv" / "bin" / "tpurun"), "emulator", "stop"],
            cwd=work, env=env, capture_output=True, timeout=120,
        )  # fmt: skip
    out, err = r.stdout, r.stderr
    assert r.returncode == 0, f"the tour failed (exit {r.returncode}):\n{err[-4000:]}\n{out[-2000:]}"
    assert "Traceback" not in out + err
    assert "v4-32" in out and "/dev/accel0" in out  # topology
    hosts = dict(re.findall(r"^\[w(\d)\] (t1v-n-[0-9a-f]+-w-\d)$", out, re.M))
    assert sorted(hosts) == ["0", "1", "2", "3"] and all(hosts[w].endswith(f"-w-{w}") for w in hosts)
    assert "the examples' packages are installed" not in out  # the startup script's log stays on the workers
    assert re.search(r"^\[w3\] ok: sent \d+/\d+ files", out, re.M), out  # sync
    accuracies = [float(a) for a in re.findall(r"^\[w0/c0\] final test accuracy: ([0-9.]+)$", out, re.M)]
    assert len(accuracies) == 2 and min(accuracies) >= 0.9, out[-3000:]  # attached run, then the detached one's logs
    assert {f"[w{w}/c{c}]" for w in range(4) for c in range(2)} <= set(re.findall(r"^\[w\d/c\d\]", out, re.M))
    # gloo joined every process of each run across the 4 workers: each saw the sum of every rank + 1
    checks = re.findall(r"^\[w(\d)/c(\d)\] \[rank (\d)/(\d)\] all-reduce check: (.*)$", out, re.M)
    assert sorted((w, c, world, seen) for w, c, _, world, seen in checks) == sorted(
        [(str(w), str(c), "8", "36.0 (expected 36.0)") for w in range(4) for c in range(2)]
        + [(str(w), "0", "4", "10.0 (expected 10.0)") for w in range(4)]
    ), checks
    assert re.search(r"^\d{8}-\d{6}-[0-9a-f]{4}\s+demo\s", out, re.M), out  # jobs lists the detached job
    assert "an emulated worker" in out  # doctor: no TPU here, said so
    assert "FAIL" not in out
    # cost: the deleted demo (a v4-32, 16 chips at the emulated catalogue's v4 price), with its two jobs
    assert re.search(r"^demo\s+us-central2-b\s+v4-32\s+on-demand\s.*\$51\.52\s", out, re.M), out[-3000:]
    assert len(re.findall(r"^\d{8}-\d{6}-[0-9a-f]{4}\s+0\s+demo\s", out, re.M)) == 2, out[-3000:]
    assert "emulator stopped; nothing of it is left running" in err


def transcripts() -> list[tuple[str, str, list[str]]]:
    """(page, command, expected lines) for every `$ COMMAND` of every transcript block in docs/."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"^```(?:text|console)\n(.*?)^```", page.read_text(), re.S | re.M):
            lines = block.splitlines()
            if not lines or not lines[0].startswith("$ "):
                continue
            for line in lines:
                if line.startswith("$ "):
                    found.append((page.name, line[2:], []))
                else:
                    found[-1][2].append(line)
    return found


def _line_pattern(line: str, home: str) -> str:
    out = []
    for piece in re.split(r"(\s+|\d+\.\d+|~)", line):
        if not piece:
            continue
        if piece.isspace():
            out.append(r"\s+")
        elif re.fullmatch(r"\d+\.\d+", piece):
            out.append(r"\d+\.\d+")
        elif piece == "~":
            out.append(re.escape(home))
        else:
            out.append(re.escape(piece))
    return "".join(out)


def matches(expected: list[str], actual: list[str], home: str) -> bool:
    """EXPECTED (with `...` gaps) against ACTUAL, whole lines, in order."""

    def go(i: int, j: int) -> bool:
        if i == len(expected):
            return j == len(actual)
        if expected[i] == "...":
            return any(go(i + 1, k) for k in range(j, len(actual) + 1))
        return (
            j < len(actual)
            and re.fullmatch(_line_pattern(expected[i], home), actual[j].rstrip()) is not None
            and go(i + 1, j + 1)
        )

    return go(0, 0)


def test_the_transcript_matcher_is_strict():
    assert matches(["a 1.5 s", "..."], ["a 22.75 s", "x", "y"], "/h")
    assert not matches(["a 1.5 s"], ["a 2 s"], "/h")  # a decimal matches decimals only
    assert not matches(["n 4"], ["n 5"], "/h")  # integers are exact
    assert not matches(["a", "b"], ["a", "b", "c"], "/h")  # no trailing lines without `...`
    assert matches(["home  ~/.x"], ["home     /h/.x"], "/h")


@pytest.mark.parametrize(("page", "command", "expected"), transcripts(), ids=lambda v: str(v)[:40])
def test_docs_transcript_runs_as_shown(tmp_path, page, command, expected):
    work, env = _workspace(tmp_path)
    env["PATH"] = f"{work / '.venv' / 'bin'}:{SYSTEM_PATH}"
    r = subprocess.run(
        ["bash", "-c", command], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600,
    )  # fmt: skip
    actual = r.stdout.splitlines()
    assert matches(expected, actual, env["HOME"]), (
        f"{page}: `{command}` printed:\n" + "\n".join(actual[-40:]) + "\n--- the page shows:\n" + "\n".join(expected)
    )


def test_every_docs_transcript_is_collected():
    assert {(p, c) for p, c, _ in transcripts()} >= {
        ("topology.md", "tpurun --plain topology v4-32"),
        ("topology.md", "tpurun topology v3-33"),
        ("train.md", "tpurun --plain train examples/digits_xla.py --cores 4"),
        ("train.md", "tpurun --plain train examples/digits_lightning.py --cores 2"),
        ("configuration.md", "TPURUN_PROJECT=my-proj TPURUN_ZONE=us-central2-b tpurun --plain config show"),
    }
    assert os.path.isdir(ROOT / "examples")
