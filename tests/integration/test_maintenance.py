"""Maintenance and preemption on emulated pods of both APIs, through the real CLI: a notice reaches every process
of the job before the host goes (JAX's own preemption sync on CPU agrees on the step to save at; a torch-style
job reads the notice file), the job checkpoints and is relaunched once the host is back, its end classified and
its budget counted; each kind of end (program, preempted, infra) spends its own budget; `list`, `describe` and
`tpurun maintenance` show the window, and `maintenance --now` is refused while a job runs."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from tests.helpers import create_node, finish, popen, read_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# JAX's preemption sync, unmodified: a notice (SIGTERM, the default --on-notice for JAX) reaches one host and its
# coordination service has every host agree on one step to save at. The checkpoint is each host's own file;
# a relaunched attempt resumes from it.
JAX_SYNC = """\
import os, time
import jax
from jax.experimental import multihost_utils

w = os.environ["TPURUN_WORKER_ID"]
ckpt = os.path.expanduser("~/ckpt")
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
n, why = os.environ["TPURUN_RESTART_COUNT"], os.environ["TPURUN_RESTART_REASON"]
jax.distributed.initialize()
print(f"start w{w} restart {n} reason {why or '-'} from {start}", flush=True)
for step in range(start, start + (3 if n != "0" else 100000)):
    if multihost_utils.reached_preemption_sync_point(step):
        open(ckpt, "w").write(str(step))
        print(f"SYNC w{w} saved at step {step}", flush=True)
        raise SystemExit(0)
    print(f"step {step} w{w}", flush=True)
    time.sleep(0.1)
print(f"done w{w}", flush=True)
"""

# A script that reads `--on-notice file`: it saves its step as soon as the notice is there, and exits non-zero
# (it did not finish: exit 0 would say it had).
FILE_NOTICE = """\
import json, os, time

w = os.environ["TPURUN_WORKER_ID"]
ckpt = os.path.expanduser("~/ckpt")
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
n, why = os.environ["TPURUN_RESTART_COUNT"], os.environ["TPURUN_RESTART_REASON"]
print(f"start w{w} restart {n} reason {why or '-'} from {start}", flush=True)
for step in range(start, start + (3 if n != "0" else 100000)):
    if os.path.exists(os.environ["TPURUN_NOTICE_FILE"]):
        notice = json.load(open(os.environ["TPURUN_NOTICE_FILE"]))
        time.sleep(2.0 if w == "0" else 0.0)  # w0's save takes longer: w1's end must not cut it short
        open(ckpt, "w").write(str(step))
        print(f"NOTICE w{w} {notice['kind']} for w{notice['worker']}: saved at step {step}", flush=True)
        raise SystemExit(75)
    print(f"step {step} w{w}", flush=True)
    time.sleep(0.1)
print(f"done w{w}", flush=True)
"""

# Fails on its first attempt; on the next runs until it is stopped from outside.
EVERY_END = """\
import os, sys, time

n, why = os.environ["TPURUN_RESTART_COUNT"], os.environ["TPURUN_RESTART_REASON"]
print(f"attempt {n} after {why or '-'} w{os.environ['TPURUN_WORKER_ID']}", flush=True)
if n == "0":
    sys.exit(3)
while True:
    time.sleep(0.1)
"""


# Three processes on each worker, each counting its SIGUSR1 handler's runs: the host process, a child of its in its
# process group, and a child that left the group (setsid). A notice must reach each of them once.
COUNT_USR1 = """\
import os, signal, time

w = os.environ["TPURUN_WORKER_ID"]
role = "host"
if os.fork() == 0:
    role = "child"
elif os.fork() == 0:
    os.setsid()
    role = "setsid"
runs = 0


def on_usr1(signum, frame):
    global runs
    runs += 1
    print(f"USR1 w{w} {role} run {runs}", flush=True)


def on_term(signum, frame):  # the job's stop: after every SIGUSR1 sent before (lower signals are handled first)
    print(f"stopped w{w} {role} after {runs} run(s)", flush=True)
    os._exit(0)


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGTERM, on_term)
print(f"ready w{w} {role}", flush=True)
while True:
    time.sleep(0.1)
