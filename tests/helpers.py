"""Shared test helpers: run the real `tpurun` entry point in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    code: int
    out: str
    err: str


def tpurun(
    *args: str,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    input: str | None = None,
) -> Result:
    full_env = dict(os.environ)
    full_env.pop("TPURUN_TPU", None)
    if env:
        full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "tpurun", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_clean_error(r: Result, code: int = 2) -> None:
    """One clear line on stderr, the right exit code, and never a traceback."""
    assert r.code == code, (r.code, r.out, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    assert r.err.strip(), "an error must say something on stderr"
