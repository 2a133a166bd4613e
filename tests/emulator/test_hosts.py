"""The emulator's worker hosts: real sshd in per-worker namespaces, metadata server, startup script.

Needs root and `unshare`; boots real namespaces.  Slots 240+ keep clear of other emulator
tests that may run at the same time on this machine (they allocate slots from 1).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import python_up
from tpurun.emulator._metadata import parse_ssh_keys
from tpurun.emulator.hosts import WorkerHosts, WorkerInfo
from tpurun.emulator.tpu_vm import image_paths

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None or not Path("/usr/sbin/sshd").exists(),
        reason="needs root, unshare and /usr/sbin/sshd",
    ),
]

NODE = "projects/p/locations/z/nodes/hosts-test"
SLOT = 241

STARTUP = """#!/bin/bash
echo "startup on $(hostname) as $(id -u) in $PWD home=$HOME md=$GCE_METADATA_HOST"
n=$(curl -s -H 'Metadata-Flavor: Google' \
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)
curl -s -X PUT -H 'Metadata-Flavor: Google' --data "ready-$n" \
  http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/tpurun/startup
sleep 999 &
"""


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.key = tmp / "root_key"
        self.alice_key = tmp / "alice_key"
        self.bob_key = tmp / "bob_key"
        self.root_pub = _keygen(self.key)
        self.alice_pub = _keygen(self.alice_key)
        self.bob_pub = _keygen(self.bob_key)
        self.metadata = {
            "ssh-keys": f"root:{self.root_pub}\nalice:{self.alice_pub}",
            "startup-script": STARTUP,
        }
        self.hosts = WorkerHosts(tmp / "state", key_propagation_delay=0.3)
        self.known_hosts = tmp / "known_hosts"

    def pin(self, workers: list[WorkerInfo]) -> None:
        self.known_hosts.write_text("".join(f"{w.address} {w.host_key}\n" for w in workers))

    def ssh(
        self,
        w: WorkerInfo,
        cmd: str,
        *,
        user: str = "root",
        key: Path | None = None,
        tty: bool = False,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        argv = [
            "ssh",
            "-i",
            str(key or self.key),
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "ConnectTimeout=10",
            "-p",
            str(w.ssh_port),
        ]
        argv += ["-tt"] if tty else ["-T"]
        r = subprocess.run([*argv, f"{user}@{w.address}", cmd], capture_output=True, text=True, timeout=30)
        if check:
            assert r.returncode == 0, (cmd, r.returncode, r.stdout, r.stderr)
        return r


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    e = Env(tmp_path_factory.mktemp("hosts"))
    workers = e.hosts.boot_node(
        NODE,
        SLOT,
        num_workers=4,
        generation="v4",
        accelerator_type="v4-32",
        get_metadata=lambda: dict(e.metadata),
        project="proj-x",
        zone="us-central2-b",
    )
    e.pin(workers)
    yield e
    e.hosts.close()


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait(pred, timeout: float = 15.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_workers_addresses_and_keys(env: Env) -> None:
    ws = env.hosts.workers(NODE)
    assert [w.address for w in ws] == [f"127.77.{SLOT}.{i + 1}" for i in range(4)]
    assert all(w.host_key.startswith("ssh-ed25519 AAAA") and len(w.host_key.split()) == 2 for w in ws)
    assert len({w.host_key for w in ws}) == 4
    assert all(w.init_pid for w in ws)
    assert ws[2].hostname.endswith("-w-2") and ws[2].hostname.startswith("t1v-n-")


def test_login_hostname_home_and_isolation(env: Env) -> None:
    ws = env.hosts.workers(NODE)
    names = [env.ssh(w, "hostname").stdout.strip() for w in ws]
    assert names == [w.hostname for w in ws]
    env.ssh(ws[1], "echo one > ~/mark; echo t > /tmp/tmark")
    assert env.ssh(ws[1], "cat /root/mark; cat /tmp/tmark").stdout.split() == ["one", "t"]
    assert env.ssh(ws[2], "ls ~/mark /tmp/tmark", check=False).returncode != 0
    env.ssh(ws[1], "nohup sleep 1000 >/dev/null 2>&1 & echo started")
    assert "sleep 1000" in env.ssh(ws[1], "ps ax").stdout
    assert "sleep 1000" not in env.ssh(ws[2], "ps ax").stdout
    # Its processes run in its own pid namespace (init is pid 1 there).
    assert env.ssh(ws[2], "cat /proc/1/cmdline | tr '\\0' ' '").stdout.count("tpurun-worker-init") == 1


def test_fake_tpu_devices(env: Env) -> None:
    w = env.hosts.workers(NODE)[0]
    out = env.ssh(
        w, "ls /dev/accel0 /dev/accel3 && test ! -e /dev/vfio && exec 5<>/dev/accel0 && readlink /proc/$$/fd/5"
    ).stdout
    assert out.splitlines()[-1] == "/dev/accel0"
    assert not Path("/dev/accel0").exists()
    # What sshd and shells need exists too.
    env.ssh(w, "echo x > /dev/null && head -c 4 /dev/urandom | wc -c && test -d /run/sshd && test -e /dev/ptmx")


def test_interactive_tty(env: Env) -> None:
    w = env.hosts.workers(NODE)[3]
    r = env.ssh(w, "tty", tty=True)
    assert r.stdout.strip().startswith("/dev/pts/")


def test_startup_script_and_guest_attributes(env: Env) -> None:
    def all_done() -> bool:
        return all(env.hosts.startup_exit_code(NODE, i) == 0 for i in range(4))

    _wait(all_done, what="startup scripts")
    attrs = env.hosts.guest_attributes(NODE)
    for i, (w, a) in enumerate(zip(env.hosts.workers(NODE), attrs, strict=True)):
        assert a[("tpurun", "startup")] == f"ready-{i}"
        assert f"ssh-ed25519 {a[('hostkeys', 'ssh-ed25519')]}" == w.host_key  # the guest agent's form
        log = env.hosts.startup_log(NODE, i).read_text()
        assert f"startup on {w.hostname} as 0 in / home=/root md={w.address}:80" in log
    # The script's background child lives in the worker's pid namespace.
    assert "sleep 999" in env.ssh(env.hosts.workers(NODE)[0], "ps ax").stdout


def test_metadata_server(env: Env) -> None:
    w = env.hosts.workers(NODE)[1]
    base = "http://metadata.google.internal/computeMetadata/v1"
    get = f"curl -s -f -H 'Metadata-Flavor: Google' {base}"
    out = env.ssh(
        w,
        f"{get}/instance/attributes/; echo; {get}/instance/attributes/worker-network-endpoints; echo;"
        f"{get}/instance/zone; echo; {get}/project/project-id; echo; {get}/instance/hostname",
    ).stdout
    assert "ssh-keys" in out and "tpu-env" in out and "agent-worker-number" in out
    assert f"{w.hostname}:" in out and f":127.77.{SLOT}.4" in out
    assert "/zones/us-central2-b" in out and "proj-x" in out
    tpu_env = env.ssh(w, f"{get}/instance/attributes/tpu-env").stdout
    assert "ACCELERATOR_TYPE: 'v4-32'" in tpu_env and "WORKER_ID: '1'" in tpu_env
    code = env.ssh(w, f"curl -s -o /dev/null -w '%{{http_code}}' {base}/instance/hostname").stdout
    assert code == "403"
    recursive = env.ssh(w, f"{get}/instance/attributes/?recursive=true").stdout
    assert '"agent-worker-number": "1"' in recursive


def _get(address: str, path: str, timeout: float = 30) -> tuple[str, str]:
    """(body, ETag) of a GET of PATH from the metadata server at ADDRESS."""
    request = urllib.request.Request(f"http://{address}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return answer.read().decode(), answer.headers["ETag"]


def test_a_get_that_waits_for_a_change_is_answered_when_a_host_event_changes(env: Env) -> None:
    """`?wait_for_change=true`: answered at once where `last_etag` is not the value's tag, after `timeout_sec`
    with the same value and tag where nothing changed, and with the new value as soon as the host's events
    change (the tag a hash of the value: the quiet value's tag again once the event is over)."""
    address = env.hosts.workers(NODE)[2].address
    key = "instance/maintenance-event"
    quiet, tag = _get(address, key)
    assert quiet == "NONE" and re.fullmatch(r"[0-9a-f]{16}", tag)
    assert _get(address, f"{key}?wait_for_change=true&last_etag=0000000000000000") == (quiet, tag)
    t0 = time.monotonic()
    assert _get(address, f"{key}?wait_for_change=true&last_etag={tag}&timeout_sec=0.5") == (quiet, tag)
    assert time.monotonic() - t0 >= 0.5
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_get, address, f"{key}?wait_for_change=true&last_etag={tag}&timeout_sec=60")
        env.hosts.set_events(NODE, [2], {"maintenance-event": "TERMINATE_ON_HOST_MAINTENANCE"})
        try:
            changed, new_tag = waiting.result(timeout=20)
        finally:
            env.hosts.set_events(NODE, [2], {"maintenance-event": None})
    assert changed == "TERMINATE_ON_HOST_MAINTENANCE" and new_tag != tag
    assert _get(address, key) == (quiet, tag)