"""


def _saved(lines: list[str], word: str) -> dict[str, int]:
    """{worker: the step it saved at} from the lines `SYNC w0 saved at step 12` (WORD: SYNC or NOTICE)."""
    found = {}
    for line in lines:
        m = re.search(rf"{word} (w\d+).* saved at step (\d+)", line)
        if m:
            found[m.group(1)] = int(m.group(2))
    return found


def _events(emulator, what: str) -> list[tuple[str, str]]:
    return [(e["time"], e["detail"]) for e in emulator.admin.requests() if e["method"] == "EVENT" and e["path"] == what]


def test_maintenance_notice_jax_sync_checkpoint_and_restart(cli, emulator):
    """A v4-16 through the Cloud TPU API; maintenance announced for worker 1: each host's process gets SIGTERM
    before the host goes, JAX's preemption sync has both hosts save at the same step; the job ends as
    maintenance, waits for the host to come back and is relaunched from the checkpoint, once (`--restarts
    maintenance=1`). `list`, `describe` and `maintenance` show a window announced an hour ahead (one seconds
    ahead could begin, on a loaded machine, before three CLIs had run)."""
    cli.env["TPURUN_PREEMPT_CHECK"] = "3"
    create_node(cli, "mnt", "v4-16")
    (cli.cwd / "sync.py").write_text(JAX_SYNC)
    proc = popen(
        cli, "--plain", "train", "sync.py", "--runtime", "cpu", "--launch", "host", "--restarts", "maintenance=1"
    )  # fmt: skip
    lines = read_until(proc, lambda ls: all(any(f"step 3 w{w}" in x for x in ls) for w in (0, 1)), timeout=240)
    emulator.admin.maintenance(emulator.node_name("mnt"), 1, notice=6, duration=10)
    out, err = finish(proc, timeout=300)
    lines += out.splitlines()
    assert proc.returncode == 0, err[-3000:]
    # every host got the notice and both saved at the step JAX's sync chose, before worker 1's host went down
    saved = _saved(lines, "SYNC")
    assert set(saved) == {"w0", "w1"} and len(set(saved.values())) == 1, lines[-40:]
    assert "maintenance announced for w1" in err and "SIGTERM to every process" in err, err
    down = [t for t, d in _events(emulator, "maintenance") if d.endswith("worker 1: down")]
    assert down, _events(emulator, "maintenance")
    assert "maintenance of a host of mnt cut job" in err
    assert "restart 1/1: waiting for mnt to be usable again (the maintenance budget" in err, err
    # the relaunched attempt resumed where the hosts saved, told why it restarted
    step = saved["w0"]
    for w in ("w0", "w1"):
        assert any(f"start {w} restart 1 reason maintenance from {step}" in x for x in lines), lines[-20:]
        assert any(f"done {w}" in x for x in lines)
    jobs = json.loads(cli("jobs", "--json").out)
    first = next(j for j in jobs if j["restart"] == 0)
    assert first["end"] == "maintenance" and first["notice"]["worker"] == 1, first
    assert next(j for j in jobs if j["restart"] == 1)["restartReason"] == "maintenance"
    # nothing pending: nothing to start; a window an hour away, no job running: started now (v2alpha1)
    nothing = cli("maintenance", "mnt", "--now")
    assert nothing.code == 2 and "no maintenance is announced" in nothing.err, nothing.err
    emulator.admin.maintenance(emulator.node_name("mnt"), 0, notice=3600, duration=1)
    listed = json.loads(cli("list", "--json").out)
    (window,) = next(v for v in listed if v["name"] == "mnt")["maintenance"]
    assert window["type"] == "UNSCHEDULED" and window["status"] == "PENDING", window
    described = cli("describe", "mnt")
    assert "UNSCHEDULED maintenance" in described.out and "cannot be rescheduled" in described.out, described.out
    shown = cli("maintenance", "mnt")
    assert shown.code == 0 and "UNSCHEDULED maintenance" in shown.out, shown.err
    started = cli("maintenance", "mnt", "--now")
    assert started.code == 0 and "maintenance started on mnt" in started.err, started.err
    deadline = time.time() + 30
    while not any(d.endswith("worker 0: down") for _, d in _events(emulator, "maintenance")):
        assert time.time() < deadline, _events(emulator, "maintenance")
        time.sleep(0.1)


def test_each_end_is_classified_and_spends_its_own_budget(cli, emulator):
    """A spot v4-16: a program failure (restarted: program=1), a preemption announced in the workers' metadata
    first (the job told, the TPU recreated: preempted=1), then a killed worker with no budget left for it: the
    job ends lost (the infra budget's), exit 75, and says which budget ran out."""
    cli.env["TPURUN_PREEMPT_CHECK"] = "3"
    create_node(cli, "ends", "v4-16", "--spot")
    (cli.cwd / "ends.py").write_text(EVERY_END)
    proc = popen(
        cli, "--plain", "train", "ends.py", "--runtime", "cpu", "--launch", "host",
        "--restarts", "program=1,preempted=1", "--on-notice", "file",
    )  # fmt: skip
    lines = read_until(proc, lambda ls: sum("attempt 1 after program" in x for x in ls) == 2, timeout=240)
    emulator.admin.preempt(emulator.node_name("ends"), notice=2)
    lines += read_until(proc, lambda ls: sum("attempt 2 after preempted" in x for x in ls) == 2, timeout=300)
    emulator.kill_worker(emulator.node_name("ends"), 1)
    out, err = finish(proc, timeout=240)
    assert proc.returncode == 75, err[-3000:]
    assert "restart 1/1: relaunching (the program budget" in err
    assert "preempted announced for" in err and "ends was preempted while job" in err
    assert "restart 1/1: recreating ends (the preempted budget" in err, err
    assert "ended (lost)" in err and "--max-restarts N (or --restarts infra=N)" in err, err
    ends = {j["restart"]: (j["status"], j["end"]) for j in json.loads(cli("jobs", "--json").out)}
    assert ends == {0: ("failed", "failed"), 1: ("preempted", "preempted"), 2: ("lost", "lost")}, ends


@pytest.fixture
def clean(emulator):
    """What the test leaves in Compute Engine goes when it ends (the CLI fixture deletes Cloud TPU nodes only)."""
    yield
    emulator.emu.compute_teardown()


def test_compute_engine_notice_file_and_maintenance_now(cli, emulator, clean):
    """A TPU7x slice of 2 VMs through Compute Engine. A detached job runs: `maintenance --now` is refused (it
    names the job) until it is cancelled, and `describe` shows the window. Then a job reading `--on-notice
    file` saves and ends when the maintenance is announced for VM 1, and is relaunched from its checkpoint
    after the host is back."""
    cli.env["TPURUN_PREEMPT_CHECK"] = "3"
    assert cli("create", "iron", "-t", "tpu7x-16").code == 0
    (cli.cwd / "notice.py").write_text(FILE_NOTICE)
    emulator.admin.maintenance("iron", 1, notice=3600, duration=2)  # past the last minutes a job is told in
    described = json.loads(cli("describe", "iron", "--json").out)
    (window,) = described["maintenance"]
    assert window["status"] == "PENDING" and window["on"].startswith("iron-"), window
    r = cli("train", "notice.py", "--runtime", "cpu", "--launch", "host", "--detach", "--on-notice", "file")
    assert r.code == 0, r.err
    job = r.out.strip()
    assert "iron: iron-" in r.err and "UNSCHEDULED maintenance in" in r.err, r.err  # train says so at its start
    refused = cli("maintenance", "iron", "--now")
    assert refused.code == 2 and job in refused.err and "Traceback" not in refused.err, refused.err
    started = cli("maintenance", "iron", "--now", "--force", "--json")  # stdout: its JSON alone
    assert started.code == 0, started.err
    said = json.loads(started.out)
    assert said["jobsStopped"] == [job] and said["started"][0].startswith("iron-"), said
    deadline = time.time() + 60
    while time.time() < deadline:
        d = json.loads(cli("describe", "iron", "--json").out)
        if not d["maintenance"] and d["state"] == "READY":  # the window over, the slice booted again
            break
        time.sleep(0.5)
    assert (d["maintenance"], d["state"]) == ([], "READY"), d
    assert cli("cancel", job).code == 0  # whatever the hosts' going left of it

    proc = popen(cli, "--plain", "train", "notice.py", "--runtime", "cpu", "--launch", "host",
                 "--restarts", "maintenance=1", "--on-notice", "file")  # fmt: skip
    lines = read_until(proc, lambda ls: all(any(f"step 3 w{w}" in x for x in ls) for w in (0, 1)), timeout=240)
    emulator.admin.maintenance("iron", 1, notice=8, duration=2)  # w1 is told first, w0 through it, and saves last
    out, err = finish(proc, timeout=300)
    lines += out.splitlines()
    assert proc.returncode == 0, err[-3000:]
    saved = _saved(lines, "NOTICE")
    assert set(saved) == {"w0", "w1"}, "\n".join(lines[-40:]) + "\n--- stderr:\n" + err[-3000:]
    # both heard of the one VM's maintenance (the group's VM 1, which tpurun names by its place in name order)
    told = {m.group(1) for x in lines for m in [re.search(r"NOTICE w\d maintenance for (w\d)", x)] if m}
    assert len(told) == 1, lines[-30:]
    for w in ("w0", "w1"):
        assert any(f"start {w} restart 1 reason maintenance from {saved[w]}" in x for x in lines), lines[-20:]
    assert "restart 1/1: waiting for iron to be usable again" in err
    assert re.search(r"w1 ended after the notice \(exit code 75\): the others may end on their own within \d+ s", err), err


def test_a_preemption_notice_signals_each_process_once(cli, emulator):
    """A spot v4-16 and `--on-notice signal:SIGUSR1`: on every worker the host process, a child in its group and
    a child that left it (setsid) each run their handler exactly once (each process was signalled through its
    group and again by its pid before), as each says when the job is then stopped. The notice's deadline is the
    metadata's, which gives none for a preemption (`instance/preempted` is TRUE, and that is all)."""
    create_node(cli, "once", "v4-16", "--spot")
    (cli.cwd / "count.py").write_text(COUNT_USR1)
    proc = popen(cli, "--plain", "train", "count.py", "--runtime", "cpu", "--launch", "host",
                 "--on-notice", "signal:SIGUSR1")  # fmt: skip
    roles = [(w, r) for w in (0, 1) for r in ("host", "child", "setsid")]
    lines = read_until(proc, lambda ls: all(any(f"ready w{w} {r}" in x for x in ls) for w, r in roles), timeout=240)
    emulator.admin.preempt(emulator.node_name("once"), notice=3600)  # told now; the host stays for the test
    lines += read_until(proc, lambda ls: all(any(f"USR1 w{w} {r}" in x for x in ls) for w, r in roles), timeout=60)
    proc.send_signal(signal.SIGINT)  # the job stopped: each process says how often its handler ran
    out, err = finish(proc, timeout=120)
    lines += out.splitlines()
    # (the three processes of a worker share its stdout: their lines may run into each other)
    stopped = set(re.findall(r"stopped w(\d) (\w+) after (\d+) run", "\n".join(lines)))
    assert stopped == {(str(w), r, "1") for w, r in roles}, (sorted(stopped), lines[-20:], err[-2000:])
    assert "preempted announced for" in err and "SIGUSR1 to every process" in err, err
    (job,) = json.loads(cli("jobs", "--json").out)
    assert job["notice"]["kind"] == "preempted" and job["notice"]["deadline"] is None, job["notice"]
    assert job["notice"]["detail"] == "instance/preempted: TRUE", job["notice"]
