"""`tpurun emulator ...` as users run it: a detached server, faults from the shell, a clean stop."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from google.api_core import exceptions as gx
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2

from tests.helpers import assert_clean_error, tpurun
from tpurun.emulator.pytest_plugin import fast_polling, host_problem
from tpurun.worker.agent_files import pid_alive

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_rows(out: str) -> dict[str, list[str]]:
    """`tpurun emulator status`'s table by TPU name: its zone, how it was made, type, state, workers, addresses."""
    rows = {}
    for line in out.splitlines()[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 7 and cells[0] != "TPU":
            rows[cells[0]] = cells[1:]
    return rows


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """`tpurun ARGS` through the CLI's own entry point in this process (no interpreter start)."""
    import tpurun.cli

    code = tpurun.cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.integration
def test_found_by_the_endpoint_setting(tmp_path, monkeypatch, capsys):
    """An emulator started with its own --state-dir is the one every command finds when only TPURUN_API_ENDPOINT
    names it; status lists its Compute Engine TPUs (a VM and a group) with their workers; stop leaves nothing."""
    if host_problem():
        pytest.skip(host_problem())
    sd, port = tmp_path / "elsewhere", _free_port()
    monkeypatch.setenv("TPURUN_HOME", str(tmp_path / "home"))  # the default state dir is not SD
    monkeypatch.delenv("TPURUN_API_ENDPOINT", raising=False)
    monkeypatch.chdir(tmp_path)
    r = tpurun("emulator", "start", "--state-dir", str(sd), "--port", str(port))
    assert r.code == 0, r.err
    endpoint = f"http://127.0.0.1:{port}"
    assert r.out.strip().splitlines()[-1] == f"export TPURUN_API_ENDPOINT={endpoint}"
    server_pid = json.loads((sd / "server.json").read_text())["pid"]
    env = {"TPURUN_API_ENDPOINT": endpoint, "TPURUN_PROJECT": "p"}
    monkeypatch.setenv("TPURUN_API_ENDPOINT", endpoint)
    try:
        st = tpurun("emulator", "status", env=env)
        assert st.code == 0, st.err
        assert f"running: {endpoint} (pid {server_pid}, state dir {sd})" in st.out and "no TPUs" in st.out
        assert tpurun("emulator", "set", "--delay", "create=0.01", env=env).code == 0
        # --state-dir given still wins over the endpoint
        code, out, _ = _main(capsys, "emulator", "status", "--state-dir", str(tmp_path / "none"))
        assert code == 0 and f"not running (state dir {tmp_path / 'none'})" in out

        # a single-host Compute Engine TPU (a VM) and a multi-host one (a managed instance group), made at once
        made = {}
        for name, accel in (("one", "tpu7x-8"), ("pod", "tpu7x-16")):
            (tmp_path / name).mkdir()
            made[name] = subprocess.Popen(
                [sys.executable, "-m", "tpurun", "create", name, "-t", accel, "--zone", "us-central1-c"],
                cwd=tmp_path / name, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        for name, proc in made.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, (name, err)
        st = tpurun("emulator", "status", env=env)
        rows = _status_rows(st.out)
        assert rows["one"][:5] == ["us-central1-c", "Compute Engine VM", "tpu7x-8", "RUNNING", "1"], st.out
        assert rows["pod"][:5] == ["us-central1-c", "Compute Engine group", "tpu7x-16", "RUNNING", "2"], st.out
        assert len(set(rows["pod"][5].split(",")) - {"-"}) == 2, st.out
        code, out, _ = _main(capsys, "emulator", "status", "--json")
        doc = json.loads(out)
        assert doc["stateDir"] == str(sd) and doc["pid"] == server_pid and doc["delays"]["create"] == 0.01
        kinds = {t["name"].rsplit("/", 1)[-1]: (t["kind"], t["workers"]) for t in doc["computeTpus"]}
        assert kinds == {"one": ("instance", 1), "pod": ("group", 2)}
        assert _unshare_procs(sd)
    finally:
        stopped = tpurun("emulator", "stop", env=env)
    assert stopped.code == 0, stopped.err
    assert "nothing of it is left" in stopped.err
    assert not pid_alive(server_pid)  # gone (a zombie waits only for whichever process reaps it here)
    assert _unshare_procs(sd) == []
    assert str(sd) not in Path("/proc/self/mountinfo").read_text()
    # nothing answers there any more: one line naming what was looked for and how to name it
    for args in (["stop"], ["status"], ["set", "--delay", "create=1"]):
        code, _, err = _main(capsys, "emulator", *args)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"no tpurun emulator answers at {endpoint}" in err and "--state-dir" in err, err


@pytest.mark.integration
def test_stop_refuses_an_emulator_it_did_not_start(emulator):
    """The test session's emulator (a thread of this process, no server.json) is found through the endpoint for
    status, but `stop` will not wait on, or kill, a process `tpurun emulator start` did not make."""
    st = tpurun("emulator", "status", "--json", env={"TPURUN_API_ENDPOINT": emulator.endpoint})
    assert st.code == 0 and json.loads(st.out)["stateDir"] == str(emulator.state_dir)
    r = tpurun("emulator", "stop", env={"TPURUN_API_ENDPOINT": emulator.endpoint})
    assert_clean_error(r, 2)
    assert "was not started by `tpurun emulator start`" in r.err
    assert emulator.admin.status()["pid"] == os.getpid()  # still answering


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
