"""The worker agent, run locally as the workers run it: `python3 agent.py ...` subprocesses, temp HOME."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import PY38
from tpurun.worker import AGENT_PATH


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


def agent(
    home: Path, *args: str, input: str | None = None, python: str = sys.executable, timeout: float = 60, **env_: str
):
    env = {k: v for k, v in os.environ.items() if k != "TPURUN_AGENT_ROOT"}
    env["HOME"] = str(home)
    env.update(env_)
    return subprocess.run(
        [python, str(AGENT_PATH), *args], input=input, capture_output=True, text=True, env=env, timeout=timeout
    )


def agent_popen(home: Path, *args: str, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    env = dict(os.environ, HOME=str(home))
    return subprocess.Popen([sys.executable, str(AGENT_PATH), *args], stdin=stdin, stdout=subprocess.PIPE, env=env)


def script(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def start(home: Path, job: str, cores: list[dict], *, detach: bool = True, grace: float = 2, **extra) -> dict:
    spec = {"job_id": job, "worker": 0, "detach": detach, "grace": grace, "cores": cores, **extra}
    r = agent(home, "start", input=json.dumps(spec))
    assert r.returncode == 0, r.stderr
    msg = json.loads(r.stdout)
    assert msg["event"] == "started" and msg["supervisor_pid"] > 0
    return msg


def core(i: int, path: str, **env: str) -> dict:
    return {"core": i, "argv": [sys.executable, path], "env": {"C": str(i), **env}}


def state(home: Path, job: str) -> dict:
    r = agent(home, "state", job)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_over(home: Path, job: str, timeout: float = 30) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = state(home, job)
        if st["status"] in ("finished", "stopped", "failed", "lost", "spent"):
            return st
        time.sleep(0.05)
    raise AssertionError(f"job {job} still {st['status']}")


def live_processes(match) -> list[int]:
    """Non-zombie processes for which MATCH(stat fields after the name, pid) holds, from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        if fields[0] not in ("Z", "X") and match(fields, int(name)):
            out.append(int(name))
    return out


def live_group_members(pgid: int) -> list[int]:
    """Non-zombie processes of PGID (the acceptance check: nothing left in the table)."""
    return live_processes(lambda fields, pid: fields[2] == str(pgid))


def assert_nothing_left(st: dict) -> None:
    for c in st["cores"]:
        assert live_group_members(c["pgid"]) == [], f"core {c['core']} left processes"


