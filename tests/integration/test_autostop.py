"""Autostop and `train --down` through the real CLI, the real google-cloud-tpu client and real sshd workers:
the watchdog runs on the emulated workers themselves and calls the emulated API with the VM's own token.

The idle periods are seconds long: TPURUN_WATCHDOG_TICK=0.5 (the documented test setting) lets
`--autostop 2s` through and makes the watchdog look twice a second."""

from __future__ import annotations

import datetime
import json
import signal
import time

import pytest
from google.cloud import tpu_v2

from tests.helpers import assert_clean_error, calls_since, finish, popen, read_until

pytestmark = pytest.mark.integration

TICK = "0.5"
JOB = (
    "import sys, time\n"
    "print('job running', flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
    "print('job done at', time.time(), flush=True)\n"
    "sys.exit(int(sys.argv[2]))\n"
)
# runs until the test lets it end (a file in the worker's home), however slow the machine: then as JOB does
UNTIL = (
    "import pathlib, sys, time\n"
    "print('job running', flush=True)\n"
    "while not (pathlib.Path.home() / 'release').exists():\n"
    "    time.sleep(0.1)\n"
    "print('job done at', time.time(), flush=True)\n"
)
# holds the TPU's first device file open (as a TPU program does) until killed or the time is up
# holds a TPU device until the test releases it (a file on the worker), 300 s at most
HOLD = (
    "import os, sys, time; f = open('/dev/accel0', 'rb'); print('holding', flush=True); end = time.time() + 300\n"
    "while not os.path.exists(sys.argv[1]) and time.time() < end: time.sleep(0.1)"
)
RELEASE = "/tmp/tpurun-test-release"


@pytest.fixture
def tp(cli):
    cli.env["TPURUN_WATCHDOG_TICK"] = TICK
    (cli.cwd / "job.py").write_text(JOB)
    (cli.cwd / "until.py").write_text(UNTIL)
    yield cli


def _exists(emulator, name: str) -> bool:
    return any(n.name == emulator.node_name(name) for n in emulator.client().list_nodes(parent=emulator.parent))


def _gone_within(emulator, name: str, timeout: float) -> float:
    """Seconds until NAME no longer exists (fails after TIMEOUT)."""
    start = time.monotonic()
    while _exists(emulator, name):
        assert time.monotonic() - start < timeout, f"{name} still exists after {timeout} s"
        time.sleep(0.2)
    return time.monotonic() - start


def _nothing_left(emulator) -> None:
    client = emulator.client()
    assert [n.name for n in client.list_nodes(parent=emulator.parent)] == []
    assert [q.name for q in client.list_queued_resources(parent=emulator.parent)] == []


def _deleted_by_vm(emulator, before: int, resource: str) -> dict:
    """The API call that deleted RESOURCE since BEFORE: made with a worker's own token, an ordinary LRO."""
    calls = [r for r in emulator.requests(before) if r["method"] == "DELETE" and r["path"].endswith(resource)]
    assert calls, emulator.requests(before)
    assert calls[0]["status"] == 200 and calls[0]["caller"].startswith("vm:"), calls
    ops = emulator.client().list_operations(request={"name": emulator.parent}).operations
    meta = [tpu_v2.OperationMetadata.deserialize(op.metadata.value) for op in ops if op.metadata.value]
    assert any(m.verb == "delete" and m.target.endswith(resource) for m in meta), meta
    return calls[0]


def _describe(tp, name: str) -> dict:
    r = tp("describe", name, "--json")
    assert r.code == 0, r.err
    return json.loads(r.out)


def test_idle_node_is_deleted_by_its_own_watchdog(tp, emulator):
    before = len(emulator.requests())
    r = tp("create", "idle", "-t", "v4-8", "--autostop", "2s")
    assert r.code == 0, r.err
    _gone_within(emulator, "idle", 30)
    call = _deleted_by_vm(emulator, before, "/nodes/idle")
    assert call["caller"] == f"vm:{emulator.node_name('idle')}"
    _nothing_left(emulator)


