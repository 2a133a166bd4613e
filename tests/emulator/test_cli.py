"""`tpurun emulator ...` as users run it: a detached server, faults from the shell, a clean stop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.api_core import exceptions as gx
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2

from tests.helpers import assert_clean_error, tpurun
from tpurun.emulator.pytest_plugin import fast_polling, host_problem

PARENT = "projects/p/locations/us-central2-b"


def _unshare_procs(state_dir: Path) -> list[int]:
    out = []
    for p in (x for x in os.listdir("/proc") if x.isdigit()):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(state_dir) in cmd:
            out.append(int(p))
    return out


@pytest.mark.integration
def test_start_fault_commands_stop(tmp_path):
    if host_problem():
        pytest.skip(host_problem())
    sd = tmp_path / "emu"
    r = tpurun("emulator", "start", "--state-dir", str(sd), "--delay-create", "0.05", "--delay-delete", "0.05")
    assert r.code == 0, r.err
    last = r.out.strip().splitlines()[-1]
    assert last.startswith("export TPURUN_API_ENDPOINT=http://127.0.0.1:")
    endpoint = last.split("=", 1)[1]
    try:
        # starting again is harmless and says where the running one is
        again = tpurun("emulator", "start", "--state-dir", str(sd))
        assert again.code == 0 and again.out.strip().splitlines()[-1] == last

        c = tpu_v2.TpuClient(
            transport="rest", client_options={"api_endpoint": endpoint}, credentials=AnonymousCredentials()
        )
        node = tpu_v2.Node(
            accelerator_type="v4-16",
            runtime_version="tpu-ubuntu2204-base",
            scheduling_config=tpu_v2.SchedulingConfig(preemptible=True),
            metadata={"startup-script": "sleep 600 &"},
        )
        c.create_node(parent=PARENT, node_id="cli-node", node=node).result(polling=fast_polling())

        st = tpurun("emulator", "status", "--state-dir", str(sd), "--json")
        assert st.code == 0
        doc = json.loads(st.out)
        assert doc["running"] and doc["endpoint"] == endpoint
        assert [n["state"] for n in doc["nodes"]] == ["READY"]

        assert tpurun("emulator", "kill-sshd", "cli-node", "1", "--state-dir", str(sd)).code == 0
        assert tpurun("emulator", "kill-worker", "cli-node", "0", "--state-dir", str(sd)).code == 0
        assert_clean_error(tpurun("emulator", "kill-worker", "cli-node", "9", "--state-dir", str(sd)), 2)
        assert_clean_error(tpurun("emulator", "preempt", "no-such-node", "--state-dir", str(sd)), 2)

        assert tpurun("emulator", "fail-api", "--count", "1", "--code", "429", "--state-dir", str(sd)).code == 0
        with pytest.raises(gx.TooManyRequests):
            c.get_node(name=f"{PARENT}/nodes/cli-node")
        assert tpurun("emulator", "preempt", "cli-node", "--state-dir", str(sd)).code == 0
        assert c.get_node(name=f"{PARENT}/nodes/cli-node").state == tpu_v2.Node.State.PREEMPTED

        assert (
            tpurun("emulator", "set", "--capacity", "v4=4", "--delay", "create=0.01", "--state-dir", str(sd)).code == 0
        )
        doc = json.loads(tpurun("emulator", "status", "--state-dir", str(sd), "--json").out)
        assert doc["capacity"] == {"*/v4": "4 chips"} and doc["delays"]["create"] == 0.01
        assert_clean_error(tpurun("emulator", "set", "--delay", "bogus=1", "--state-dir", str(sd)), 2)
        assert tpurun("emulator", "set", "--clear-capacity", "--state-dir", str(sd)).code == 0

        log = json.loads(tpurun("emulator", "requests", "--json", "--state-dir", str(sd)).out)
        assert [x["status"] for x in log if x["method"] != "EVENT"][-2:] == [429, 200]
        c.create_node(parent=PARENT, node_id="left-running", node=node).result(polling=fast_polling())
        assert _unshare_procs(sd)
    finally:
        stopped = tpurun("emulator", "stop", "--state-dir", str(sd))
    assert stopped.code == 0, stopped.err
    assert "nothing of it is left" in stopped.err
    assert _unshare_procs(sd) == []
    assert str(sd) not in Path("/proc/self/mountinfo").read_text()
    st = tpurun("emulator", "status", "--state-dir", str(sd))
    assert st.code == 0 and "not running" in st.out
    assert tpurun("emulator", "stop", "--state-dir", str(sd)).code == 0  # stopping twice is fine


def test_fault_command_without_emulator(tmp_path):
    r = tpurun("emulator", "preempt", "x", "--state-dir", str(tmp_path))
    assert_clean_error(r, 2)
    assert "no emulator is running" in r.err


def test_refuses_when_not_root(tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to drop to another user")
    tmp_path.chmod(0o777)
    env = dict(os.environ, TPURUN_HOME=str(tmp_path), HOME=str(tmp_path))
    proc = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-m",
            "tpurun",
            "emulator",
            "start",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs root" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_refuses_without_sshd(monkeypatch, capsys, tmp_path):
    import tpurun.cli
    import tpurun.emulator.cli as ecli

    monkeypatch.setattr(ecli, "SSHD", tmp_path / "no-sshd")
    monkeypatch.setattr(ecli.os, "geteuid", lambda: 0)
    for cmd in ("start", "stop"):
        code = tpurun.cli.main(["emulator", cmd, "--state-dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2
        assert "install the Debian package openssh-server" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