def records(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


PRINTER = """
    import os, sys
    c = os.environ["C"]
    for i in range(int(os.environ.get("N", "5"))):
        print(f"out {c} {i}", flush=True)
        print(f"err {c} {i}", file=sys.stderr, flush=True)
    sys.stdout.buffer.write(b"bytes \\xff\\xfe end\\n")
    sys.stdout.write(f"partial {c}")  # no newline at the end
    sys.stdout.flush()
"""


def test_log_files_hold_every_line_in_order(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "printer.py", PRINTER)
    start(home, "j1", [core(0, p, N="50"), core(1, p, N="50")])
    st = wait_over(home, "j1")
    assert st["status"] == "finished"
    assert [c["exit_code"] for c in st["cores"]] == [0, 0]
    jdir = home / ".tpurun" / "jobs" / "j1"
    for c in (0, 1):
        log = (jdir / f"w0-c{c}.log").read_bytes().splitlines()
        outs = [line for line in log if line.startswith(b"out ")]
        errs = [line for line in log if line.startswith(b"err ")]
        assert outs == [f"out {c} {i}".encode() for i in range(50)]
        assert errs == [f"err {c} {i}".encode() for i in range(50)]
        assert b"bytes \xff\xfe end" in log  # the bytes as printed
        assert log.index(b"bytes \xff\xfe end") < log.index(f"partial {c}".encode())
        assert len(log) == 102
        recs = records((jdir / f"w0-c{c}.rec").read_bytes())
        assert len(recs) == 102
        assert {r["s"] for r in recs} == {"out", "err"}
        assert [r["l"] for r in recs if r["s"] == "out"][-2:] == ["bytes \\xff\\xfe end", f"partial {c}"]
        assert all(a["t"] <= b["t"] for a, b in zip(recs, recs[1:], strict=False))
    # the stream (no --follow) returns the same lines, then the end
    r = subprocess.run(
        [sys.executable, str(AGENT_PATH), "stream", "j1"], capture_output=True, env=dict(os.environ, HOME=str(home))
    )
    recs = records(r.stdout)
    lines = [x for x in recs if "l" in x]
    assert len(lines) == 204
    assert recs[-1]["event"] == "done" and recs[-1]["state"]["status"] == "finished"
    assert {x["c"] for x in recs if x.get("event") == "exit"} == {0, 1}


@pytest.mark.skipif(PY38 is None, reason="no python3.8 here")
def test_agent_runs_under_python38(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "printer.py", PRINTER)
    spec = {"job_id": "old", "worker": 0, "detach": True, "cores": [core(0, p)]}
    r = agent(home, "start", input=json.dumps(spec), python=str(PY38))
    assert r.returncode == 0, r.stderr
    wait_over(home, "old")
    r = agent(home, "stream", "old", "--follow", python=str(PY38))
    assert r.returncode == 0, r.stderr
    assert records(r.stdout.encode())[-1]["event"] == "done"


def test_stream_resumes_at_offsets_without_loss_or_duplicates(home: Path, tmp_path: Path) -> None:
    p = script(
        tmp_path,
        "slow.py",
        """
        import os, sys, time
        c = os.environ["C"]
        for i in range(3000):
            print(f"line {c} {i}", flush=True)
            if i % 100 == 0:
                time.sleep(0.02)
        """,
    )
    start(home, "j2", [core(0, p), core(1, p)])
    got: dict[int, list[str]] = {0: [], 1: []}
    offsets: dict[int, int] = {}
    # first reader: take 1500 records and vanish (SIGKILL, as a dropped SSH session would)
    s = agent_popen(home, "stream", "j2", "--follow")
    assert s.stdout is not None
    for _ in range(1500):
        rec = json.loads(s.stdout.readline())
        got[rec["c"]].append(rec["l"])
        offsets[rec["c"]] = rec["o"]
    s.kill()
    s.wait()
    # second reader resumes from the offsets it had seen
    r = subprocess.run(
        [sys.executable, str(AGENT_PATH), "stream", "j2", "--follow", "--offsets", json.dumps(offsets)],
        capture_output=True,
        env=dict(os.environ, HOME=str(home)),
        timeout=60,
    )
    for rec in records(r.stdout):
        if "l" in rec:
            got[rec["c"]].append(rec["l"])
    for c in (0, 1):
        assert got[c] == [f"line {c} {i}" for i in range(3000)]


def test_a_core_exiting_3_stops_the_other(home: Path, tmp_path: Path) -> None:
    p = script(
        tmp_path,
        "fail.py",
        """
        import os, subprocess, sys, time
        if os.environ["C"] == "1":
            time.sleep(0.5)
            print("failing", flush=True)
            sys.exit(3)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a child in its group
        time.sleep(60)
        """,
    )
    t0 = time.time()
    start(home, "j3", [core(0, p), core(1, p)], grace=2)
    st = wait_over(home, "j3")
    print(json.dumps(st, indent=1))  # shown when an assertion below fails
    assert st["status"] == "failed"
    failed_at = st["first_failure"].pop("time")  # when the agent saw it fail: how jobs orders the workers' failures
    assert st["first_failure"] == {"worker": 0, "core": 1, "exit_code": 3}
    assert t0 < failed_at < time.time()
    by_core = {c["core"]: c for c in st["cores"]}
    assert by_core[1]["exit_code"] == 3 and by_core[1]["status"] == "exited"
    assert by_core[1]["last_line"] == "failing"
    assert by_core[0]["status"] == "killed" and by_core[0]["exit_code"] == -signal.SIGTERM
    assert_nothing_left(st)
    assert time.time() - t0 < 30  # generous: the CI box may be loaded; latency is benchmarked elsewhere


def test_after_a_notice_a_core_that_ends_leaves_the_others_until_the_host_may_go(home: Path, tmp_path: Path) -> None:
    """A maintenance notice (the host may go in 4 s) reaches the supervisor from a peer, signed: core 1 saves at
    once and exits 75; core 0's save takes 1.5 s and is not cut short by core 1's end; core 2 ignores the notice
    and is stopped when the host may go. The first to end is the job's first failure, as before."""
    p = script(
        tmp_path,
        "told.py",
        """
        import os, sys, time
        c = os.environ["C"]
        while not (c != "2" and os.path.exists(os.environ["TPURUN_NOTICE_FILE"])):
            time.sleep(0.05)
        time.sleep(1.5 if c == "0" else 0.0)
        print("saved", flush=True)
        sys.exit(75)
        """,
    )
    import socket
    from types import SimpleNamespace

    from tpurun.worker.agent_notices import NoticeWatch
    from tpurun.worker.protocol import Notice, NoticeKind

    with socket.socket() as s:  # a port free on the supervisor's address
        s.bind(("127.0.0.81", 0))
        port = s.getsockname()[1]
    key = "ef" * 32
    notice = dict(on_notice="file", notice_port=port, notice_key=key)
    start(home, "jn", [core(c, p) for c in (0, 1, 2)], notice_address="127.0.0.81", peers=["127.0.0.82"], **notice)
    peer = SimpleNamespace(job_id="jn", worker=1, notice_address="", peers=["127.0.0.81"], **notice)
    told = time.time()
    NoticeWatch(peer, lambda n: None).tell_peers(Notice(NoticeKind.MAINTENANCE, 1, told, told + 4, "file"))
    st = wait_over(home, "jn")
    print(json.dumps(st, indent=1))  # shown when an assertion below fails
    by_core = {c["core"]: c for c in st["cores"]}
    assert [(by_core[c]["status"], by_core[c]["exit_code"], by_core[c]["last_line"]) for c in (0, 1)] == [
        ("exited", 75, "saved")
    ] * 2
    assert by_core[2]["status"] == "killed" and by_core[2]["exit_code"] == -signal.SIGTERM
    assert (st["first_failure"]["core"], st["notice"]["kind"]) == (1, "maintenance")
    assert st["ended_at"] >= told + 4  # the last one was stopped when the host may go, not before
    assert_nothing_left(st)


# leaves a grandchild in its own session: no process-group signal reaches it
ESCAPE = """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print("up", flush=True)
    time.sleep(600)
"""
# ignores SIGTERM: only the grace's SIGKILL ends it
STUBBORN = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(120)
"""


def test_stop_kills_a_core_that_ignores_sigterm_after_the_grace(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "stubborn.py", STUBBORN)
    start(home, "j4", [core(0, p), core(1, p)], grace=30)
    time.sleep(0.5)
    t0 = time.time()
    r = agent(home, "stop", "j4", "--grace", "1")
    took = time.time() - t0
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["status"] == "stopped"
    assert {c["status"] for c in st["cores"]} == {"killed"}
    assert {c["exit_code"] for c in st["cores"]} == {-signal.SIGKILL}
    assert 1 <= took < 8
    assert_nothing_left(st)


def test_attached_stream_stops_the_job_when_stdin_closes(home: Path, tmp_path: Path) -> None:
    p = script(
        tmp_path,
        "forever.py",
        """
        import os, time
        i = 0
        while True:
            print(f"tick {os.environ['C']} {i}", flush=True)
            i += 1
            time.sleep(0.05)
        """,
    )
    start(home, "j5", [core(0, p), core(1, p)], detach=False)
    s = agent_popen(home, "stream", "j5", "--follow", "--attached", stdin=subprocess.PIPE)
    assert s.stdout is not None and s.stdin is not None
    for _ in range(5):
        assert json.loads(s.stdout.readline())["l"].startswith("tick")
    s.stdin.close()  # the client went away (or cancelled)
    rest = records(s.stdout.read())
    assert s.wait(timeout=30) == 0
    assert rest[-1]["event"] == "done" and rest[-1]["state"]["status"] == "stopped"
    st = state(home, "j5")
    assert st["status"] == "stopped"
    assert_nothing_left(st)


def test_detached_job_survives_its_stream_being_killed(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "sleeper.py", "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    start(home, "j6", [core(0, p)], detach=True)
    s = agent_popen(home, "stream", "j6", "--follow", "--attached", stdin=subprocess.PIPE)
    assert s.stdout is not None
    assert json.loads(s.stdout.readline())["l"] == "up"
    s.kill()
    s.wait()
    time.sleep(1)
    st = state(home, "j6")
    assert st["status"] == "running" and st["supervisor_alive"]
    assert live_group_members(st["cores"][0]["pgid"])
    r = agent(home, "stop", "j6")
    assert r.returncode == 0
    assert_nothing_left(json.loads(r.stdout))


def test_attached_job_stops_when_no_stream_holds_its_lease(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    start(home, "j7", [core(0, p)], detach=False, lease_timeout=1)
    st = wait_over(home, "j7", timeout=15)
    assert st["status"] == "stopped" and "client is gone" in st["reason"]
    assert_nothing_left(st)


def test_second_start_is_refused_while_a_job_runs(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    start(home, "first", [core(0, p)])
    spec = {"job_id": "second", "worker": 0, "cores": [core(0, p)]}
    r = agent(home, "start", input=json.dumps(spec))
    assert r.returncode == 3
    assert len(r.stderr.strip().splitlines()) == 1 and "first" in r.stderr
    r = agent(home, "jobs")
    assert [j["job_id"] for j in json.loads(r.stdout)] == ["first"]
    agent(home, "stop", "first")
    r = agent(home, "start", input=json.dumps(spec))
    assert r.returncode == 0, r.stderr
    agent(home, "stop", "second")


def test_a_first_command_runs_in_the_same_process_and_the_rest_only_if_it_succeeded(home: Path, tmp_path: Path) -> None:
    """`agent.py --first start ...` (bundle.program_argv): the start, its spec in the environment (never on a
    command line, which every user of the worker can read), then the rest, in one Python process."""
    p = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")

    def given(job: str) -> str:
        spec = {"job_id": job, "worker": 0, "detach": True, "cores": [core(0, p)]}
        return base64.b64encode(json.dumps(spec).encode()).decode()

    r = agent(home, "--first", "start", "state", "one", TPURUN_FIRST_INPUT=given("one"))
    assert r.returncode == 0, r.stderr
    started, st = (json.loads(line) for line in r.stdout.splitlines())
    assert started["event"] == "started" and st["job_id"] == "one"
    r = agent(home, "--first", "start", "jobs", TPURUN_FIRST_INPUT=given("two"))
    assert r.returncode == 3 and r.stdout == "" and "one" in r.stderr  # refused: `jobs` never ran
    r = agent(home, "--first", "start", TPURUN_FIRST_INPUT="not base64!")
    assert r.returncode == 2 and r.stderr.strip() == "tpurun agent: TPURUN_FIRST_INPUT is not base64"
    agent(home, "stop", "one")


def test_the_shell_that_runs_a_bundle_program_keeps_a_first_input_off_the_command_line(tmp_path: Path) -> None:
    from tpurun.fleet import bundle

    argv = bundle.program_argv("python3", "agent.py", "stream", "J", first=("start", b"SECRET"))
    fake = tmp_path / ".tpurun" / "bin" / bundle.bundle_name() / "agent.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("import os, sys\nprint(sys.argv[1:], os.environ.get('TPURUN_FIRST_INPUT'))\n")
    r = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, HOME=str(tmp_path)))
    secret = base64.b64encode(b"SECRET").decode()
    assert r.stdout.strip() == f"['--first', 'start', 'stream', 'J'] {secret}", r.stderr


def test_cores_die_with_their_supervisor(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    msg = start(home, "j8", [core(0, p), core(1, p)])
    os.kill(msg["supervisor_pid"], signal.SIGKILL)
    deadline = time.time() + 10
    while time.time() < deadline and any(live_group_members(c["pgid"]) for c in msg["cores"]):
        time.sleep(0.05)
    assert not any(live_group_members(c["pid"]) for c in msg["cores"])
    assert state(home, "j8")["status"] == "lost"
    # a follower is told the job's end at once: nobody will write the rest (it waited forever before)
    r = agent(home, "stream", "j8", "--follow", timeout=30)
    done = [json.loads(line) for line in r.stdout.splitlines() if '"done"' in line]
    assert r.returncode == 0 and done and done[-1]["state"]["status"] == "lost", r.stdout[-500:]
    # a stop of a job that ended lost takes what it left behind and keeps its end
    r = agent(home, "stop", "j8")
    answer = json.loads(r.stdout)
    assert r.returncode == 0 and (answer["status"], answer["status_before_stop"]) == ("lost", "lost")
    assert state(home, "j8")["status"] == "lost"


# a relay's stream of the job it claimed (zygote.stream_claimed): its lifeline cut when the stream starts
HELD_STREAM = """
import json, sys, threading, time
sys.path[0] = sys.argv[1]
import agent
class Out:
    def write(self, data): pass
    def flush(self): pass
cut = threading.Event()
cut.set()
print(json.dumps({"cut": time.time(), "held_stop": agent.HELD_STOP}), flush=True)
print(json.dumps({"rc": agent.stream_job(sys.argv[2], Out(), agent.Pace(), True, cut, {}, held=True)}), flush=True)
"""


def test_a_relays_stream_stops_the_job_itself_only_when_its_supervisor_did_not(home: Path, tmp_path: Path) -> None:
    """The relay that streams a job it claimed leaves the stop to the job's supervisor, which holds the lifeline
    too; where the job has not ended HELD_STOP seconds after the cut (its supervisor hung: here stopped with
    SIGSTOP), the stream stops it itself, as `agent.py stop` does, and ends with the job's end."""
    p = script(tmp_path, "sleeper.py", "import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    msg = start(home, "jh", [core(0, p)], grace=1)
    os.kill(msg["supervisor_pid"], signal.SIGSTOP)
    try:
        env = dict(os.environ, HOME=str(home))
        r = subprocess.run(
            [sys.executable, "-c", HELD_STREAM, str(AGENT_PATH.parent), "jh"],
            capture_output=True, text=True, env=env, timeout=90,
        )  # fmt: skip
    finally:
        os.kill(msg["supervisor_pid"], signal.SIGCONT)  # (killed by then: a stop's SIGKILL takes a stopped process)
    assert r.returncode == 0, r.stderr
    said = [json.loads(line) for line in r.stdout.splitlines()]
    assert said[-1] == {"rc": 0}, said
    asked = (home / ".tpurun" / "jobs" / "jh" / "stop.json").stat().st_mtime  # `agent.py stop`'s request
    assert asked >= said[0]["cut"] + said[0]["held_stop"] - 0.1, (asked, said)
    st = state(home, "jh")
    assert st["status"] == "lost", st  # its supervisor killed by the stop, as `agent.py stop` records a hung one
    assert_nothing_left(st)


def test_a_relays_stream_takes_what_a_supervisor_that_died_before_the_stop_left(home: Path, tmp_path: Path) -> None:
    """The supervisor dies (SIGKILL) before it stopped the job whose lifeline was cut: its own processes die with
    it (PDEATHSIG), but one that left their group lives on; the relay's stream takes it before it ends."""
    p = script(tmp_path, "escape.py", ESCAPE)
    msg = start(home, "jd", [core(0, p)], grace=1)
    def job(fields: list[str], pid: int) -> bool:
        try:
            return b"TPURUN_JOB_ID=jd\0" in Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False

    deadline = time.time() + 20
    while len(live_processes(job)) < 2:  # the script and what it left its group with
        assert time.time() < deadline, live_processes(job)
        time.sleep(0.05)
    os.kill(msg["supervisor_pid"], signal.SIGKILL)
    env = dict(os.environ, HOME=str(home))
    r = subprocess.run(
        [sys.executable, "-c", HELD_STREAM, str(AGENT_PATH.parent), "jd"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == '{"rc": 0}', (r.stdout, r.stderr)
    assert state(home, "jd")["status"] == "lost"
    assert live_processes(job) == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in live_processes(job)]


def test_a_supervisor_waits_out_a_grace_without_spinning(home: Path, tmp_path: Path) -> None:
    """A supervisor whose job's --budget is spent stops it, then waits through the grace for a process that
    ignores SIGTERM: woken by the process's end or the grace's, not looking again at once each round (past its
    stop time it once waited 0 s a round: a core busy for the whole grace)."""
    p = script(tmp_path, "stubborn.py", STUBBORN)
    grace = 4.0
    msg = start(home, "jg", [core(0, p)], grace=grace, spend_for=grace + 0.5)  # its stop starts 0.5 s in
    pid, log = msg["supervisor_pid"], home / ".tpurun" / "jobs" / "jg" / "supervisor.log"

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    deadline = time.time() + 10
    while "stopping (its --budget is spent)" not in log.read_text():
        assert time.time() < deadline, log.read_text()
        time.sleep(0.05)
    before = cpu()
    time.sleep(grace / 2)  # inside the grace: the process ignores SIGTERM, nothing happens
    spent = cpu() - before
    assert spent < grace / 8, f"the supervisor used {spent:.2f} s of CPU in {grace / 2:.1f} s of its grace"
    st = wait_over(home, "jg")
    assert st["status"] == "spent" and st["cores"][0]["exit_code"] == -signal.SIGKILL, st


def test_a_supervisor_that_wrote_its_last_state_and_exited_is_not_lost(tmp_path: Path, monkeypatch) -> None:
    """The race behind a finished job reported lost: state.json read while the job runs, then the supervisor
    writes its last state and exits before its liveness is checked. The state is read again first."""
    from tpurun.worker import agent_files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"status": "finished", "supervisor_pid": dead.pid}))
    stale = {"status": "running", "supervisor_pid": dead.pid}
    reads = iter([stale])  # the first read sees the state before the supervisor's last write; the rest the file
    monkeypatch.setattr(agent_files, "read_json", lambda p: next(reads, None) or json.loads(Path(p).read_text()))
    st = agent_files.state_with_liveness(str(path))
    assert st is not None and (st.status, st.supervisor_alive) == ("finished", False)
    # killed while running: nothing newer to read, so lost
    path.write_text(json.dumps(stale))
    assert getattr(agent_files.state_with_liveness(str(path)), "status", None) == "lost"


