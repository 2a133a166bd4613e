"""Commands through relays inside the slice, against the same commands straight from this machine, on an
emulated pod whose relay tree is three levels deep (one root, fan-out 2): the same output, exit codes and files;
fail-fast, Ctrl-C and a relay killed mid-command leave nothing on any worker; a worker its relay cannot reach
and a host key that does not match inside the slice are reported as such, and the workers below a relay that
cannot be reached are reached another way; no key of tpurun's is left on a worker."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.helpers import create_node, delete_every_tpu, job_pids, popen, read_until
from tests.integration.conftest import Cli
from tpurun.worker import bundle_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

DEEP = {"TPURUN_RELAY_ROOTS": "1", "TPURUN_RELAY_FANOUT": "2"}  # 8 workers: w0 -> w1, w5 -> ... three levels
WORKERS = 8
BIN = f"bin/{bundle_name()}"  # the worker bundle
RELAY = f"{BIN}/relay.py"  # a relay's own process (not the ssh that started it)


@pytest.fixture(scope="module")
def _shared(emulator, tmp_path_factory) -> Iterator[Cli]:
    """The pod every test of the file shares, made once (what a test changes on it it puts back, and no test
    but the one with a pod of its own takes a worker down), and the HOME that made it."""
    made = Cli.under(tmp_path_factory.mktemp("relays"), emulator)
    try:
        create_node(made, "relayed", "v4-64")
        yield made
    finally:
        emulator.restore()
        delete_every_tpu(emulator)


@pytest.fixture
def cli(_shared, emulator, tmp_path) -> Iterator[Cli]:
    """The shared pod's HOME (its key and pinned host keys), with a project directory and variables of the
    test's own (the conftest's fixture of that name would delete the shared pod after each test). The project
    directory starts as `create` left the shared one: its tpurun.toml names the pod the default TPU."""
    shutil.copytree(_shared.cwd, tmp_path / "project")
    try:
        yield replace(_shared, cwd=tmp_path / "project", env=dict(_shared.env))
    finally:
        emulator.restore()


@pytest.fixture
def pod(cli):
    cli.env.update(DEEP)
    return "relayed"


def _both(cli, *args: str):
    """ARGS through relays and straight: both results."""
    return cli(*args[:1], "--relay", *args[1:]), cli(*args[:1], "--no-relay", *args[1:])


def _sorted_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith("[w"))


def _nothing_left(emulator, pod: str, needle: str) -> None:
    deadline = time.monotonic() + 15
    while job_pids(emulator, pod, needle):
        assert time.monotonic() < deadline, (needle, job_pids(emulator, pod, needle))
        time.sleep(0.2)


def test_exec_through_relays_is_exec(cli, emulator, pod):
    script = 'n=$(hostname); echo "out ${n##*-} $1"; echo "err ${n##*-}" >&2; exit $(( ${n##*-} % 3 ))'
    odd = "two  spaces 'quote' \"dq\" $HOME ; `x` é\nline"
    relayed, direct = _both(cli, "exec", "--", "sh", "-c", script, "sh", odd)
    assert relayed.code == direct.code == 1, relayed.err
    assert _sorted_lines(relayed.out) == _sorted_lines(direct.out)
    assert len(_sorted_lines(relayed.out)) == WORKERS * 2  # each argument arrived whole, newline and all
    assert _sorted_lines(relayed.err) == _sorted_lines(direct.err)
    said = [line for line in relayed.err.splitlines() if line.startswith("error:")]
    assert said == [line for line in direct.err.splitlines() if line.startswith("error:")], relayed.err
    # what the command left behind writes after its exit status came (sshd may send that status first): read to
    # the output's end both ways, for a second at most
    left = 'f=$(mktemp); setsid sh -c "echo up > \\$0; sleep 0.3; echo late >&2" "$f" & '
    left += 'while [ ! -s "$f" ]; do sleep 0.01; done; rm "$f"'  # it has a session of its own: not swept with the group
    relayed, direct = _both(cli, "exec", "--", "sh", "-c", left)
    assert relayed.code == direct.code == 0, direct.err
    assert _sorted_lines(relayed.err) == _sorted_lines(direct.err) == [f"[w{w}] late" for w in range(WORKERS)]
    missing = _both(cli, "exec", "--worker", "2-3", "--", "nosuchcommand")
    assert missing[0].code == missing[1].code == 1
    assert _sorted_lines(missing[0].err) == _sorted_lines(missing[1].err)
    # what the relays used is gone with them: no process, no key, no directory of theirs on any worker
    _nothing_left(emulator, pod, RELAY)
    _nothing_left(emulator, pod, "ssh-agent")
    r = cli("exec", "--no-relay", "--", "sh", "-c", "ls -d /tmp/tpurun-relay-* 2>/dev/null; true")
    assert r.code == 0 and r.out.strip() == "", r.out


def test_workers_without_the_bundle_get_it_and_run_the_command_once(cli, emulator, pod):
    # the root's relay is started again once this machine installed the bundle there (its plan and the command
    # said again behind it), the others' from their parent relay's copy (their plan again behind it)
    gone = cli("exec", "--no-relay", "--", "sh", "-c", f'rm -rf "$HOME/.tpurun/{BIN}"')
    assert gone.code == 0, gone.err
    r = cli("exec", "--relay", "--", "sh", "-c", "echo once >> /tmp/relay-once; cat /tmp/relay-once")
    assert r.code == 0, r.err
    assert sorted(r.out.splitlines()) == [f"[w{w}] once" for w in range(WORKERS)], r.out
    back = cli("exec", "--no-relay", "--", "sh", "-c", f'rm /tmp/relay-once; test -f "$HOME/.tpurun/{RELAY}"')
    assert back.code == 0, back.err


def test_fail_fast_and_ctrl_c_leave_nothing(cli, emulator, pod):
    t0 = time.monotonic()
    r = cli("exec", "--relay", "--fail-fast", "--", "sh", "-c",
            'case "$(hostname)" in *-w-6) sleep 0.5; exit 4;; esac; sleep 300')  # fmt: skip
    assert r.code == 1 and time.monotonic() - t0 < 60, r.err
    assert "w6" in r.err
    _nothing_left(emulator, pod, "sleep 300")
    proc = popen(cli, "exec", "--relay", "--", "sh", "-c", "echo started; sleep 1000")
    read_until(proc, lambda seen: sum(line.endswith("] started") for line in seen) == WORKERS, timeout=60)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    _nothing_left(emulator, pod, "sleep 1000")
    _nothing_left(emulator, pod, RELAY)


def _relay_pid(emulator, pod, worker: int) -> int:
    """The relay on WORKER: not its zygote, nor an agent that forked (they share its command line; their names
    are tpurun's)."""
    (pid,) = [p for p in job_pids(emulator, pod, RELAY, [worker]) if not _name(p).startswith("tpurun-")]
    return pid


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _lost_with_w5(err: str, why: str) -> None:
    """ERR says WHY w5's relay was lost, and the workers it took along, once; their rows say unreachable."""
    (said,) = [line for line in err.splitlines() if why in line]
    assert said.startswith(f"error: {why}") and said.endswith("; w[5-7] unreachable through it"), err
    rows = {line.split()[0]: line.split()[1] for line in err.splitlines() if re.match(r"^w\d ", line)}
    assert [rows[f"w{w}"] for w in range(5, 8)] == ["unreachable"] * 3, err


def test_a_relay_killed_mid_command_loses_its_subtree_and_leaves_nothing(cli, emulator, pod):
    proc = popen(cli, "exec", "--relay", "--", "sh", "-c", "echo started; sleep 12; echo slept")
    read_until(proc, lambda seen: sum(line.endswith("] started") for line in seen) == WORKERS, timeout=60)
    pid = _relay_pid(emulator, pod, 5)  # w5 relays for w6 and w7
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err  # the others went on to their end
    assert sorted(line.split()[0] for line in out.splitlines() if line.endswith("slept")) == [
        f"[w{w}]" for w in range(5)
    ]
    _lost_with_w5(err, "relay w5 went away")
    _nothing_left(emulator, pod, "sleep 12")  # the lost ones' commands went with their relay
    r = cli("exec", "--relay", "--", "true")  # and the next command reaches them again
    assert r.code == 0, r.err


def test_a_hung_relay_is_given_up_and_the_workers_below_it_stop(cli, emulator, pod):
    cli.env["TPURUN_RELAY_TIMEOUT"] = "3"  # given up after 3 s; the workers below it end after 12 s
    proc = popen(cli, "exec", "--relay", "--", "sh", "-c", "echo started; sleep 20; echo slept")
    read_until(proc, lambda seen: sum(line.endswith("] started") for line in seen) == WORKERS, timeout=60)
    pid = _relay_pid(emulator, pod, 5)  # w5 relays for w6 and w7
    os.kill(pid, signal.SIGSTOP)  # hung: alive, silent, its links open
    try:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 4, err
        _lost_with_w5(err, "relay w5 stopped answering for 3 s")
        deadline = time.monotonic() + 30
        while job_pids(emulator, pod, "sleep 20", [6, 7]):  # below it: their relays heard no parent, and ended
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    _nothing_left(emulator, pod, "sleep 20")
    _nothing_left(emulator, pod, RELAY)


@pytest.fixture
def broken(_shared, emulator, tmp_path) -> Iterator[Cli]:
    """A pod of its own and a HOME of its own, for the test that takes workers down and replaces a pinned key."""
    cli = Cli.under(tmp_path, emulator)
    cli.env.update(DEEP, TPURUN_TPU="broken")
    create_node(cli, "broken", "v4-64")
    try:
        yield cli
    finally:
        emulator.restore()
        assert cli("delete", "broken", "--yes").code == 0


def test_a_worker_its_relay_cannot_reach_and_a_key_that_does_not_match(broken, emulator):
    cli, pod = broken, "broken"
    name = emulator.node_name(pod)
    addresses = [w["address"] for w in emulator.node_info(name)["workers"]]
    # w3's pinned key replaced by another worker's: the relay that reaches w3 must refuse it
    alias3, alias4 = cli.host_key_alias(addresses[3]), cli.host_key_alias(addresses[4])
    original = cli.known_hosts.read_text()
    lines = original.splitlines()
    key4 = next(line.split(None, 1)[1] for line in lines if line.startswith(alias4 + " "))
    cli.known_hosts.write_text(
        "\n".join(f"{alias3} {key4}" if line.startswith(alias3 + " ") else line for line in lines) + "\n"
    )
    r = cli("exec", "--relay", "--worker", "1-4", "--", "true")
    assert r.code == 4, r.err
    assert "HOST KEY CHANGED for worker w3" in r.err and "relay w2 refused it" in r.err, r.err
    assert "w1" not in r.err.split("HOST KEY CHANGED")[0].split("error:")[-1], r.err
    # a worker down: its relay says it cannot reach it, the others run (the command went down behind the plan: a
    # worker the tree did not reach is unreachable, not a failure that fail-fast stops the others for)
    emulator.kill_worker(name, 6)
    r = cli("exec", "--relay", "--fail-fast", "--worker", "5-7", "--", "sh", "-c", "sleep 1; echo here")
    assert r.code == 4, r.err
    assert sorted(r.out.split()) == sorted(["[w5]", "here", "[w7]", "here"]), r.out
    assert "cannot reach worker w6" in r.err and "from relay w5" in r.err, r.err
    # a relay down (w5, which w0 reaches and which relays for w6 and w7): the workers below it are planned anew
    # under w0, headed by w6; w6 being down too, by w7 alone
    cli.known_hosts.write_text(original)
    emulator.kill_worker(name, 5)
    r = cli("exec", "--relay", "--", "echo", "here")
    assert r.code == 4, r.err
    assert sorted(line.split()[0] for line in r.out.splitlines()) == [f"[w{w}]" for w in (0, 1, 2, 3, 4, 7)], r.out
    assert re.search(r"cannot reach worker w[56] .*from relay w0", r.err) and "w5" in r.err and "w6" in r.err, r.err


TRAIN = """import os, sys, time
w = int(os.environ["TPURUN_WORKER_ID"])
for i in range(3):
    print("line", i, "of worker", w, flush=True)
print("to stderr", w, file=sys.stderr)
if os.environ.get("LOOP"):
    while True:
        print("tick", w, flush=True)
        time.sleep(0.5)
if w == 6:
    time.sleep(2)  # the others' lines all said before fail-fast stops them
sys.exit(3 if w == 6 else 0)
"""


def test_train_and_the_job_commands_through_relays(cli, emulator, pod):
    (cli.cwd / "t.py").write_text(TRAIN)
    relayed, direct = _both(cli, "train", "t.py", "--runtime", "cpu", "--launch", "host")
    assert relayed.code == direct.code == 1, relayed.err
    assert _sorted_lines(relayed.out) == _sorted_lines(direct.out) and len(_sorted_lines(relayed.out)) == WORKERS * 4
    assert [line for line in relayed.err.splitlines() if line.startswith("error:")] == [
        line for line in direct.err.splitlines() if line.startswith("error:")
    ], relayed.err
    # a detached job: logs, jobs, stacks and cancel through the relays
    r = cli("train", "--relay", "t.py", "--runtime", "cpu", "--launch", "host", "--env", "LOOP=1", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    deadline = time.monotonic() + 60
    while len({line.split()[0] for line in cli("logs", "--relay", job).out.splitlines() if " tick " in line}) < WORKERS:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    (row,) = [j for j in json.loads(cli("jobs", "--relay", "--json").out) if j["job_id"] == job]
    assert row["status"] == "running"
    r = cli("stacks", "--relay", job)
    assert r.code == 0 and "t.py" in r.out, r.err
    r = cli("cancel", "--relay", job)
    assert r.code == 0 and f"job {job} stopped on {WORKERS} worker(s)" in r.err, r.err
    _nothing_left(emulator, pod, "t.py")
    for command in (["kill-stale"], ["doctor"]):
        relayed, direct = _both(cli, *command)
        assert relayed.code == direct.code == 0, relayed.err
    # Ctrl-C on an attached job: every process of it, and every relay, gone before tpurun exits
    proc = popen(cli, "train", "--relay", "t.py", "--runtime", "cpu", "--launch", "host", "--env", "LOOP=1")
    read_until(proc, lambda seen: len({line.split()[0] for line in seen if " tick " in line}) == WORKERS, timeout=90)
    # each relay streams its worker's job itself: the agent that held, claimed and started it has ended
    names = [_name(p) for p in job_pids(emulator, pod, RELAY)]
    assert names.count("tpurun-job") == WORKERS and "tpurun-agent" not in names, names  # (supervisors: forked)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=90)
    assert proc.returncode == 130
    assert job_pids(emulator, pod, "t.py") == []
    _nothing_left(emulator, pod, RELAY)


COUNT = """import os, time
w = int(os.environ["TPURUN_WORKER_ID"])
for i in range(40):
    print("count", i, "of worker", w, flush=True)
    time.sleep(0.25)
"""


def test_logs_follow_reaches_the_workers_of_a_lost_relay_through_a_tree_of_their_own(cli, emulator, pod):
    """`logs --follow` reconnects a dropped stream: a relay killed under it takes the workers below it, for whom
    a tree of their own is planted, and they are followed on from where their lines stopped. Every line arrives
    once, in order."""
    (cli.cwd / "count.py").write_text(COUNT)
    r = cli("train", "--relay", "count.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    proc = popen(cli, "logs", "--relay", job, "--follow")
    seen = read_until(proc, lambda got: len({line.split()[0] for line in got if " count " in line}) == WORKERS)
    pid = _relay_pid(emulator, pod, 5)  # the follow's relay on w5, which relays for w6 and w7
    os.kill(pid, signal.SIGKILL)
    out = proc.stdout.read()  # what readline buffered too (communicate would read past it)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    lines = [*seen, *out.splitlines()]
    for w in range(WORKERS):
        said = [line.split(" count ", 1)[1] for line in lines if line.startswith(f"[w{w}]") and " count " in line]
        assert said == [f"{i} of worker {w}" for i in range(40)], (w, said, err)


def test_sync_through_relays_is_sync(cli, emulator, pod):
    tree = cli.cwd / "tree"
    (tree / "sub").mkdir(parents=True)
    for i in range(20):
        (tree / "sub" / f"f{i}.bin").write_bytes(os.urandom(1000 * i))
    (tree / "big.bin").write_bytes(os.urandom(3 << 20))
    r = cli("sync", "--relay", str(tree), "--tpu", pod, "--json")
    assert r.code == 0, r.err
    sent = json.loads(r.out)
    assert len(sent["workers"]) == WORKERS and all(w["files_sent"] == 21 for w in sent["workers"]), r.out
    digest = "find tree -type f -name '*.bin' | sort | xargs sha256sum | sha256sum"
    local = subprocess.run(["sh", "-c", digest], cwd=cli.cwd, capture_output=True, text=True).stdout.split()[0]
    r = cli("exec", "--no-relay", "--", "sh", "-c", f"cd ~ && {digest}")
    assert sorted(line.split()[1] for line in r.out.splitlines()) == [local] * WORKERS, r.out
    # one file changed on one worker, one removed locally: each worker gets what it needs, deletions too
    cli("exec", "--no-relay", "--worker", "3", "--", "sh", "-c", "echo x > ~/tree/sub/f1.bin")
    (tree / "sub" / "f2.bin").unlink()
    relayed, direct = _both(cli, "sync", str(tree), "--tpu", pod, "--delete", "--json")
    assert relayed.code == direct.code == 0, relayed.err
    by = {w["worker"]: w for w in json.loads(relayed.out)["workers"]}
    assert by[3]["files_sent"] == 1 and all(by[w]["files_sent"] == 0 for w in by if w != 3), relayed.out
    assert all(w["deleted"] == 1 for w in by.values()), relayed.out
    assert all(w["deleted"] == 0 and w["files_sent"] == 0 for w in json.loads(direct.out)["workers"]), direct.out
    # and back: a download through relays brings what a straight one does (a file bigger than what a relayed
    # pipe holds unread among them)
    cli("exec", "--no-relay", "--worker", "6", "--", "sh", "-c", "head -c 12000000 /dev/urandom > ~/tree/huge.bin")
    relayed, direct = cli("download", "--relay", "tree", "relayed"), cli("download", "--no-relay", "tree", "direct")
    assert relayed.code == direct.code == 0, relayed.err
    for w in range(WORKERS):
        here = [
            sorted(p.relative_to(cli.cwd / d / f"w{w}") for p in (cli.cwd / d / f"w{w}").rglob("*"))
            for d in ("relayed", "direct")
        ]
        assert here[0] == here[1] and len(here[0]) > 20, (w, here)
        assert any(p.name == "huge.bin" for p in here[0]) == (w == 6), (w, here)
        for rel in here[0]:
            a, b = cli.cwd / "relayed" / f"w{w}" / rel, cli.cwd / "direct" / f"w{w}" / rel
            assert a.is_dir() or a.read_bytes() == b.read_bytes(), (w, rel)


def test_ssh_through_a_relay_reaches_a_worker_this_machine_cannot(cli, emulator, pod):
    name = emulator.node_name(pod)
    addresses = [w["address"] for w in emulator.node_info(name)["workers"]]
    cli.env["TPURUN_ADDRESS_MAP"] = json.dumps({addresses[5]: "127.0.0.1:9"})  # nothing listens there
    r = cli("ssh", "--worker", "5", "--", "hostname")
    assert r.code != 0  # straight: refused
    r = cli("ssh", "--relay", "--worker", "5", "--", "sh", "-c", 'echo "$(hostname) $1"', "sh", "a  b")
    assert r.code == 0, r.err
    assert r.out.strip().endswith("-w-5 a  b"), r.out


ROOTED = {"TPURUN_RELAY_ROOTS": "2", "TPURUN_RELAY_FANOUT": "32"}  # w0 reaches w1-w3, w4 (a root) w5-w7
SUBTREE = re.compile(r"^error: relay w4 went away.*; w\[4-7\] unreachable through it$")


def test_a_lost_root_relay_is_named_once_with_its_workers(cli, emulator, pod):
    """A root's relay (one this machine reaches itself) killed under a job, an exec and a follow: the error names
    the relay and the workers it took once, and no row says they run; `logs --follow` goes on without them."""
    cli.env.update(ROOTED)
    (cli.cwd / "t.py").write_text(TRAIN)
    proc = popen(cli, "train", "--relay", "t.py", "--runtime", "cpu", "--launch", "host", "--env", "LOOP=1")
    read_until(proc, lambda seen: len({line.split()[0] for line in seen if " tick " in line}) == WORKERS, timeout=90)
    pid = _relay_pid(emulator, pod, 4)
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 75 and "ended (lost)" in err, err  # cut short by the infrastructure
    (said,) = [line for line in err.splitlines() if line.startswith("error:") and "w4" in line]
    assert SUBTREE.match(said), err
    rows = {line.split()[0]: line.split()[1] for line in err.splitlines() if re.match(r"^w\d ", line)}
    assert [rows[f"w{w}"] for w in range(4, 8)] == ["unreachable"] * 4 and "running" not in rows.values(), err

    proc = popen(cli, "exec", "--relay", "--", "sh", "-c", "echo started; sleep 12; echo slept")
    read_until(proc, lambda seen: sum(line.endswith("] started") for line in seen) == WORKERS, timeout=60)
    pid = _relay_pid(emulator, pod, 4)
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err
    assert sorted(line.split()[0] for line in out.splitlines() if line.endswith("slept")) == [
        f"[w{w}]" for w in range(4)
    ]
    (said,) = [line for line in err.splitlines() if "went away" in line]  # under the rows, not in each
    assert SUBTREE.match(said), err
    rows = {line.split()[0]: line.split()[1] for line in err.splitlines() if re.match(r"^w\d ", line)}
    assert [rows[f"w{w}"] for w in range(4, 8)] == ["unreachable"] * 4, err  # (its time is the loss's, not asserted)
    _nothing_left(emulator, pod, "sleep 12")

    (cli.cwd / "count.py").write_text(COUNT)
    r = cli("train", "--relay", "count.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    proc = popen(cli, "logs", "--relay", r.out.strip().splitlines()[-1], "--follow")
    seen = read_until(proc, lambda got: len({line.split()[0] for line in got if " count " in line}) == WORKERS)
    pid = _relay_pid(emulator, pod, 4)
    os.kill(pid, signal.SIGKILL)
    out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    for w in range(WORKERS):  # the root's workers followed from this machine on, every line once
        lines = [*seen, *out.splitlines()]
        said = [line.split(" count ", 1)[1] for line in lines if line.startswith(f"[w{w}]") and " count " in line]
        assert said == [f"{i} of worker {w}" for i in range(40)], (w, said, err)