def test_not_deleted_while_a_detached_job_runs_then_after_it_plus_the_period(tp, emulator):
    assert tp("create", "busy", "-t", "v4-16").code == 0
    before = len(emulator.requests())
    r = tp("train", "until.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip()
    r = tp("autostop", "busy", "2s")
    assert r.code == 0, r.err
    assert "busy: autostop delete after 2s idle" in r.err
    time.sleep(3)  # longer than the period: the job keeps it
    d = _describe(tp, "busy")
    assert d["autostop"] == {"idleSeconds": 2, "action": "delete"}
    assert d["jobs"] == [job] and d["idleSeconds"] is None and "runs job" in d["busy"]
    assert "busy: " in d["watchdog"]
    r = tp("exec", "--worker", "0", "--", "cat", "/run/tpurun/watchdog.log")  # the decisions, on worker 0
    assert r.code == 0 and f"busy: w0 runs job {job}" in r.out, (r.out, r.err)
    listed = json.loads(tp("list", "--json").out)
    assert [(n["name"], n["jobs"]) for n in listed] == [("busy", [job])]
    assert tp("exec", "--", "touch", "release").code == 0  # the job may end now
    r = tp("logs", job, "--follow")  # until the job ends
    assert r.code == 0 and "job done" in r.out, r.err
    done_at = float(r.out.split("job done at ")[1].split()[0])  # the job's last moment is after this
    _gone_within(emulator, "busy", 30)
    deleted = _deleted_by_vm(emulator, before, "/nodes/busy")["time"]
    idle = datetime.datetime.fromisoformat(deleted.replace("Z", "+00:00")).timestamp() - done_at
    assert idle >= 2.0, idle  # the whole idle period after the job, not before
    _nothing_left(emulator)


def test_list_shows_a_jobs_start_and_end_at_once_not_a_tick_later(tp, emulator):
    """The watchdog looks for a job's start or end between its ticks (each second, from the agents' state
    alone), so `list` and `describe` do not show an ended job as running until the next tick: here ten
    minutes away."""
    tp.env["TPURUN_WATCHDOG_TICK"] = "600"
    assert tp("create", "slow", "-t", "v4-8", "--autostop", "1h").code == 0
    # the watchdog's first look is done (published), the next whole one ten minutes away
    client, deadline = emulator.client(), time.monotonic() + 60

    def looked() -> bool:
        workers = client.get_guest_attributes(request={"name": emulator.node_name("slow")}).guest_attributes
        return bool(workers) and all(
            any((i.namespace, i.key) == ("tpurun", "watch") for i in w.query_value.items) for w in workers
        )

    while not looked():
        assert time.monotonic() < deadline, "the watchdog never published its first look"
        time.sleep(0.1)

    def jobs_listed(want: list[str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while (got := json.loads(tp("list", "--json").out)[0]["jobs"]) != want:
            assert time.monotonic() < deadline, (got, want)
            time.sleep(0.2)

    r = tp("train", "until.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip()
    jobs_listed([job])
    assert tp("exec", "--", "touch", "release").code == 0  # the job may end now
    jobs_listed([])
    assert _describe(tp, "slow")["jobs"] == []
    assert tp("delete", "slow", "--yes").code == 0


def test_not_deleted_while_a_process_holds_a_tpu_device(tp, emulator):
    assert tp("create", "held", "-t", "v4-16").code == 0
    holder = popen(tp, "exec", "--worker", "1", "--", "python3", "-c", HOLD, RELEASE)
    read_until(holder, lambda lines: any("holding" in line for line in lines))
    r = tp("autostop", "held", "2s")
    assert r.code == 0, r.err
    # the watchdogs' next reports, past the 2 s autostop period, say the holder keeps it busy
    deadline = time.monotonic() + 10
    while (d := _describe(tp, "held"))["busy"] != "w1: 1 process(es) hold the TPU" and time.monotonic() < deadline:
        pass
    assert d["idleSeconds"] is None and d["busy"] == "w1: 1 process(es) hold the TPU", d
    assert d["jobs"] == []
    assert tp("exec", "--worker", "1", "--", "touch", RELEASE).code == 0
    out, err = finish(holder)
    assert holder.returncode == 0, err  # the node was there for the whole time the device was held
    ended = time.monotonic()
    _gone_within(emulator, "held", 30)
    assert time.monotonic() - ended >= 1.5
    _nothing_left(emulator)


def test_a_long_setup_is_work_not_idle_time(tp, emulator):
    """`train --setup` runs before the job exists: its processes carry TPURUN_ACTIVITY, which the watchdog
    counts as work."""
    assert tp("create", "setup", "-t", "v4-16").code == 0
    proc = popen(tp, "train", "job.py", "0", "0", "--runtime", "cpu", "--launch", "host", "--setup", "sleep 6")
    deadline = time.monotonic() + 60
    while "runs tpurun setup" not in (_describe(tp, "setup")["busy"] or ""):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.3)
    assert tp("autostop", "setup", "2s").code == 0
    out, err = finish(proc)
    assert proc.returncode == 0, err  # setup and job ran to their end: the TPU was kept meanwhile
    assert "job done" in out
    _gone_within(emulator, "setup", 30)
    _nothing_left(emulator)


def test_autostop_off_disarms_and_setting_it_again_arms(tp, emulator):
    assert tp("create", "toggle", "-t", "v4-8").code == 0
    # it runs until released, so the TPU is busy while autostop is armed and then disarmed, however slow the machine
    r = tp("train", "until.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip()
    assert tp("autostop", "toggle", "2s").code == 0
    r = tp("autostop", "toggle", "off")
    assert r.code == 0 and "toggle: autostop off" in r.err, r.err
    assert tp("exec", "--", "touch", "release").code == 0  # the job may end now
    assert tp("logs", job, "--follow").code == 0
    time.sleep(5)  # the job's end plus more than the old period
    assert _exists(emulator, "toggle")
    d = _describe(tp, "toggle")
    assert d["autostop"] == "off", d
    assert d["idleSeconds"] >= 4 and d["watchdog"].endswith("autostop off"), d
    assert tp("autostop", "toggle", "2s").code == 0
    _gone_within(emulator, "toggle", 30)
    _nothing_left(emulator)


def test_a_dead_worker_keeps_its_tpu_busy_no_longer(tp, emulator):
    """A v4-16 whose worker 1 dies (its whole VM: `emulator kill-worker`): its watchdog goes silent. Past the bound
    (TPURUN_WATCHDOG_SILENT) the deciding watchdog asks the API (the node READY: it has no word of one VM) and
    knocks at the VM's address: nothing takes the connection, so w1 is dead, which `describe` and `list` say
    instead of "busy"; and autostop deletes the TPU its only busy worker was keeping."""
    tp.env["TPURUN_WATCHDOG_SILENT"] = "3"
    assert tp("create", "dead", "-t", "v4-16").code == 0
    emulator.kill_worker(emulator.node_name("dead"), 1)
    assert tp("autostop", "dead", "1h").code == 0  # armed, with a period this test does not wait for
    deadline = time.monotonic() + 60
    while not (d := _describe(tp, "dead"))["silent"] or " dead: " not in d["silent"][0]:
        assert time.monotonic() < deadline, d
        time.sleep(0.2)
    (said,) = d["silent"]
    assert said.startswith("w1 dead: silent for ") and "its VM takes no connection at " in said, said
    assert "the API says its node is READY" in said and d["busy"] is None and d["idleSeconds"] is not None, d
    (listed,) = json.loads(tp("list", "--json").out)
    assert listed["silent"] == [said] or listed["silent"][0].startswith("w1 dead: "), listed
    shown = tp("list")
    assert "w1 dead: silent for" in shown.out and "busy" not in shown.out, shown.out
    before = len(emulator.requests())
    assert tp("autostop", "dead", "2s").code == 0
    _gone_within(emulator, "dead", 60)
    _deleted_by_vm(emulator, before, "/nodes/dead")
    _nothing_left(emulator)


def test_autostop_on_a_node_tpurun_did_not_create(tp, emulator, tpu_node):
    """No tpurun startup wrapper there: `autostop` starts the watchdog on every worker over SSH first."""
    node = tpu_node("v4-16")
    r = tp("autostop", node.node_id, "2s")  # not attached: no key of tpurun's there, no pinned host key
    assert_clean_error(r, 4)
    assert "autostop is unchanged" in r.err
    assert "tpurun-autostop" not in emulator.client().get_node(name=node.name).metadata
    assert tp("attach", node.node_id).code == 0
    before = len(emulator.requests())
    r = tp("autostop", node.node_id, "2s")
    assert r.code == 0, r.err
    assert "starting the watchdog on every worker" in r.err
    _gone_within(emulator, node.node_id, 30)
    _deleted_by_vm(emulator, before, f"/nodes/{node.node_id}")
    _nothing_left(emulator)


def test_autostop_action_stop_stops_a_single_host_vm(tp, emulator):
    r = tp("create", "sleepy", "-t", "v4-8", "--autostop", "2s", "--autostop-action", "stop")
    assert r.code == 0, r.err
    client = emulator.client()
    deadline = time.monotonic() + 30
    while client.get_node(name=emulator.node_name("sleepy")).state.name != "STOPPED":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert tp("delete", "sleepy", "--yes").code == 0
    _nothing_left(emulator)


def test_queued_resource_node_takes_its_queued_resource_with_it(tp, emulator):
    before = len(emulator.requests())
    r = tp("create", "qd", "-t", "v4-8", "--queued", "--autostop", "2s")
    assert r.code == 0, r.err
    _gone_within(emulator, "qd", 30)
    _deleted_by_vm(emulator, before, "/queuedResources/qd")
    deadline = time.monotonic() + 30
    while list(emulator.client().list_queued_resources(parent=emulator.parent)):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    _nothing_left(emulator)


@pytest.mark.parametrize("code", [0, 3])
def test_train_down_deletes_after_the_job_succeeds_or_fails(tp, emulator, code):
    assert tp("create", "once", "-t", "v4-16").code == 0
    r = tp("train", "job.py", "0", str(code), "--runtime", "cpu", "--launch", "host", "--down")
    assert r.code == (0 if code == 0 else 1), r.err
    assert "deleted once (--down)" in r.err
    assert not _exists(emulator, "once")
    _nothing_left(emulator)


def test_train_down_after_a_failed_setup_and_a_failed_launch(tp, emulator):
    assert tp("create", "nosetup", "-t", "v4-16").code == 0
    r = tp("train", "job.py", "0", "0", "--runtime", "cpu", "--launch", "host", "--setup", "exit 7", "--down")
    assert r.code == 1 and "setup failed" in r.err and "deleted nosetup (--down)" in r.err, r.err
    assert not _exists(emulator, "nosetup")
    assert tp("create", "nossh", "-t", "v4-16").code == 0
    emulator.kill_sshd(emulator.node_name("nossh"), 1)  # worker 1 unreachable: the sync cannot start
    tp.env.update(TPURUN_SSH_RETRIES="1", TPURUN_SSH_RETRY_DELAY="0.1")
    r = tp("train", "job.py", "0", "0", "--runtime", "cpu", "--launch", "host", "--down")
    assert r.code == 4 and "deleted nossh (--down)" in r.err, r.err
    assert not _exists(emulator, "nossh")
    _nothing_left(emulator)


def test_train_down_detached_is_deleted_by_the_watchdog_when_the_job_ends(tp, emulator):
    assert tp("create", "later", "-t", "v4-16").code == 0
    before = len(emulator.requests())
    # it runs until released, so describe and list see it run however loaded the machine
    r = tp("train", "until.py", "--runtime", "cpu", "--launch", "host", "--down", "--detach")
    assert r.code == 0, r.err
    assert "later will be deleted when job" in r.err
    job = r.out.strip()
    deadline = time.monotonic() + 60
    while (d := _describe(tp, "later"))["jobs"] != [job]:  # once its watchdog has seen the job
        assert time.monotonic() < deadline, d
        time.sleep(0.2)
    assert d["down"] == [job] and 0 <= d["reportedSecondsAgo"] < 5, d  # the pending --down is its autostop
    listed = " ".join(tp("list").out.split())
    assert f"delete when {job} ends (--down)" in listed and "busy (" in listed and "s ago)" in listed, listed
    assert tp("exec", "--", "sh", "-c", "touch ~/release").code == 0
    _gone_within(emulator, "later", 40)
    _deleted_by_vm(emulator, before, "/nodes/later")
    _nothing_left(emulator)


def test_train_down_when_tpurun_is_killed_mid_job(tp, emulator):
    """The client dies (kill -9): its job stops on every worker, and the watchdog deletes the TPU."""
    assert tp("create", "orphan", "-t", "v4-16").code == 0
    proc = popen(tp, "train", "job.py", "60", "0", "--runtime", "cpu", "--launch", "host", "--down")
    read_until(proc, lambda lines: sum("job running" in line for line in lines) == 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    _gone_within(emulator, "orphan", 60)
    _nothing_left(emulator)


def test_train_down_on_a_multislice_tpu_deletes_its_queued_resource(tp, emulator):
    assert tp("create", "pair", "-t", "v4-16", "--slices", "2").code == 0
    r = tp("train", "job.py", "1", "0", "--runtime", "cpu", "--launch", "host", "--down", "--detach")
    assert r.code == 0, r.err
    deadline = time.monotonic() + 60
    while list(emulator.client().list_queued_resources(parent=emulator.parent)) or _exists(emulator, "pair-0"):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    _nothing_left(emulator)


def test_bad_autostop_input_is_one_line_and_changes_nothing(tp, emulator):
    assert tp("create", "keep", "-t", "v4-16").code == 0
    before = len(emulator.requests())
    for args in (
        ("create", "x", "-t", "v4-8", "--autostop", "0"),
        ("create", "x", "-t", "v4-8", "--autostop", "5x"),
        ("create", "x", "-t", "v4-8", "--autostop", "30"),
        ("create", "x", "-t", "v4-16", "--autostop", "1h", "--autostop-action", "stop"),
        ("autostop", "keep", "0"),
        ("autostop", "keep", "soon"),
        ("autostop", "keep", "1h", "--action", "stop"),
        ("train", "job.py", "--local", "--down"),
    ):
        r = tp(*args)
        assert_clean_error(r, 2)
    assert_clean_error(tp("autostop", "nosuch", "30m"), 3)  # a missing TPU: exit 3, as for every command
    mutations = [c for c in calls_since(emulator, before) if c["method"] != "GET" and ":getGuestAttributes" not in c["path"]]
    assert mutations == []
    assert tp("delete", "keep", "--yes").code == 0
    _nothing_left(emulator)
