"""A user's command on a TPU's workers: on every selected one at once (`exec`), or through the system ssh on
one (`ssh`: its argv, with tpurun's key and the host key pinned for that worker of that TPU)."""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tpurun.cloud import keys
from tpurun.errors import UnreachableError, UsageError
from tpurun.targets import Target
from tpurun.transport.fanout import RunResult, fan_out
from tpurun.transport.runner import RUN_GRACE, LineSink, Runner, refuse_nul


@dataclass
class ExecResult:
    results: list[RunResult]  # one per selected worker, in worker order; unreachable ones never ran


def exec_everywhere(
    target: Target,
    command: list[str],
    sink: LineSink,
    *,
    stop: threading.Event,
    fail_fast: bool,
    grace: float = RUN_GRACE,
    unreachable: Callable[[str], None] | None = None,
) -> ExecResult:
    """COMMAND (argv, never through a shell) on every selected worker of TARGET at once, its lines to SINK;
    why a worker cannot be reached goes to UNREACHABLE once every connection was tried.

    Each worker's command starts the moment that worker has proved who it is, not once every worker has:
    waiting for the slowest handshake cost every command about half a round trip (docs/benchmarks.md)."""
    results: dict[int, RunResult] = {}
    running: dict[int, threading.Thread] = {}
    raised: list[BaseException] = []

    def start(r: Runner) -> None:
        if r.worker.index in running:  # a worker's command runs once, whatever its connection
            return

        def run() -> None:
            try:  # what each VM's metadata does not tell the runtimes (or one worker of a pod, as its own slice)
                done = fan_out([r], command, sink, stop=stop, fail_fast=fail_fast, grace=grace, env=target.vm_env)
                results[r.worker.index] = done[0]
            except BaseException as exc:  # raised below, in the caller's thread
                raised.append(exc)

        running[r.worker.index] = thread = threading.Thread(target=run, daemon=True, name=f"exec-w{r.worker.index}")
        thread.start()

    with target:
        errors = target.connect(then=start)
        for _, error in sorted(errors.items()):
            if unreachable is not None:
                unreachable(error)
        for r in target.runners:  # what needs no connection (this machine)
            if r.worker.index not in errors:
                start(r)
        for thread in running.values():
            while thread.is_alive():
                thread.join(0.1)  # short waits: Ctrl-C stays live
    if raised:
        raise raised[0]
    done = [*results.values(), *(RunResult(i, None, error=e) for i, e in errors.items() if i not in results)]
    done.sort(key=lambda r: r.worker)
    return ExecResult(done)


def ssh_argv(
    target: Target, home: Path, command: list[str] | None, *, worker: str, forward: list[str], flags: list[str]
) -> list[str]:
    """The system ssh's argv to TARGET's one selected worker (once it has proved it is that worker of that
    TPU, which the --worker spec WORKER selects): a shell, or COMMAND quoted to arrive exactly; FORWARD as -L specs, FLAGS as more ssh options."""
    with target:
        if len(target.runners) != 1:
            raise UsageError(f"--worker {worker}: name one worker")
        errors = target.connect()  # a gone TPU is reported, and the worker proves who it is, before ssh runs
        if errors:
            raise UnreachableError(next(iter(errors.values())))
    w = target.runners[0].worker
    argv = [
        "ssh",
        "-i", str(keys.key_path(home)),
        "-o", "IdentitiesOnly=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={keys.known_hosts_path(home)}",
        "-o", f"HostKeyAlias={w.host_key}",  # the key pinned for this worker of this TPU, not for its address
        "-o", "LogLevel=ERROR",
        "-p", str(w.port),
    ]  # fmt: skip
    # after tpurun's own options: ssh keeps the first value it gets of each, so these cannot loosen them
    for spec in forward:
        argv += ["-L", spec]
    for flag in flags:
        argv += shlex.split(flag)
    if not command:
        return [*argv, "-t", f"{w.user}@{w.address}"]
    refuse_nul(command)
    # ssh joins its arguments into one line for the remote shell: quote so they arrive exactly
    return [*argv, f"{w.user}@{w.address}", "--", shlex.join(command)]
