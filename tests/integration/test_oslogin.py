"""tpurun in a project that enforces OS Login, against the emulator's project metadata, OS Login API and workers
that honour it as Google's guest does (Google's own clients set the project up): tpurun writes no `ssh-keys`,
imports its key into the acting account's login profile with an expiry, logs in as the profile's POSIX user
(exec, ssh, sync, train, the job and health commands, download, autostop's start of the watchdogs,
maintenance's question to the agents), an account without OS Login's admin role has no sudo, so the watchdog
is not started for it (autostop and `train --down` refused in one line naming the role), a key put in metadata
by hand is refused, and under 2-step verification
each worker asks a person on a terminal for the code (the emulator's, as the test's answer), a command without one
stops in one line, and a service account goes through with its key alone."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time

import paramiko
import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1, oslogin_v1, tpu_v2

from tests.helpers import assert_clean_error, autostop_starts_the_watchdogs, create_node, detached_loop, pids_in
from tpurun.emulator.admin_client import AdminClient
from tpurun.emulator.oslogin import posix_uid
from tpurun.emulator.pytest_plugin import fast_polling, global_client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROJECT = "locked-project"  # a project of its own: the emulator is shared with other files
ALICE = "alice@example.com"
SERVICE = "trainer@locked-project.iam.gserviceaccount.com"
DANA = "dana@example.com"  # given OS Login's login role alone (roles/compute.osLogin): no sudo


def _projects(emulator) -> compute_v1.ProjectsClient:
    return global_client(emulator.endpoint, compute_v1.ProjectsClient)


def _oslogin(emulator) -> oslogin_v1.OsLoginServiceClient:
    return oslogin_v1.OsLoginServiceClient(
        transport="rest", client_options={"api_endpoint": emulator.endpoint}, credentials=AnonymousCredentials()
    )


def _set_project_metadata(emulator, **items: str) -> None:
    """ITEMS (enable_oslogin -> enable-oslogin) set in the project's common metadata, as gcloud's
    `compute project-info add-metadata` does: read, change, write with the fingerprint read."""
    client = _projects(emulator)
    current = client.get(project=PROJECT).common_instance_metadata
    values = {i.key: i.value for i in current.items}
    values.update({k.replace("_", "-"): v for k, v in items.items()})
    body = compute_v1.Metadata(
        fingerprint=current.fingerprint, items=[compute_v1.Items(key=k, value=v) for k, v in values.items()]
    )
    client.set_common_instance_metadata(project=PROJECT, metadata_resource=body).result(timeout=30)


@pytest.fixture(scope="module")
def locked(emulator, tmp_path_factory):
    """A 2-worker TPU made by tpurun in a project that enforces OS Login, as ALICE (deleted after the file)."""
    from tests.integration.conftest import Cli

    cli = Cli.under(tmp_path_factory.mktemp("oslogin"), emulator)
    cli.env.update({"TPURUN_PROJECT": PROJECT, "TPURUN_ACCOUNT": ALICE})
    r = cli("emulator", "project-metadata", "enable-oslogin=TRUE")  # as compute.requireOsLogin writes it
    assert r.code == 0 and r.out.splitlines() == ["enable-oslogin=TRUE"], (r.out, r.err)
    node = create_node(cli, "locked", "v4-16")
    yield cli, node
    cli.env["TPURUN_ACCOUNT"] = ALICE
    assert cli("delete", "locked", "--yes").code == 0  # its chips are the zone's capacity for the next file


def test_tpurun_logs_in_as_the_profiles_user_with_a_key_that_expires(locked, emulator):
    cli, node = locked
    assert "ssh-keys" not in node.get("metadata", {}), node.get("metadata")
    for relay in ("--no-relay", "--relay"):  # through relays w0 logs in to w1, as the same user with the same key
        cli.env["TPURUN_RELAY_ROOTS"] = "1"
        r = cli("exec", relay, "--", "sh", "-c", 'echo "user=$USER"')
        assert r.code == 0, r.err
        assert sorted(line.split()[-1] for line in r.out.splitlines()) == ["user=alice_example_com"] * 2, r.out
    profile = _oslogin(emulator).get_login_profile(request={"name": f"users/{ALICE}", "project_id": PROJECT})
    public = (cli.tpurun_home / "ssh" / "id_ed25519.pub").read_text().split()[:2]
    (mine,) = [k for k in profile.ssh_public_keys.values() if k.key.split()[:2] == public]
    left = mine.expiration_time_usec / 1e6 - time.time()
    assert 0 < left <= 3600, left  # never a key without an expiry
    r = cli("config", "show", "--json")
    assert json.loads(r.out)["account"] == {"value": ALICE, "source": "env TPURUN_ACCOUNT"}
    # sync and train log in the same way
    (cli.cwd / "t.py").write_text(
        "import os, getpass\nprint('hello from', os.environ['TPURUN_WORKER_ID'], getpass.getuser())\n"
    )
    r = cli("train", "t.py", "--runtime", "cpu", "--launch", "host")
    assert r.code == 0, r.err
    assert sum("hello from" in line for line in r.out.splitlines()) == 2, r.out
    job = r.err.split("job ", 1)[1].split(":", 1)[0]
    for command in (["jobs"], ["logs", job], ["kill-stale", "--dry-run"], ["doctor"]):  # the job and health ones
        r = cli(*command)
        assert r.code == 0, (command, r.err)


def test_ssh_stacks_cancel_download_autostop_and_maintenance_log_in_as_the_profiles_user(locked, emulator):
    """`tpurun ssh`; a detached job's stacks and cancel and download (through a relay: w0 logs in to w1),
    `maintenance --now` refused because the agents say the job runs, and autostop starting the watchdogs where
    the TPU's boot does not: each as the profile's user."""
    cli, _ = locked
    name = f"projects/{PROJECT}/locations/{emulator.zone}/nodes/locked"
    r = cli("ssh", "--worker", "1", "--", "sh", "-c", 'echo "user=$USER"')
    assert (r.code, r.out.strip()) == (0, "user=alice_example_com"), (r.out, r.err)
    cli.env["TPURUN_RELAY_ROOTS"] = "1"
    job = detached_loop(cli, 2, "--relay")
    r = cli("stacks", "--relay", job)
    assert r.code == 0 and "loop.py" in r.out and "wait_here" in r.out, (r.out, r.err)
    emulator.admin.maintenance(name, 0, notice=7 * 86400, kind="SCHEDULED")  # a week away: nothing goes down
    r = cli("--plain", "maintenance", "locked", "--now")
    assert_clean_error(r, 2)
    assert f"job(s) {job} run on locked" in r.err, r.err
    r = cli("cancel", "--relay", job)
    assert r.code == 0 and f"job {job} stopped on 2 worker(s)" in r.err, r.err
    assert not pids_in(emulator, name, [0, 1], "loop.py")
    r = cli("download", "--relay", "loop.txt", "back")  # what the job wrote, as the profile's user
    assert r.code == 0, r.err
    got = [(cli.cwd / "back" / f"w{w}" / "loop.txt").read_text().split() for w in (0, 1)]
    assert [user for user, _ in got] == ["alice_example_com"] * 2 and [h[-4:] for _, h in got] == ["-w-0", "-w-1"]
    autostop_starts_the_watchdogs(cli, emulator, name, 2)


def _watchdogs_gone(emulator, name: str) -> None:
    """Every worker's watchdog of the TPU NAME killed, returned once none runs."""
    for pid in pids_in(emulator, name, [0, 1], "watchdog.py run"):
        os.kill(pid, 9)
    deadline = time.monotonic() + 30
    while pids_in(emulator, name, [0, 1], "watchdog.py run"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_without_admin_login_there_is_no_sudo_and_the_watchdog_is_not_started(locked, emulator):
    """DANA has OS Login's login role alone: on each worker a user of her own, without sudo (ALICE, whose role is
    adminLogin, has it). On a TPU whose boot starts the watchdog (tpurun made it: its startup script starts it
    as root) autostop asks nothing more of her; on one whose boot does not, autostop and `train --down` stop in one
    line naming the role she lacks and her account, the job never started and the TPU left as it was."""
    cli, _ = locked
    name = f"projects/{PROJECT}/locations/{emulator.zone}/nodes/locked"
    r = cli("emulator", "oslogin-role", DANA, "login")
    assert r.code == 0, r.err
    probe = 'echo "uid=$(id -u) sudo=$(sudo -n id -u 2>&1)"'
    client = emulator.client()
    made = client.get_node(name=name)
    script = made.metadata["startup-script"]
    try:
        cli.env["TPURUN_ACCOUNT"] = DANA
        r = cli("exec", "--", "sh", "-c", probe)
        assert r.code == 0, r.err
        got = {line.split(None, 1)[1] for line in r.out.splitlines()}
        assert got == {f"uid={posix_uid(DANA)} sudo=sudo: a password is required"}, r.out
        assert pids_in(emulator, name, [0, 1], "watchdog.py run")  # the TPU's boot started them
        r = cli("autostop", "locked", "1h")
        assert r.code == 0 and "starting the watchdog" not in r.err, r.err
        assert cli("autostop", "locked", "off").code == 0
        made.metadata["startup-script"] = "#!/bin/bash\necho made by someone else\n"
        client.update_node(node=made, update_mask="metadata").result(polling=fast_polling())
        _watchdogs_gone(emulator, name)
        before = client.get_node(name=name).metadata.get("tpurun-autostop")
        r = cli("--plain", "autostop", "locked", "1h")
        assert_clean_error(r, 2)
        line = next(x for x in r.err.splitlines() if x.startswith("error:"))
        assert "roles/compute.osAdminLogin" in line and DANA in line and "autostop is unchanged" in line, r.err
        assert client.get_node(name=name).metadata.get("tpurun-autostop") == before
        (cli.cwd / "down.py").write_text("print('the job ran')\n")
        r = cli("--plain", "train", "--down", "down.py", "--runtime", "cpu", "--launch", "host")
        assert_clean_error(r, 2)
        line = next(x for x in r.err.splitlines() if x.startswith("error:"))
        assert "roles/compute.osAdminLogin" in line and DANA in line and "job was not started" in line, r.err
        assert "the job ran" not in r.out and "DELETING" not in r.err, (r.out, r.err)
        assert client.get_node(name=name).state == tpu_v2.Node.State.READY
        assert not pids_in(emulator, name, [0, 1], "watchdog.py run")
        cli.env["TPURUN_ACCOUNT"] = ALICE
        r = cli("exec", "--", "sh", "-c", probe)
        assert {line.split(None, 1)[1] for line in r.out.splitlines()} == {"uid=0 sudo=0"}, (r.out, r.err)
        r = cli("autostop", "locked", "1h")  # an admin starts them
        assert r.code == 0 and "starting the watchdog on every worker" in r.err, r.err
        assert len(pids_in(emulator, name, [0, 1], "watchdog.py run")) == 2
        assert cli("autostop", "locked", "off").code == 0
    finally:
        cli.env["TPURUN_ACCOUNT"] = ALICE
        now = client.get_node(name=name)
        now.metadata["startup-script"] = script
        client.update_node(node=now, update_mask="metadata").result(polling=fast_polling())


def test_a_key_in_metadata_is_refused_under_os_login(locked, emulator):
    cli, _ = locked
    name = f"projects/{PROJECT}/locations/{emulator.zone}/nodes/locked"
    address = emulator.node_info(name)["workers"][0]["address"]
    public = (cli.tpurun_home / "ssh" / "id_ed25519.pub").read_text().strip()
    r = cli("exec", "--", "true")  # (tpurun's own login works)
    assert r.code == 0, r.err
    tpu = tpu_v2.TpuClient(
        transport="rest", client_options={"api_endpoint": emulator.endpoint}, credentials=AnonymousCredentials()
    )
    node = tpu.get_node(name=name)
    node.metadata["ssh-keys"] = f"root:{public}"  # by hand, as a user might
    tpu.update_node(node=node, update_mask="metadata").result(polling=fast_polling())
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # the test's own probe, not tpurun
    with pytest.raises(paramiko.AuthenticationException):
        client.connect(
            address, username="root", key_filename=str(cli.key), look_for_keys=False, allow_agent=False, timeout=10
        )
    client.close()


def _on_a_terminal(cli, args: list[str], answer: str | None, timeout: float = 120) -> tuple[int, str, list[str]]:
    """`tpurun ARGS` with stdin and stderr on a pseudo-terminal (stdout a pipe): every question it asks answered
    with ANSWER (or, when None, the emulator's security code of the time). (exit code, stdout, the terminal's
    text), and the questions asked."""
    master, slave = os.openpty()
    env = {**os.environ, **cli.env}
    env.pop("TPURUN_TPU", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpurun", *args], cwd=cli.cwd, env=env, stdin=slave, stdout=subprocess.PIPE,
        stderr=slave, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    seen, searched, asked, deadline = "", 0, [], time.monotonic() + timeout
    admin = AdminClient(cli.emulator.endpoint)
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096).decode(errors="replace")
                except OSError:  # the terminal's last holder closed it
                    break
                seen += chunk
                while (found := PROMPT.search(seen, searched)) is not None:
                    asked.append(found.group(0))
                    searched = found.end()
                    os.write(master, ((answer if answer is not None else admin.security_code(ALICE)) + "\n").encode())
            elif proc.poll() is not None:
                break
        out = proc.stdout.read().decode() if proc.stdout else ""
        return proc.wait(timeout=10), out + seen, asked
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


PROMPT = re.compile(r"\[w\d+\] Enter your one-time password: ")


@pytest.fixture
def two_step(locked, emulator):
    """The project asks 2-step verification, once every worker of the TPU asks it (metadata takes a moment)."""
    cli, _ = locked
    _set_project_metadata(emulator, enable_oslogin_2fa="TRUE")
    name = f"projects/{PROJECT}/locations/{emulator.zone}/nodes/locked"
    key = paramiko.Ed25519Key.from_private_key_file(str(cli.key))
    r = cli("exec", "--", "true")  # (imports the key, as any command does)
    for worker in emulator.node_info(name)["workers"]:
        deadline = time.monotonic() + 30
        while True:  # the key alone: the worker asks for a further step, and does not let tpurun in
            t = paramiko.Transport((worker["address"], 22))
            try:
                t.start_client(timeout=10)
                remaining = t.auth_publickey("alice_example_com", key)
                authenticated = t.is_authenticated()
            finally:
                t.close()
            if remaining == ["keyboard-interactive"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert remaining == ["keyboard-interactive"] and not authenticated, (remaining, r.err)
    try:
        yield cli
    finally:
        cli.env["TPURUN_ACCOUNT"] = ALICE
        _set_project_metadata(emulator, enable_oslogin_2fa="FALSE")


def test_two_step_verification_without_a_terminal_is_one_line_and_a_service_account_goes_through(two_step):
    cli = two_step
    r = cli("--plain", "exec", "--", "true", input="")
    assert_clean_error(r, 2)
    assert len(r.err.strip().splitlines()) <= 2, r.err  # the line and its hint
    assert "2-step verification" in r.err and "no terminal" in r.err and "service account" in r.err, r.err
    cli.env["TPURUN_ACCOUNT"] = SERVICE
    r = cli("exec", "--", "sh", "-c", 'echo "user=$USER"')
    assert r.code == 0, r.err
    users = {line.split()[-1] for line in r.out.splitlines()}
    assert len(users) == 1 and users.pop().startswith("user=sa_"), r.out


def test_two_step_verification_on_a_terminal_asks_each_worker_once(two_step):
    cli = two_step
    started = time.monotonic()
    code, text, asked = _on_a_terminal(cli, ["exec", "--", "sh", "-c", 'echo "user=$USER"'], None)
    assert code == 0, text
    assert sorted(asked) == ["[w0] Enter your one-time password: ", "[w1] Enter your one-time password: "], text
    assert sorted(line.split()[-1] for line in text.splitlines() if "user=" in line) == ["user=alice_example_com"] * 2
    took = time.monotonic() - started
    code, text, asked = _on_a_terminal(cli, ["exec", "--", "true"], "abcdef")  # a wrong code
    assert code != 0 and "Traceback" not in text, text
    assert "2-step verification refused" in text and len(asked) == 2, text
    code, text, asked = _on_a_terminal(cli, ["exec", "--relay", "--", "true"], None)  # relays cannot answer
    assert code == 2 and not asked and "relays cannot answer" in text and "Traceback" not in text, text
    assert took < 30, took
