"""train --setup and requirements.txt on emulated workers: what a script needs gets installed on every
worker before it starts, once per content, with its output tagged [wN]; a missing module names the fix."""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import create_node, lines_by_core

pytestmark = pytest.mark.integration

USES = "import tpurun_demo_pkg\nprint('value', tpurun_demo_pkg.VALUE, flush=True)\n"


def _wheel(directory: Path, value: int, version: str) -> str:
    """A real pure-Python wheel of a package `tpurun_demo_pkg` (pip installs it offline)."""
    name = f"tpurun_demo_pkg-{version}-py3-none-any.whl"
    info = f"tpurun_demo_pkg-{version}.dist-info"
    files = {
        "tpurun_demo_pkg/__init__.py": f"VALUE = {value}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: tpurun-demo-pkg\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(directory / name, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return name


def test_requirements_beside_the_script_install_once_per_content_on_every_worker(cli):
    create_node(cli, "deps")
    (cli.cwd / "uses.py").write_text(USES)

    # nothing installed: every core dies of ModuleNotFoundError, and the hint says how to fix it
    r = cli("train", "uses.py", "--runtime", "cpu", "--cores", "1")
    assert r.code == 1
    assert "No module named 'tpurun_demo_pkg'" in r.err
    hint = next(line for line in r.err.splitlines() if line.startswith("hint:"))
    assert "no module 'tpurun_demo_pkg'" in hint and "--setup 'pip install PACKAGE'" in hint
    assert "requirements.txt" in hint

    wheel = _wheel(cli.cwd, 41, "0.1")
    (cli.cwd / "requirements.txt").write_text(f"--no-index\n./{wheel}\n")
    r = cli("train", "uses.py", "--runtime", "cpu", "--cores", "1", timeout=300)
    assert r.code == 0, r.err[-2000:]
    assert "setup on 2 worker(s): " in r.err and "-m pip install -r requirements.txt" in r.err
    for w in (0, 1):
        assert re.search(rf"^\[w{w}\] Successfully installed tpurun-demo-pkg-0\.1$", r.out, re.M), r.out
    assert lines_by_core(r.out) == {(0, 0): ["value 41"], (1, 0): ["value 41"]}

    # the same content again: skipped everywhere, no pip output
    r = cli("train", "uses.py", "--runtime", "cpu", "--cores", "1")
    assert r.code == 0, r.err
    assert "setup: unchanged on 2 worker(s), skipped" in r.err and "Successfully installed" not in r.out

    # a changed requirement runs it again
    wheel2 = _wheel(cli.cwd, 42, "0.2")
    (cli.cwd / "requirements.txt").write_text(f"--no-index\n./{wheel2}\n")
    r = cli("train", "uses.py", "--runtime", "cpu", "--cores", "1", timeout=300)
    assert r.code == 0, r.err[-2000:]
    assert "setup on 2 worker(s)" in r.err
    assert lines_by_core(r.out) == {(0, 0): ["value 42"], (1, 0): ["value 42"]}

    # installed on the workers' disks only, not into this machine's Python
    here = subprocess.run([sys.executable, "-c", "import tpurun_demo_pkg"], capture_output=True)
    assert here.returncode != 0


def test_setup_commands_run_in_the_job_dir_and_a_failure_names_the_worker(cli):
    create_node(cli, "setup")
    (cli.cwd / "show.py").write_text("print(open('made-by-setup').read().strip(), flush=True)\n")
    setup = "echo preparing; python3 -c 'import sys; print(sys.argv[1])' \"$(hostname)\" > made-by-setup"
    r = cli("train", "show.py", "--runtime", "cpu", "--cores", "1", "--setup", setup)
    assert r.code == 0, r.err
    assert sorted(re.findall(r"^\[w\d\] preparing$", r.out, re.M)) == ["[w0] preparing", "[w1] preparing"]
    shown = lines_by_core(r.out)
    assert shown[(0, 0)][0].endswith("-w-0") and shown[(1, 0)][0].endswith("-w-1")

    # w1 fails a while after starting, so w0 (whose part takes no time) has finished its setup by then:
    # a failure stops every worker's setup, and this checks what is remembered of the one that finished
    failing = (
        'echo "checking $(hostname)"; case $(hostname) in *-w-1) sleep 2; echo "no space left" >&2; exit 3 ;; esac'
    )
    r = cli("train", "show.py", "--runtime", "cpu", "--cores", "1", "--setup", failing)
    assert r.code == 1
    line = next(x for x in r.err.splitlines() if x.startswith("error:"))
    assert re.match(r"error: setup failed on w1 \(127\.[\d.]+\) \(exit code 3\); the job did not start", line), line
    assert "no space left" in r.err and "checking" in r.err
    assert "[w0/c0]" not in r.out  # no core started
    # a failed setup is not remembered: the next run tries again where it failed (w0 finished it)
    r = cli("train", "show.py", "--runtime", "cpu", "--cores", "1", "--setup", failing)
    assert r.code == 1 and "setup on 1 worker(s)" in r.err and "unchanged on 1 worker(s), skipped" in r.err
