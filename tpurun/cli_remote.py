"""Commands of the data plane: exec and ssh (sync lives in cli_sync)."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Annotated

import typer

from tpurun import keys, settings, targets, ui
from tpurun.cli import app
from tpurun.errors import ExitCode, TpurunError, UsageError
from tpurun.remote import DEFAULT_GRACE, RunResult, fan_out

TpuOpt = Annotated[str | None, typer.Option("--tpu", help="TPU name (else TPURUN_TPU / tpurun.toml).")]
LocalOpt = Annotated[bool, typer.Option("--local", help="Act on this machine as a one-host pod.")]
WorkerOpt = Annotated[str, typer.Option("--worker", "-w", help="all, N, N,M or N-M.")]

_COLOURS = ["cyan", "magenta", "green", "yellow", "blue", "red"]
_ANSI = {"cyan": 36, "magenta": 35, "green": 32, "yellow": 33, "blue": 34, "red": 31}


class LineWriter:
    """Whole prefixed lines to stdout/stderr, one writer at a time: lines are never split or merged."""

    def __init__(self, colour: bool) -> None:
        self.colour = colour
        self.lock = threading.Lock()

    def prefix(self, tag: str, index: int) -> str:
        if not self.colour:
            return f"[{tag}] "
        code = _ANSI[_COLOURS[index % len(_COLOURS)]]
        return f"\x1b[{code}m[{tag}]\x1b[0m "

    def __call__(self, worker: int, stream: str, line: str) -> None:
        self.write(f"w{worker}", worker, stream, line)

    def write(self, tag: str, index: int, stream: str, line: str) -> None:
        target = sys.stdout if stream == "out" else sys.stderr
        text = self.prefix(tag, index) + line + "\n"
        with self.lock:
            try:
                target.write(text)
                target.flush()
            except BrokenPipeError:
                pass


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[dict[str, bool]]:
    """SIGINT and SIGTERM set STOP (remote groups are then stopped) instead of killing tpurun outright."""
    seen = {"interrupted": False}

    def handler(signum: int, frame: object) -> None:
        if seen["interrupted"]:
            ui.info("still stopping remote processes… (they are killed after the grace period)")
        seen["interrupted"] = True
        stop.set()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield seen
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def summarize(results: list[RunResult], interrupted: bool) -> int:
    """Print the per-worker summary on stderr and return the exit code (README: 0, 1, 4, 130)."""
    unreachable = [r for r in results if r.exit_code is None]
    failed = [r for r in results if r.exit_code not in (0, None)]
    if len(results) > 1 or failed or unreachable:
        rows = []
        for r in results:
            if r.exit_code is None:
                status = f"unreachable: {r.error}"
            elif r.stopped and r.exit_code != 0:
                status = f"stopped (exit {r.exit_code})"
            else:
                status = f"exit {r.exit_code}"
            rows.append((f"w{r.worker}", status, f"{r.duration:.1f} s"))
        with contextlib.redirect_stdout(sys.stderr):
            ui.table(None, ["worker", "result", "time"], rows)
    if interrupted:
        return ExitCode.INTERRUPTED
    if unreachable:
        return ExitCode.UNREACHABLE
    if failed:
        first = min(failed, key=lambda r: r.duration)
        ui.err().print(f"error: the command failed on w{first.worker} with exit code {first.exit_code}", markup=False)
        return ExitCode.PROGRAM_FAILED
    return ExitCode.OK


@app.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
)
def exec_cmd(
    command: Annotated[list[str], typer.Argument(help="-- CMD [ARGS...]: passed exactly, never through a shell.")],
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    worker: WorkerOpt = "all",
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop every worker at the first failure.")] = False,
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL when stopping.")] = DEFAULT_GRACE,
) -> None:
    """Run a command on every selected worker at once, lines prefixed \\[wN]."""
    if not command:
        raise UsageError("give a command after --, e.g. `tpurun exec -- hostname`")
    target = targets.resolve(tpu=tpu, local=local, worker_spec=worker)
    writer = LineWriter(colour=not ui.is_plain())
    stop = threading.Event()
    try:
        with stop_on_signals(stop) as seen:
            errors = target.connect()
            for _, error in sorted(errors.items()):
                ui.err().print(f"error: {error}", markup=False)
            reachable = [r for r in target.runners if r.worker.index not in errors]
            results = fan_out(reachable, command, writer, stop=stop, fail_fast=fail_fast, grace=grace)
            results += [RunResult(i, None, error=e) for i, e in errors.items()]
            results.sort(key=lambda r: r.worker)
            code = summarize(results, seen["interrupted"])
    finally:
        target.close()
    raise typer.Exit(code)


@app.command("ssh", context_settings={"allow_interspersed_args": False})
def ssh_cmd(
    command: Annotated[list[str] | None, typer.Argument(help="-- CMD [ARGS...] to run instead of a shell.")] = None,
    tpu: TpuOpt = None,
    worker: Annotated[int, typer.Option("--worker", "-w", help="Worker index.")] = 0,
) -> None:
    """An interactive shell (or one command) on one worker, through the system ssh with pinned host keys."""
    s = settings.resolve({"tpu": tpu})
    if not s.tpu.value:
        raise UsageError("no TPU named: pass --tpu NAME (or `tpurun attach NAME` to set a default)")
    target = targets.resolve(tpu=s.tpu.value, local=False, worker_spec=str(worker), announce=False)
    w = target.runners[0].worker
    home = s.home_path
    argv = [
        "ssh",
        "-i", str(keys.key_path(home)),
        "-o", "IdentitiesOnly=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={keys.known_hosts_path(home)}",
        "-o", "LogLevel=ERROR",
        "-p", str(w.port),
    ]  # fmt: skip
    if command:
        for arg in command:
            if "\0" in arg:
                raise UsageError("arguments cannot contain NUL bytes")
        # ssh joins its arguments into one line for the remote shell: quote so they arrive exactly
        argv += [f"{w.user}@{w.address}", "--", shlex.join(command)]
    else:
        argv += ["-t", f"{w.user}@{w.address}"]
    sys.stdout.flush()
    try:
        os.execvp("ssh", argv)
    except OSError as exc:
        raise TpurunError(f"cannot run the system ssh client: {exc.strerror}", hint="install openssh-client") from None