def test_unstartable_core_fails_the_job_fast(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    cores = [core(0, p), {"core": 1, "argv": ["/nonexistent/python"], "env": {}}]
    start(home, "j9", cores)
    st = wait_over(home, "j9")
    assert st["status"] == "failed" and st["first_failure"]["core"] == 1
    assert st["first_failure"]["exit_code"] == 127
    assert_nothing_left(st)


def test_stream_throughput_two_cores_100k_lines(home: Path, tmp_path: Path) -> None:
    n = 100_000
    p = script(
        tmp_path,
        "flood.py",
        f"""
        import os, sys
        c = os.environ["C"]
        w = sys.stdout.write
        for i in range({n}):
            w(f"core {{c}} line {{i}} " + "x" * 40 + "\\n")
        """,
    )
    t0 = time.time()
    start(home, "tp", [core(0, p), core(1, p)])
    s = agent_popen(home, "stream", "tp", "--follow")
    assert s.stdout is not None
    count = {0: 0, 1: 0}
    first_line_at = None
    last = {0: -1, 1: -1}
    for raw in s.stdout:
        rec = json.loads(raw)
        if "l" in rec:
            if first_line_at is None:
                first_line_at = time.time()
            i = int(rec["l"].split()[3])
            assert i == last[rec["c"]] + 1
            last[rec["c"]] = i
            count[rec["c"]] += 1
        elif rec.get("event") == "done":
            break
    s.wait(timeout=60)
    took = time.time() - t0
    assert count == {0: n, 1: n}
    # Separate the stream's own speed: re-read the finished files from offset 0.
    t1 = time.time()
    r = subprocess.run(
        [sys.executable, str(AGENT_PATH), "stream", "tp"], capture_output=True, env=dict(os.environ, HOME=str(home))
    )
    replay = time.time() - t1
    assert r.stdout.count(b"\n") == 2 * n + 3
    print(
        f"\nstream throughput: {2 * n} lines end to end in {took:.2f} s = {2 * n / took:,.0f} lines/s; "
        f"replay of the finished files {2 * n / replay:,.0f} lines/s"
    )


# ---------------------------------------------------------------- host launch: chip processes of a spawner

# Job ids unique to this run: the agent finds a job's processes machine-wide by its id.
RUN = f"{os.getpid()}-{time.time_ns() % 10**6}"

# A stand-in for xmp.spawn's process model, stdlib only (the real spawners run on emulated TPU VMs in
# tests/integration/test_launch.py): a spawn-context process pool whose tasks set PJRT_LOCAL_PROCESS_RANK,
# as torch_xla's initialize_multiprocess does, then do the replica's work.
SPAWNER = """
    import concurrent.futures, multiprocessing, os, sys, time

    def replica(rank):
        os.environ.setdefault("PJRT_LOCAL_PROCESS_RANK", str(rank))
        print(f"replica {rank} pid {os.getpid()} core {os.environ.get('TPURUN_CORE')}", flush=True)
        print(f"replica {rank} to stderr", file=sys.stderr, flush=True)
        mode = os.environ.get("MODE", "")
        if mode == "fail" and rank == 2:
            raise ValueError("replica 2 broke")
        if mode == "die" and rank == 1:
            time.sleep(0.5)  # dies while the job runs: a segfault in its first step, say
            import ctypes
            ctypes.string_at(0)
        if mode == "nested":  # the replica's own fork pool: a task that fails and is handled is not the chip's
            with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as own:
                try:
                    own.submit(int, "not a number").result()
                except ValueError:
                    print(f"replica {rank} handled its own task's error", flush=True)
        if mode == "exit0":
            time.sleep(1)
            sys.exit(0)
        if mode in ("fail", "die", "sleep"):
            time.sleep(600)
        time.sleep(1)  # replicas run side by side, as real ones do (each blocks in its first collective)
        return rank

    if __name__ == "__main__":
        print("host before", flush=True)
        n = int(os.environ.get("N", "3"))
        for round in range(int(os.environ.get("ROUNDS", "1"))):
            ctx = multiprocessing.get_context(os.environ.get("START", "spawn"))
            with concurrent.futures.ProcessPoolExecutor(n, mp_context=ctx) as pool:
                print("results", list(pool.map(replica, range(n))), flush=True)
        print("host after", flush=True)
"""


def host(path: str, **env: str) -> dict:
    return {"core": -1, "argv": [sys.executable, path], "env": env}


def lines(home: Path, job: str, name: str) -> list[str]:
    return (home / ".tpurun" / "jobs" / job / f"{name}.log").read_text().splitlines()


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_host_launch_files_each_chip_process_under_its_chip(home: Path, tmp_path: Path, start_method: str) -> None:
    p = script(tmp_path, "spawner.py", SPAWNER)
    start(home, f"h1-{RUN}", [host(p, START=start_method, ROUNDS="2")], launch="host")
    st = wait_over(home, f"h1-{RUN}")
    assert st["status"] == "finished", (st, (home / ".tpurun" / "jobs" / f"h1-{RUN}" / "supervisor.log").read_text())
    cores = {c["core"]: c for c in st["cores"]}
    assert sorted(cores) == [-1, 0, 1, 2]
    assert all(c["exit_code"] == 0 for c in cores.values())
    assert lines(home, f"h1-{RUN}", "w0") == ["host before", "results [0, 1, 2]", "results [0, 1, 2]", "host after"]
    for chip in range(3):
        got = lines(home, f"h1-{RUN}", f"w0-c{chip}")
        # two rounds of the spawner: the same chip's file, one pair of lines per round
        assert [ln.split(" pid ")[0] for ln in got if " pid " in ln] == [f"replica {chip}"] * 2
        assert all(ln.endswith(f"core {chip}") for ln in got if " pid " in ln)
        assert got.count(f"replica {chip} to stderr") == 2
        assert cores[chip]["spawned"] is True


def test_host_launch_stream_tags_chip_records(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "spawner.py", SPAWNER)
    start(home, f"h2-{RUN}", [host(p, N="2")], launch="host")
    wait_over(home, f"h2-{RUN}")
    r = subprocess.run(
        [sys.executable, str(AGENT_PATH), "stream", f"h2-{RUN}"],
        capture_output=True,
        env=dict(os.environ, HOME=str(home)),
    )
    recs = records(r.stdout)
    by_core: dict[int, list[str]] = {}
    for rec in recs:
        if "l" in rec:
            by_core.setdefault(rec["c"], []).append(rec["l"])
    assert by_core[-1] == ["host before", "results [0, 1]", "host after"]
    assert [ln.split(" pid ")[0] for ln in by_core[1] if " pid " in ln] == ["replica 1"]
    assert recs[-1]["event"] == "done"
    assert sorted(r["c"] for r in recs if r.get("event") == "exit") == [-1, 0, 1]


def test_host_launch_a_failing_chip_stops_the_job_at_once_and_is_named(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "spawner.py", SPAWNER)
    t0 = time.monotonic()
    start(home, f"h3-{RUN}", [host(p, MODE="fail", N="4")], launch="host", grace=1)
    st = wait_over(home, f"h3-{RUN}", timeout=60)
    assert time.monotonic() - t0 < 30  # not after the siblings' 600 s
    assert st["status"] == "failed"
    assert st["first_failure"]["core"] == 2 and st["first_failure"]["exit_code"] == 1
    assert "ValueError: replica 2 broke" in "\n".join(lines(home, f"h3-{RUN}", "w0-c2"))
    assert job_processes_left(f"h3-{RUN}") == []


def test_host_launch_a_chip_that_dies_is_named(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "spawner.py", SPAWNER)
    start(home, f"h4-{RUN}", [host(p, MODE="die", N="3")], launch="host", grace=1)
    st = wait_over(home, f"h4-{RUN}", timeout=60)
    assert st["status"] == "failed"
    assert st["first_failure"]["core"] == 1
    chip1 = {c["core"]: c for c in st["cores"]}[1]
    assert (chip1["status"], chip1["exit_code"]) == ("failed", -11)
    assert "Fatal Python error: Segmentation fault" in "\n".join(lines(home, f"h4-{RUN}", "w0-c1"))
    assert job_processes_left(f"h4-{RUN}") == []


def test_stop_reaches_chip_processes_that_left_the_group(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "escape.py", ESCAPE)
    start(home, f"h5-{RUN}", [host(p)], launch="host", grace=1)
    deadline = time.time() + 20
    while len(job_processes_left(f"h5-{RUN}")) < 2 and time.time() < deadline:
        time.sleep(0.1)
    assert len(job_processes_left(f"h5-{RUN}")) == 2
    r = agent(home, "stop", f"h5-{RUN}", "--grace", "1")
    assert r.returncode == 0, r.stderr
    assert job_processes_left(f"h5-{RUN}") == []


def job_processes_left(job: str) -> list[int]:
    """Live processes carrying the job's TPURUN_JOB_ID (what the agent must leave none of)."""

    def of_job(fields: list[str], pid: int) -> bool:
        try:
            return f"TPURUN_JOB_ID={job}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False

    return live_processes(of_job)


@pytest.mark.parametrize("mode", ["nested", "exit0"])
def test_host_launch_what_is_not_a_chip_failure(home: Path, tmp_path: Path, mode: str) -> None:
    """A replica's own forked pool reports nothing for the chip; sys.exit(0) in a replica is success."""
    p = script(tmp_path, "spawner.py", SPAWNER)
    start(home, f"hn-{mode}-{RUN}", [host(p, MODE=mode, N="2")], launch="host")
    st = wait_over(home, f"hn-{mode}-{RUN}")
    assert st["status"] == "finished", (st, lines(home, f"hn-{mode}-{RUN}", "w0"))
    assert {c["core"]: c["exit_code"] for c in st["cores"]} == {-1: 0, 0: 0, 1: 0}


def test_host_launch_other_spawners_chips_may_end_before_their_parent(home: Path, tmp_path: Path) -> None:
    """Not every spawner is a process pool: a chip process that ends while its parent goes on is not a crash."""
    p = script(
        tmp_path,
        "procs.py",
        """
        import multiprocessing, os, time

        def replica(rank):
            os.environ["PJRT_LOCAL_PROCESS_RANK"] = str(rank)
            print("replica", rank, flush=True)

        if __name__ == "__main__":
            ps = [multiprocessing.get_context("spawn").Process(target=replica, args=(r,)) for r in range(2)]
            for q in ps:
                q.start()
            for q in ps:
                q.join()
            time.sleep(1)  # the parent outlives its chips
            print("parent done", flush=True)
        """,
    )
    start(home, f"hp-{RUN}", [host(p)], launch="host")
    st = wait_over(home, f"hp-{RUN}")
    assert {c["core"]: c["exit_code"] for c in st["cores"]} == {-1: 0, 0: 0, 1: 0}
    assert st["status"] == "finished", st
    assert lines(home, f"hp-{RUN}", "w0-c1") == ["replica 1"]


def claim(home: Path, job: str, claiming: bool = True) -> tuple[subprocess.Popen, dict]:
    """`agent.py preflight --claim JOB` running, told to claim (a line on stdin) or not (stdin closed), with its
    answer; its stdin is the claim's lifeline."""
    proc = agent_popen(home, "preflight", "--claim", job, stdin=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    if claiming:
        proc.stdin.write(b"\n")
        proc.stdin.flush()
    else:
        proc.stdin.close()
    return proc, json.loads(proc.stdout.readline())


def ended(proc: subprocess.Popen, timeout: float = 10) -> int:
    return proc.wait(timeout=timeout)


def test_a_claim_holds_the_worker_for_its_job_until_the_job_starts(home: Path, tmp_path: Path) -> None:
    p = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    asked, answer = claim(home, "a", claiming=False)
    assert answer["held_by"] == "" and ended(asked) == 0  # only asked: answers, holds nothing
    held, answer = claim(home, "a")
    assert answer["held_by"] == "" and held.poll() is None  # granted: held while its stdin is open
    asked, answer = claim(home, "b", claiming=False)
    assert answer["held_by"] == "a" and ended(asked) == 0
    other, refused = claim(home, "b")
    assert refused["held_by"] == "a" and ended(other) == 0  # refused: answers, holds nothing
    spec = {"job_id": "b", "worker": 0, "cores": [core(0, p)]}
    r = agent(home, "start", input=json.dumps(spec))
    assert r.returncode == 3 and r.stderr.strip().splitlines() == [
        "job a is starting on this worker: wait for it, or `tpurun kill-stale` if its train is gone"
    ]
    assert not (home / ".tpurun" / "jobs" / "b").exists()  # nothing of b written, nothing started
    start(home, "a", [core(0, p)])  # the job its claim was for starts, and ends the claim's process
    assert ended(held) != 0
    r = agent(home, "preflight")
    assert json.loads(r.stdout)["held_by"] == "a"  # now the job itself holds the worker
    late, answer = claim(home, "c")
    assert answer["held_by"] == "a" and ended(late) == 0
    agent(home, "stop", "a")
    again, answer = claim(home, "c")
    assert answer["held_by"] == ""
    again.stdin.close()
    assert ended(again) == 0


@pytest.mark.parametrize("how", ["stdin closed", "SIGKILL"])
def test_a_claim_ends_with_its_client(home: Path, how: str) -> None:
    """The client gone (its channel's stdin ends) or the holder killed: the worker is free at once."""
    held, answer = claim(home, "a")
    assert answer["held_by"] == ""
    if how == "SIGKILL":
        held.kill()
    else:
        held.stdin.close()
    ended(held)
    nxt, answer = claim(home, "b")
    assert answer["held_by"] == ""
    nxt.kill()
    nxt.wait()


def test_kill_stale_ends_a_claim(home: Path) -> None:
    """`tpurun kill-stale`'s probe treats the process holding a claim file open as a holder of the TPU."""
    from tpurun.worker import agent_files, probe

    held, answer = claim(home, "a")
    assert answer["held_by"] == ""
    cfg = {
        "home": str(home),
        "claim_files": [f"{agent_files.agent_root('~')}/{agent_files.CLAIM}"],
        "device_globs": ["/nonexistent/accel*"],  # nothing else on this machine is a holder
        "libtpu_glob": "no-such-libtpu*.so",
        "lock_globs": ["/nonexistent/lock"],
        "grace": 5,
    }
    r = subprocess.run(probe.program_argv(sys.executable, "kill-stale", cfg), capture_output=True, text=True)
    out = json.loads(r.stdout)
    assert [(h["pid"], h["result"]) for h in out["holders"]] == [(held.pid, "terminated (SIGTERM)")], out
    assert out["free"] and ended(held) == -signal.SIGTERM
    nxt, answer = claim(home, "b")
    assert answer["held_by"] == ""
    nxt.kill()
    nxt.wait()


def test_a_claim_becomes_its_jobs_start_and_stream_in_the_same_process(home: Path, tmp_path: Path) -> None:
    """Told its job's start, the claim's process starts the job and streams it to its end (one program on the
    worker from the claim to the stream); the claim's hold passes to the job, and nothing holds it after."""
    from tpurun.worker.protocol_calls import claim_start

    p = script(tmp_path, "printer.py", PRINTER)
    held, answer = claim(home, "a")
    assert answer["held_by"] == ""
    spec = {"job_id": "a", "worker": 0, "detach": False, "grace": 2, "cores": [core(0, p, N="3")]}
    assert held.stdin is not None and held.stdout is not None
    held.stdin.write(claim_start(json.dumps(spec).encode(), stream=True))
    held.stdin.flush()
    recs = records(held.stdout.read())  # to its end: the job's `done`
    assert ended(held) == 0
    assert recs[0]["event"] == "started" and recs[-1]["event"] == "done", recs[-1]
    assert [r["l"] for r in recs if r.get("s") == "out"][:3] == ["out 0 0", "out 0 1", "out 0 2"]
    assert json.loads(agent(home, "preflight").stdout)["held_by"] == ""  # the job ended: nothing holds the worker

    # detached (`only`): the process ends once the job started; the job holds the worker, not a claim
    sleeper = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    held, answer = claim(home, "b")
    assert held.stdin is not None and held.stdout is not None
    spec = {"job_id": "b", "worker": 0, "detach": True, "cores": [core(0, sleeper)]}
    held.stdin.write(claim_start(json.dumps(spec).encode(), stream=False))
    held.stdin.flush()
    (started,) = records(held.stdout.read())
    assert started["event"] == "started" and ended(held) == 0
    assert json.loads(agent(home, "preflight").stdout)["held_by"] == "b"
    nxt, refused = claim(home, "c")
    assert refused["held_by"] == "b" and ended(nxt) == 0
    agent(home, "stop", "b")
    assert json.loads(agent(home, "preflight").stdout)["held_by"] == ""


def test_a_quiet_loop_looks_less_and_less_often_and_at_once_when_woken(monkeypatch) -> None:
    """The supervisor's and a stream's pace: POLL while things happen, longer waits up to IDLE_POLL while nothing
    does, short again after `busy`; `wake` ends a wait at once (a signal, the lifeline, a process's end)."""
    import threading

    from tpurun.worker.agent_files import IDLE_POLL, POLL, Pace

    pace = Pace()
    quiet = [pace.delay() for _ in range(12)]
    assert quiet[0] == POLL and quiet == sorted(quiet) and quiet[-1] == IDLE_POLL
    pace.busy()
    assert pace.delay() == POLL
    monkeypatch.setattr("tpurun.worker.agent_files.IDLE_POLL", 3600.0)
    for _ in range(40):
        pace.delay()  # quiet for long: the next wait would be an hour
    woke = threading.Event()

    def waiter() -> None:
        pace.wait(most=3600)
        woke.set()

    threading.Thread(target=waiter, daemon=True).start()
    pace.wake()
    assert woke.wait(5)  # woken (its wait would be 13 s): the event, not a clock, ends it


def test_a_signal_handler_wakes_a_loop_that_waits_without_deadlocking_it() -> None:
    """The supervisor's SIGCHLD and SIGTERM handlers wake its loop while it waits, in the same thread: waking must
    take no lock the wait holds (an Event's did: a supervisor at 256 workers hung in its own handler)."""
    from tpurun.worker.agent_files import Pace

    pace = Pace()
    woken = [0]

    def handler(signum, frame) -> None:
        woken[0] += 1
        pace.wake()

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)  # a handler every half millisecond, mid-wait
        for _ in range(3000):
            pace.busy()
            pace.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    assert woken[0] > 100  # (a deadlock never gets here: the test's timeout ends it)
