"""tpurun's worker programs on a worker: where the bundle (tpurun.worker) is installed, installing it, and
the argv that runs one of its programs. Each tpurun version's bundle lives in ~/.tpurun/bin/<bundle_name()>/,
beside older ones, so an upgrade never replaces files a running job uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpurun.errors import UnreachableError
from tpurun.transport.fanout import each
from tpurun.transport.runner import Runner, run_capture
from tpurun.worker import bundle_name, bundle_tar
from tpurun.worker.protocol import AgentExit

if TYPE_CHECKING:
    from tpurun.targets import Target

BIN = "$HOME/.tpurun/bin"  # where bundles live on a worker, as a shell word (followed by /<bundle_name()>)

# The bundle (a tar on stdin) unpacked beside, then renamed into place: a worker never sees half of it,
# and of two concurrent installs the second finds the first's and drops its own.
_INSTALL = (
    f'd="{BIN}/$1"; t="$d.tmp.$$"; mkdir -p "$t" && tar -xf - -C "$t" || {{ rm -rf "$t"; exit 1; }}; '
    '[ -d "$d" ] || mv -T "$t" "$d" 2>/dev/null; rm -rf "$t"; [ -f "$d/agent.py" ]'
)
_RUN = f'p=$1; f="{BIN}/$2/$3"; shift 3; [ -f "$f" ] || exit {AgentExit.MISSING.value}; exec "$p" "$f" "$@"'


def install(runner: Runner) -> None:
    rc, _, err = run_capture(runner, ["sh", "-c", _INSTALL, "tpurun", bundle_name()], stdin=bundle_tar())
    if rc != 0:
        raise UnreachableError(f"cannot install tpurun's agent on worker {runner.worker.label()}: {err.strip()}")


def program_argv(python: str, program: str, *args: str) -> list[str]:
    """Run PROGRAM (a file of the bundle, e.g. agent.py) with PYTHON; exits AgentExit.MISSING without the bundle."""
    return ["sh", "-c", _RUN, "tpurun", python, bundle_name(), program, *args]


def run_program(runner: Runner, python: str, program: str, *args: str, timeout: float = 60) -> tuple[int, bytes, str]:
    """PROGRAM of the bundle with ARGS run to completion on RUNNER's worker, the bundle installed first where it
    is missing (a worker new to tpurun, or to this version of it); (exit code, stdout, stderr)."""
    argv = program_argv(python, program, *args)
    rc, out, err = run_capture(runner, argv, timeout=timeout)
    if rc == AgentExit.MISSING:
        install(runner)
        rc, out, err = run_capture(runner, argv, timeout=timeout)
    return rc, out, err


def start_watchdogs(target: Target) -> dict[int, str]:
    """Make sure the TPU's watchdog runs on every worker of TARGET (each one checked to be that TPU's, the
    bundle installed where it is missing); {worker index: why not} for the workers where it could not be
    started."""
    python = target.python()

    def one(runner: Runner) -> str:
        try:
            rc, _, err = run_program(runner, python, "watchdog.py", "ensure")
        except UnreachableError as exc:
            return str(exc)
        return "" if rc == 0 else f"watchdog.py ensure exited {rc}: {err.strip()[-200:]}"

    failed = target.connect()
    reached = [r for r in target.runners if r.worker.index not in failed]
    failed.update({w: why for w, why in each(reached, one, name="watchdog").items() if why})
    return failed
