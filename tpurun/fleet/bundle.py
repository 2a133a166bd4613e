"""tpurun's worker programs on a worker: where the bundle (tpurun.worker) is installed, installing it, and
the argv that runs one of its programs. Each tpurun version's bundle lives in ~/.tpurun/bin/<bundle_name()>/,
beside older ones, so an upgrade never replaces files a running job uses."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

from tpurun.errors import UnreachableError
from tpurun.fleet.interface import Call
from tpurun.transport.runner import Runner, run_capture
from tpurun.worker import BUNDLES, bundle_name, bundle_tar
from tpurun.worker.protocol import FIRST_INPUT, AgentExit
from tpurun.worker.watchdog_reports import NO_ROOT

if TYPE_CHECKING:
    from tpurun.fleet.targets import Target

NO_ROOT_THERE = "it needs root, and `sudo -n` was refused to the user tpurun logs in as"  # start_watchdogs' why
BIN = f"$HOME/{BUNDLES}"  # where bundles live on a worker, as a shell word (followed by /<bundle_name()>)

# The bundle (a tar on stdin) unpacked beside, then renamed into place: a worker never sees half of it,
# and of two concurrent installs the second finds the first's and drops its own.
_INSTALL = (
    f'd="{BIN}/$1"; t="$d.tmp.$$"; mkdir -p "$t" && tar -xf - -C "$t" || {{ rm -rf "$t"; exit 1; }}; '
    '[ -d "$d" ] || mv -T "$t" "$d" 2>/dev/null; rm -rf "$t"; [ -f "$d/agent.py" ]'
)
# The one way a bundle program runs on a worker: PYTHON runs FILE of this version's bundle (exit MISSING where it
# is not installed). A first command's input (`--first COMMAND DATA ...`) goes to the program in its environment,
# which only its own user can read, not on its command line, which everyone on the worker can, for as long as
# the program runs (a job's stream: days; the spec holds the job's variables). With `site`, as the job's Python
# starts: without it (-S) a TorchTPU job of a Debian venv hung in the suite, its cause not found.
RUN = (
    f'p=$1; f="{BIN}/$2/$3"; shift 3; [ -f "$f" ] || exit {AgentExit.MISSING.value}; '
    f'if [ "$1" = --first ]; then {FIRST_INPUT}=$3; export {FIRST_INPUT}; c=$2; shift 3; '
    'set -- --first "$c" "$@"; fi; exec "$p" "$f" "$@"'
)


def install(runner: Runner) -> None:
    rc, _, err = run_capture(runner, ["sh", "-c", _INSTALL, "tpurun", bundle_name()], stdin=bundle_tar())
    if rc != 0:
        raise UnreachableError(f"cannot install tpurun's agent on worker {runner.worker.label()}: {err.strip()}")


def program_argv(python: str, program: str, *args: str, first: tuple[str, bytes] | None = None) -> list[str]:
    """Run PROGRAM (a file of the bundle, e.g. agent.py) with PYTHON; exits AgentExit.MISSING without the bundle.
    FIRST (agent.py only): a command and its input, run first in the same process, ARGS only if it succeeded
    (a job's start, then its stream: one Python on the worker, not two); none: only FIRST runs."""
    if first:
        args = ("--first", first[0], base64.b64encode(first[1]).decode(), *args)
    return ["sh", "-c", RUN, "tpurun", python, bundle_name(), program, *args]


def call_argv(call: Call) -> list[str]:
    """The argv that runs CALL on a worker."""
    if not call.program:
        return list(call.args)
    return program_argv(call.python, call.program, *call.args, first=call.first)


def start_watchdogs(target: Target) -> dict[int, str]:
    """Make sure the TPU's watchdog runs on every worker of TARGET (each one checked to be that TPU's, the
    bundle installed where it is missing); {worker index: why not} for the workers where it could not be
    started (NO_ROOT_THERE where the user tpurun logs in as has no passwordless sudo)."""
    fleet = target.fleet
    failed = fleet.connect()
    for w, a in fleet.call(Call.program_of(target.python(), "watchdog.py", "ensure")).items():
        if a.rc is None:
            failed[w] = a.error
        elif a.rc == NO_ROOT:
            failed[w] = NO_ROOT_THERE
        elif a.rc != 0:
            failed[w] = f"watchdog.py ensure exited {a.rc}: {a.err.strip()[-200:]}"
    return failed
