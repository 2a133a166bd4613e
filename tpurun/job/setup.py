"""`train --setup`: put what a script needs on every worker before it starts, once per content.

A setup is shell commands run in the job's directory on every worker (`pip install -r requirements.txt`,
`apt-get install -y ...`), with the job's Python first on PATH. A `requirements.txt` beside the script
adds `PYTHON -m pip install -r requirements.txt` on TPU workers (never on this machine: its environment
is the user's own).

Its key is a hash of the commands, the Python, the directory and the content of every file of the
synced directory the commands name. A worker that finished the same key before keeps a marker in
~/.tpurun/setup/KEY and skips it; a change to the commands or to a named file (a new requirement)
runs it again. Output is tagged [wN]; a failure stops every worker's setup and names the worker.
"""

from __future__ import annotations

import hashlib
import shlex
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tpurun.fleet.interface import Fleet, RunResult
from tpurun.transport.runner import LineSink, Worker

REQUIREMENTS = "requirements.txt"
MARKERS = ".tpurun/setup"

# $1 key, $2 directory (~/ for the home), $3 python, $4 the commands as one script
_SCRIPT = r"""
key=$1; dir=$2; py=$3
case $dir in "~") dir=$HOME ;; "~/"*) dir=$HOME/${dir#\~/} ;; esac
case $py in */*) PATH=$(dirname "$py"):$PATH; export PATH ;; esac
TPURUN_PYTHON=$py; PIP_DISABLE_PIP_VERSION_CHECK=1; export TPURUN_PYTHON PIP_DISABLE_PIP_VERSION_CHECK
TPURUN_ACTIVITY=setup; export TPURUN_ACTIVITY  # the TPU's watchdog counts this as work (not idle)
cd "$dir" || exit 1
bash -e -c "$4" || exit $?
mkdir -p "$HOME/@MARKERS@" && touch "$HOME/@MARKERS@/$key"
""".replace("@MARKERS@", MARKERS)

_DONE = 'test -e "$HOME/@MARKERS@/$1" && echo done || echo todo'.replace("@MARKERS@", MARKERS)


@dataclass(frozen=True)
class Setup:
    commands: tuple[str, ...]
    key: str
    named_files: tuple[str, ...]  # files of the synced directory that are part of the key

    def describe(self) -> str:
        return "; ".join(self.commands)


def plan_setup(
    commands: list[str], *, script: str, python: str, cwd: str, local_dir: Path, on_tpu: bool
) -> Setup | None:
    """The setup of a job, or None when there is nothing to do."""
    cmds = list(commands)
    req = Path(script).parent / REQUIREMENTS
    if on_tpu and (local_dir / req).is_file():
        cmds.append(shlex.join([python, "-m", "pip", "install", "-r", str(req)]))
    if not cmds:
        return None
    named = sorted({f for c in cmds for f in _named_files(c, local_dir)})
    h = hashlib.sha256()
    for part in (python, cwd, *cmds):
        h.update(part.encode() + b"\0")
    for f in named:
        h.update(f.encode() + b"\0" + hashlib.sha256((local_dir / f).read_bytes()).digest())
    return Setup(tuple(cmds), h.hexdigest()[:16], tuple(named))


def _named_files(command: str, local_dir: Path) -> list[str]:
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    found = []
    for word in words:
        for candidate in (word, word.partition("=")[2]):
            if candidate and not candidate.startswith("/") and ".." not in Path(candidate).parts:
                if (local_dir / candidate).is_file():
                    found.append(str(Path(candidate)))
    return found


@dataclass
class SetupResult:
    ran: list[int]  # workers that ran it
    skipped: list[int]  # workers that had done it before
    results: list[RunResult]
    last_lines: dict[int, list[str]]

    @property
    def failed(self) -> RunResult | None:
        bad = [r for r in self.results if r.error or (r.exit_code != 0 and not r.stopped)]
        return min(bad, key=lambda r: r.duration) if bad else None


def run_everywhere(
    fleet: Fleet,
    setup: Setup,
    *,
    cwd: str,
    python: str,
    sink: LineSink,
    stop: threading.Event,
    grace: float,
    on_start: Callable[[list[int], list[int]], None] | None = None,
    env: Callable[[Worker], Mapping[str, str]] | None = None,
) -> SetupResult:
    """Run SETUP (with the variables ENV gives each worker) on every worker of FLEET that has not finished its key
    before; fail-fast across workers."""
    state: dict[int, str] = {}
    fleet.run(["sh", "-c", _DONE, "tpurun", setup.key], lambda w, _s, line: state.update({w: line}), stop=stop)
    todo = [w.index for w in fleet.workers if state.get(w.index) != "done"]
    skipped = [w.index for w in fleet.workers if state.get(w.index) == "done"]
    if on_start:
        on_start(todo, skipped)
    tails: dict[int, deque[str]] = {w: deque(maxlen=10) for w in todo}

    def keep(worker: int, stream: str, line: str) -> None:
        tails[worker].append(line)
        sink(worker, stream, line)

    argv = ["sh", "-c", _SCRIPT, "tpurun", setup.key, cwd, python, "\n".join(setup.commands)]
    results = fleet.run(argv, keep, stop=stop, fail_fast=True, grace=grace, env=env, only=todo) if todo else []
    return SetupResult(todo, skipped, results, {w: list(t) for w, t in tails.items()})
