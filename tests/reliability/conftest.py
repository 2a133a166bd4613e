"""Shared pieces of the reliability suite: the `cli` fixture of the integration tests, and helpers that
look at each emulated worker from the host (its process table, its per-core log files)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import create_node, finish, job_pids, lines_by_core, popen, read_until  # noqa: F401  (re-exported for the tests)
from tests.integration.conftest import Cli, cli, own_cli  # noqa: F401  (re-exported fixtures)

MUTATING = ("POST", "PATCH", "DELETE", "PUT")


def timing(what: str, seconds: float) -> None:
    """Measured numbers for docs/reliability.md (run with -s to see them)."""
    print(f"\n[reliability] {what}: {seconds:.2f} s", file=sys.stderr)


create = create_node


def worker_count(emulator, node: str) -> int:
    return len(emulator.node_info(emulator.node_name(node))["workers"])


def wait_no_pids(emulator, node: str, needle: str, timeout: float, workers: list[int] | None = None) -> float:
    """Seconds until no process matching NEEDLE is left on the workers (fails after TIMEOUT)."""
    t0 = time.monotonic()
    while job_pids(emulator, node, needle, workers):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"processes of {needle} still on {node} after {timeout} s")
        time.sleep(0.1)
    return time.monotonic() - t0


def worker_home(emulator, node: str, worker: int) -> Path:
    """The worker's /root as the host sees it (readable even when the worker or its sshd is dead)."""
    return emulator.emu.hosts._worker(emulator.node_name(node), worker).dir / "home"


def core_log(emulator, node: str, job: str, worker: int, core: int) -> list[str]:
    path = worker_home(emulator, node, worker) / ".tpurun" / "jobs" / job / f"w{worker}-c{core}.log"
    return path.read_text().splitlines() if path.exists() else []


def job_id(err: str) -> str:
    m = re.search(r"job (\d{8}-\d{6}-[0-9a-f]{4})", err)
    assert m, err
    return m.group(1)


def no_mutations(emulator, since: int) -> list[dict]:
    return [r for r in emulator.requests(since) if r["method"] in MUTATING]


# A script whose every line is numbered: "n <i> w<W> c<C>", one every PERIOD seconds, N lines.
TICKER = """\
import os, sys, time
w, c = os.environ["TPURUN_WORKER_ID"], os.environ["TPURUN_CORE"]
n, period = int(sys.argv[1]), float(sys.argv[2])
for i in range(n):
    print(f"n {i} w{w} c{c}", flush=True)
    time.sleep(period)
print(f"done w{w} c{c}", flush=True)
"""


@pytest.fixture
def ticker(cli):  # noqa: F811  (the re-exported fixture)
    (cli.cwd / "ticker.py").write_text(TICKER)
    return "ticker.py"