def test_a_get_that_waits_on_a_directory_is_answered_when_the_nodes_metadata_changes(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recursive GET of the attributes waiting for a change sees a new key as soon as the API's metadata
    update is told to the hosts (as `refresh_ssh_keys` is on every update), with no look of its own meanwhile."""
    monkeypatch.setattr("tpurun.emulator._metadata.RECHECK", 3600.0)
    address = env.hosts.workers(NODE)[3].address
    path = "instance/attributes/?recursive=true"
    before, tag = _get(address, path)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_get, address, f"{path}&wait_for_change=true&last_etag={tag}&timeout_sec=600")
        assert not concurrent.futures.wait([waiting], timeout=1.0).done  # held: nothing changed
        env.metadata["waited-for"] = "here"
        try:
            env.hosts.refresh_ssh_keys(NODE)
            after, _ = waiting.result(timeout=30)
        finally:
            del env.metadata["waited-for"]
            env.hosts.refresh_ssh_keys(NODE)
    assert '"waited-for": "here"' in after and '"waited-for"' not in before


def test_second_user_and_key_scoping(env: Env) -> None:
    w = env.hosts.workers(NODE)[0]
    out = env.ssh(w, "echo $USER $HOME; id -u", user="alice", key=env.alice_key).stdout.split()
    assert out == ["alice", "/root", "0"]
    # alice's key is for alice only.
    assert env.ssh(w, "true", user="root", key=env.alice_key, check=False).returncode == 255


def test_key_update_after_refresh(env: Env) -> None:
    w = env.hosts.workers(NODE)[2]
    assert env.ssh(w, "true", user="bob", key=env.bob_key, check=False).returncode == 255
    env.metadata["ssh-keys"] += f"\nbob:{env.bob_pub}"
    env.hosts.refresh_ssh_keys(NODE)
    _wait(
        lambda: env.ssh(w, "true", user="bob", key=env.bob_key, check=False).returncode == 0,
        what="bob's key to propagate",
    )
    assert env.ssh(w, "whoami; echo $HOME", user="bob", key=env.bob_key).stdout.split()[-1] == "/root"


def test_parse_ssh_keys_expiry() -> None:
    keys = parse_ssh_keys(
        "alice:ssh-ed25519 AAAA1 a@x\n"
        'bob:ssh-ed25519 AAAA2 google-ssh {"userName":"bob","expireOn":"2000-01-01T00:00:00+0000"}\n'
        'carol:ssh-ed25519 AAAA3 google-ssh {"userName":"carol","expireOn":"2999-01-01T00:00:00Z"}\n'
        "garbage\nBad User:ssh-ed25519 AAAA4\n"
    )
    assert set(keys) == {"alice", "carol"}


def test_faults_stop_start_and_close(tmp_path: Path) -> None:
    key = tmp_path / "k"
    pub = _keygen(key)
    env = Env.__new__(Env)
    env.tmp, env.key, env.known_hosts = tmp_path, key, tmp_path / "kh"
    env.hosts = WorkerHosts(tmp_path / "state")
    md = {"ssh-keys": f"root:{pub}", "startup-script": "#!/usr/bin/python3\nimport os; print('py', os.getpid())\n"}
    node = "fault-node"

    def boot() -> list[WorkerInfo]:  # the node's first boot, and its boot again after its stop
        return env.hosts.boot_node(
            node,
            SLOT + 1,
            num_workers=2,
            generation="v5litepod",
            accelerator_type="v5litepod-16",
            get_metadata=lambda: md,
        )

    try:
        ws = boot()
        env.pin(ws)
        assert env.ssh(ws[0], "ls /dev/vfio").stdout.split() == ["0", "1", "2", "3", "vfio"]
        assert env.ssh(ws[0], "test ! -e /dev/accel0 && echo ok").stdout.strip() == "ok"
        _wait(lambda: env.hosts.startup_exit_code(node, 0) == 0, what="python startup script")
        assert "py " in env.hosts.startup_log(node, 0).read_text()
        env.ssh(ws[0], "echo keep > ~/home_mark")

        # kill_sshd: the worker takes no ssh connection (no sshd left); other processes live on; restart_sshd brings it back.
        env.ssh(ws[1], "nohup sleep 1001 >/dev/null 2>&1 &")
        env.hosts.kill_sshd(node, 1)
        assert env.ssh(ws[1], "true", check=False).returncode == 255
        _wait(
            lambda: "/usr/sbin/sshd" not in [_exe(p) for p in env.hosts.worker_root_pids(node, 1)],
            what="sshd processes to go",
        )
        assert any("sleep 1001" in _cmd(p) for p in env.hosts.worker_root_pids(node, 1))
        assert env.hosts.workers(node)[1].init_pid is not None
        env.hosts.restart_sshd(node, 1)
        assert "sleep 1001" in env.ssh(ws[1], "ps ax").stdout

        # kill_worker: everything in it dies.
        env.hosts.kill_worker(node, 1)
        assert env.hosts.worker_root_pids(node, 1) == []
        assert env.hosts.workers(node)[1].init_pid is None
        assert env.ssh(ws[0], "hostname").stdout.strip() == ws[0].hostname  # the other one is fine

        # stop/start keeps host keys and homes; /tmp is fresh.
        env.ssh(ws[0], "echo x > /tmp/gone")
        env.hosts.shutdown_node(node)
        assert all(w.init_pid is None for w in env.hosts.workers(node))
        ws2 = boot()
        assert [w.host_key for w in ws2] == [w.host_key for w in ws]
        # /tmp is the worker's own and empty after a reboot, except for where this machine's Python
        # lives when it is under /tmp (a venv of a clone in /tmp): the read-only "image" (tpu_vm.image_paths)
        image_tops = {p.split("/")[2] for p in image_paths() if p.startswith("/tmp/")}
        listed = env.ssh(ws2[0], "cat ~/home_mark; ls /tmp").stdout.split()
        assert [x for x in listed if x not in image_tops] == ["keep"]
        env.ssh(ws2[1], "nohup sleep 1002 >/dev/null 2>&1 &")
        ns_pids = [env.hosts.worker_root_pids(node, i) for i in range(2)]
        assert all(ns_pids)
    finally:
        env.hosts.close()
    state = str((tmp_path / "state").resolve())
    assert all(env.hosts.worker_root_pids(node, i) == [] for i in range(2))
    assert all(not Path(f"/proc/{p}").exists() for pids in ns_pids for p in pids)
    left = subprocess.run(["pgrep", "-f", state], capture_output=True, text=True).stdout.split()
    assert left == []
    assert state not in Path("/proc/self/mountinfo").read_text()
    # delete removes the node's directories.
    hosts2 = WorkerHosts(tmp_path / "state")
    hosts2.boot_node(node, SLOT + 1, num_workers=1, generation="v4", accelerator_type="v4-8", get_metadata=lambda: md)
    node_dir = hosts2.startup_log(node, 0).parent.parent
    hosts2.shutdown_node(node, delete=True)
    hosts2.close()
    assert not node_dir.exists()


def test_kill_orphans_after_emulator_crash(tmp_path: Path) -> None:
    from tpurun.emulator.procs import kill_orphans

    state = tmp_path / "state"
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from tpurun.emulator.hosts import WorkerHosts\n"
        f"h = WorkerHosts(Path({str(state)!r}))\n"
        f"h.boot_node('crash', {SLOT + 2}, num_workers=2, generation='v4', accelerator_type='v4-16',\n"
        "            get_metadata=dict)\n"
        "print('up', flush=True)\n"
        "time.sleep(100)\n"
    )
    proc = python_up(code)
    proc.kill()  # the emulator dies without close(): its workers survive it
    proc.wait()
    resolved = str(state.resolve())
    assert subprocess.run(["pgrep", "-f", resolved], capture_output=True).returncode == 0
    assert kill_orphans(state) == 2
    _wait(
        lambda: subprocess.run(["pgrep", "-f", resolved], capture_output=True).returncode == 1,
        what="orphaned workers to die",
    )


def _sshd_in(hosts: WorkerHosts, node: str, index: int) -> bool:
    return "/usr/sbin/sshd" in [_exe(p) for p in hosts.worker_root_pids(node, index)]


def test_each_connection_gets_its_own_sshd_for_ssh_exec_and_sftp(env: Env) -> None:
    """An idle worker runs no sshd: its init starts `sshd -i` inside the worker for each connection, which serves
    a shell command, an exec channel with its exit status and sftp, and leaves with the connection."""
    import io

    import paramiko

    w = env.hosts.workers(NODE)[3]
    _wait(lambda: not _sshd_in(env.hosts, NODE, 3), what="no sshd on an idle worker")
    client = paramiko.SSHClient()
    client.load_host_keys(str(env.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(w.address, w.ssh_port, "root", key_filename=str(env.key), look_for_keys=False, allow_agent=False)
    try:
        assert _sshd_in(env.hosts, NODE, 3)  # the connection's sshd runs in the worker's own namespaces
        _, out, _ = client.exec_command("hostname; exit 7")
        assert out.read().decode().strip() == w.hostname and out.channel.recv_exit_status() == 7
        sftp = client.open_sftp()
        sftp.putfo(io.BytesIO(b"through sftp\n"), "/root/sftp-file")
        got = io.BytesIO()
        sftp.getfo("/root/sftp-file", got)
        assert got.getvalue() == b"through sftp\n"
        sftp.close()
    finally:
        client.close()
    # OpenSSH's own sftp client, in batch mode
    back = env.tmp / "sftp-back"
    batch = f"put {env.tmp / 'root_key.pub'} /tmp/put.pub\nget /root/sftp-file {back}\n"
    r = subprocess.run(
        ["sftp", "-b", "-", "-i", str(env.key), "-o", "StrictHostKeyChecking=yes",
         "-o", f"UserKnownHostsFile={env.known_hosts}", "-o", "BatchMode=yes", f"root@{w.address}"],
        input=batch, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert back.read_text() == "through sftp\n"
    assert env.ssh(w, "cat /tmp/put.pub").stdout == (env.tmp / "root_key.pub").read_text()
    _wait(lambda: not _sshd_in(env.hosts, NODE, 3), what="every connection's sshd to leave with it")


@pytest.mark.timeout(240)
def test_a_node_of_more_than_254_workers_takes_consecutive_slots(tmp_path: Path) -> None:
    """The address plan: a node's workers fill consecutive /24s from its first slot (254 workers each); a node
    beside it takes the next free slot, one overlapping it is refused; a worker of the second /24 is itself,
    over ssh and to its metadata server."""
    pub = _keygen(tmp_path / "key")
    md = {"ssh-keys": f"root:{pub}"}
    hosts = WorkerHosts(tmp_path / "state")
    big, small = "projects/p/locations/z/nodes/big", "projects/p/locations/z/nodes/small"
    try:
        ws = hosts.boot_node(
            big, SLOT + 3, num_workers=256, generation="v4", accelerator_type="v4-2048", get_metadata=lambda: md
        )
        addresses = ["127.77.244.253", "127.77.244.254", "127.77.245.1", "127.77.245.2"]
        assert [w.address for w in ws[252:]] == addresses
        with pytest.raises(ValueError, match="overlap"):
            hosts.boot_node(
                "projects/p/locations/z/nodes/clash", SLOT + 4, num_workers=2, generation="v4",
                accelerator_type="v4-16", get_metadata=lambda: md,
            )  # fmt: skip
        ws2 = hosts.boot_node(
            small, SLOT + 5, num_workers=2, generation="v4", accelerator_type="v4-16", get_metadata=lambda: md
        )
        assert [w.address for w in ws2] == ["127.77.246.1", "127.77.246.2"]
        # idle, each worker is its init alone
        assert [len(hosts.worker_root_pids(big, i)) for i in (0, 253, 254, 255)] == [1, 1, 1, 1]
        env = Env.__new__(Env)
        env.key, env.known_hosts = tmp_path / "key", tmp_path / "known_hosts"
        env.pin([*ws, *ws2])
        ask = "curl -s -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/"
        out = env.ssh(ws[255], f"hostname; {ask}attributes/agent-worker-number; echo; {ask}network-interfaces/0/ip")
        assert out.stdout.split() == [ws[255].hostname, "255", "127.77.245.2"]
        assert env.ssh(ws2[1], "hostname").stdout.strip() == ws2[1].hostname
    finally:
        hosts.close()
