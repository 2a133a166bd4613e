"""Work on every worker at once: one thread per worker, joined in short waits so Ctrl-C stays live."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tpurun.errors import UnreachableError
from tpurun.transport._paramiko import paramiko
from tpurun.transport.runner import RUN_GRACE, LineSink, Runner, Worker
from tpurun.transport.ssh import SshRunner


@dataclass
class RunResult:
    worker: int
    exit_code: int | None  # None: never ran (unreachable)
    error: str = ""  # why it could not run
    stopped: bool = False  # stopped by tpurun (fail-fast, Ctrl-C)
    duration: float = 0.0


R = TypeVar("R", bound="Runner")
T = TypeVar("T")


def each(
    runners: Sequence[R], fn: Callable[[R], T], *, name: str = "run", tick: Callable[[], None] | None = None
) -> dict[int, T]:
    """FN(runner) on every runner at once, one thread each: {worker index: what FN returned}. This thread
    waits in short joins, so signal handlers (Ctrl-C) run meanwhile, and calls TICK between them. An
    exception FN raised is raised here once every thread has ended."""
    results: dict[int, T] = {}
    raised: list[BaseException] = []

    def run(r: R) -> None:
        try:
            results[r.worker.index] = fn(r)
        except BaseException as exc:
            raised.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True, name=f"{name}-w{r.worker.index}") for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.1)
            if tick is not None:
                tick()
    if raised:
        raise raised[0]
    return results


def connect_all(runners: Sequence[Runner], then: Callable[[SshRunner], None] | None = None) -> dict[int, str]:
    """Connect every SSH runner at once; {worker index: error} for those that failed. THEN runs on each
    runner's thread as soon as it is connected (e.g. to start a remote program while others connect)."""

    def one(r: SshRunner) -> str:
        try:
            r.connect()
        except UnreachableError as exc:
            return str(exc)
        if then is not None:
            then(r)
        return ""

    ssh = [r for r in runners if isinstance(r, SshRunner)]
    return {index: error for index, error in each(ssh, one, name="connect").items() if error}


def fan_out(
    runners: Sequence[Runner],
    argv: Sequence[str],
    sink: LineSink,
    *,
    stop: threading.Event,
    fail_fast: bool = False,
    grace: float = RUN_GRACE,
    on_exit: Callable[[RunResult], None] | None = None,
    env: Callable[[Worker], Mapping[str, str]] | None = None,
) -> list[RunResult]:
    """Run ARGV (with the variables ENV gives each worker added) on every runner at once; with FAIL_FAST the
    first non-zero exit stops the others."""

    def one(r: Runner) -> RunResult:
        started = time.monotonic()
        try:
            rc: int | None = r.run(argv, sink, stop, grace, env(r.worker) if env else None)
            res = RunResult(r.worker.index, rc, stopped=stop.is_set(), duration=time.monotonic() - started)
        except UnreachableError as exc:
            res = RunResult(r.worker.index, None, error=str(exc), duration=time.monotonic() - started)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            res = RunResult(
                r.worker.index, None, error=f"worker {r.worker.label()}: {exc}", duration=time.monotonic() - started
            )
        if fail_fast and (res.exit_code not in (0, None) or res.error) and not stop.is_set():
            stop.set()
        if on_exit:
            on_exit(res)
        return res

    results = each(runners, one)
    return [results[r.worker.index] for r in runners]
