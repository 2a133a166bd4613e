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
from tpurun.transport.fleet import RunResult
from tpurun.transport.runner import RUN_GRACE, LineSink


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
    why a worker cannot be reached goes to UNREACHABLE before the others run."""
    with target:
        errors = target.fleet.connect()
        for _, error in sorted(errors.items()):
            if unreachable is not None:
                unreachable(error)
        # what each VM's metadata does not tell the runtimes (or one worker of a pod, as the single-host slice it is)
        results = target.fleet.run(command, sink, stop=stop, fail_fast=fail_fast, grace=grace, env=target.vm_env)
    results += [RunResult(i, None, error=e) for i, e in errors.items()]
    results.sort(key=lambda r: r.worker)
    return ExecResult(results)


def ssh_argv(
    target: Target, home: Path, command: list[str] | None, *, worker: str, forward: list[str], flags: list[str]
) -> list[str]:
    """The system ssh's argv to TARGET's one selected worker (once it has proved it is that worker of that
    TPU, which the --worker spec WORKER selects): a shell, or COMMAND quoted to arrive exactly; FORWARD as -L specs, FLAGS as more ssh options."""
    with target:
        if len(target.runners) != 1:
            raise UsageError(f"--worker {worker}: name one worker")
        errors = target.fleet.connect()  # a gone TPU is reported, and the worker proves who it is, before ssh runs
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
    if any("\0" in arg for arg in command):
        raise UsageError("arguments cannot contain NUL bytes")
    # ssh joins its arguments into one line for the remote shell: quote so they arrive exactly
    return [*argv, f"{w.user}@{w.address}", "--", shlex.join(command)]
