"""A relay's zygote forks the bundle's agent and sync helper: what the forked agent does (its answers, exit codes,
the job it starts from `--first`, its own session) is what `python agent.py ...` does, the forked helper says what
`python sync_helper.py` says, and the zygote ends with its relay. The relayed jobs and syncs of
tests/integration/test_relays.py run every agent and helper of theirs this way."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import PY38
from tpurun.worker import WORKER_DIR

PYTHONS = [sys.executable] + ([PY38] if PY38 else [])

# Run as a relay is (`python`): makes a zygote before any thread, has it fork a program for each command
# on stdin (a JSON list of [program, args, input in base64]), prints what each did (its output in base64), then
# closes the zygote's socket and says whether the zygote ended.
DRIVER = textwrap.dedent(
    """
    import base64, json, os, sys, time
    sys.path[0] = sys.argv[1]
    import zygote
    z = zygote.Zygote()
    out = []
    for program, args, data in json.loads(sys.stdin.read()):
        child = z.spawn(program, args, dict(os.environ))
        try:  # (a command that does not read its stdin may have ended and been reaped already)
            own_session = os.getsid(child.pid) == child.pid
        except ProcessLookupError:
            own_session = None
        os.write(child.stdin.fileno(), base64.b64decode(data))
        child.stdin.close()
        got, err = child.stdout.read(), child.stderr.read()
        out.append({"rc": child.wait(), "out": base64.b64encode(got).decode(), "err": err.decode(),
                    "own_session": own_session,
                    "parent": int(open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[1])
                    if os.path.exists(f"/proc/{child.pid}") else z.pid})
    z.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{z.pid}"):  # ended, and reaped by its relay
        time.sleep(0.01)
    print(json.dumps({"results": out, "zygote": z.pid, "zygote_ended": not os.path.exists(f"/proc/{z.pid}")}))
    """
)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    keep = ("PATH", "LANG", "LC_ALL")
    return {**{k: v for k, v in os.environ.items() if k in keep}, "HOME": str(home)}


def forked(
    env: dict[str, str], commands: list[tuple[list[str], str | bytes]], python: str = sys.executable,
    program: str = "agent.py",
) -> dict:
    """What the zygote's children of PROGRAM did with each of COMMANDS ((its arguments, its input)): its output
    as text in `out`, as bytes in `raw`."""
    wire = [[program, args, base64.b64encode(data if isinstance(data, bytes) else data.encode()).decode()]
            for args, data in commands]  # fmt: skip
    r = subprocess.run(
        [python, "-c", DRIVER, str(WORKER_DIR)], input=json.dumps(wire), capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for f in got["results"]:
        f["raw"] = base64.b64decode(f["out"])
        f["out"] = f["raw"].decode(errors="replace")
    return got


def started(
    env: dict[str, str], args: list[str], data: str = "", python: str = sys.executable, program: str = "agent.py"
) -> dict:
    r = subprocess.run(
        [python, str(WORKER_DIR / program), *args], input=data, capture_output=True, text=True, env=env, timeout=60
    )  # fmt: skip
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr}


@pytest.mark.parametrize("python", PYTHONS)
def test_a_forked_agent_answers_as_a_started_one(env: dict[str, str], python: str) -> None:
    commands = [
        (["jobs"], ""),
        (["preflight", "--packages", "pathspec,no-such-thing"], ""),
        (["no-such-command"], ""),
        (["state", "not a job id"], ""),
        (["start"], "not a spec"),  # alive until its stdin is written: its session is seen for certain
    ]
    got = forked(env, commands, python)
    assert got["zygote_ended"], "the zygote outlived its relay's end of the socket"
    for (args, data), f in zip(commands, got["results"], strict=True):
        s = started(env, args, data, python)
        assert (f["rc"], f["out"]) == (s["rc"], s["out"]), args
        assert bool(f["err"]) == bool(s["err"]), args
        assert f["own_session"] in (True, None), "a forked agent runs in a session of its own, as sshd starts one"
        assert f["parent"] == got["zygote"]
    assert got["results"][-1]["own_session"] is True
    assert got["results"][0]["rc"] == 0 and got["results"][2]["rc"] != 0 and got["results"][-1]["rc"] != 0


def test_a_forked_agent_starts_the_job_its_first_input_holds(env: dict[str, str], tmp_path: Path) -> None:
    """`--first start SPEC` as bundle.RUN passes it (the spec base64, moved to the environment): the job starts,
    its supervisor forked from the forked agent, and runs to its end."""
    done = tmp_path / "done"
    body = f"import pathlib; pathlib.Path({str(done)!r}).write_text('ran'); print('hello', flush=True)"
    spec = {"job_id": "20261128-000000-z1", "worker": 0, "detach": True, "grace": 2,
            "cores": [{"core": 0, "argv": [sys.executable, "-c", body], "env": {}}]}  # fmt: skip
    b64 = base64.b64encode(json.dumps(spec).encode()).decode()
    got = forked(env, [(["--first", "start", b64], "")])["results"][0]
    assert got["rc"] == 0, got["err"]
    assert json.loads(got["out"])["event"] == "started"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = json.loads(started(env, ["state", spec["job_id"]])["out"] or "{}")
        if st.get("status") in ("finished", "failed", "stopped", "lost"):
            break
        time.sleep(0.05)
    assert st["status"] == "finished" and done.read_text() == "ran"


def test_a_forked_sync_helper_says_what_a_started_one_says(env: dict[str, str]) -> None:
    """A sync helper forked by the zygote (a relayed `sync`'s, `download`'s) takes its frames and answers as
    `python sync_helper.py` does: a manifest of another protocol version refused, exit 2; no input, its error."""
    from tpurun.sync.stream import frame
    from tpurun.worker.sync_helper import Frame, pack_json

    other = frame(Frame.MANIFEST, pack_json({"v": -1, "files": []}))
    got = forked(env, [([], other), ([], b"")], program="sync_helper.py")
    assert got["zygote_ended"]
    for data, f in zip((other, b""), got["results"], strict=True):
        s = subprocess.run([sys.executable, str(WORKER_DIR / "sync_helper.py")], input=data, capture_output=True,
                           env=env, timeout=60)  # fmt: skip
        assert (f["rc"], f["raw"], bool(f["err"])) == (s.returncode, s.stdout, bool(s.stderr)), (f, s)
        assert f["parent"] == got["zygote"]
    assert got["results"][0]["rc"] == 2 and got["results"][0]["raw"].startswith(Frame.REFUSED)


def test_an_idle_zygote_ends_and_its_relay_starts_programs_after(env: dict[str, str]) -> None:
    """No child and no request for IDLE_SECONDS once an agent was asked for (a job's start is over): the zygote
    ends (a running job's worker is spared its pages), and what the relay asks for after is refused (the relay
    starts it as a program). A sync helper alone (a job's sync comes first) does not start that clock."""
    driver = textwrap.dedent(
        """
        import json, os, sys, time
        sys.path[0] = sys.argv[1]
        import zygote
        zygote.IDLE_SECONDS = 0.5
        z = zygote.Zygote()
        helper = z.spawn("sync_helper.py", [], dict(os.environ))
        helper.stdin.close()
        helper.stdout.read()
        helper.wait()
        time.sleep(4 * zygote.IDLE_SECONDS)
        after_sync = os.path.exists(f"/proc/{z.pid}")
        child = z.spawn("agent.py", ["jobs"], dict(os.environ))
        child.stdin.close()
        child.stdout.read()
        rc = child.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{z.pid}"):  # ended, and reaped by its relay
            time.sleep(0.01)
        ended = not os.path.exists(f"/proc/{z.pid}")
        after = z.spawn("agent.py", ["jobs"], dict(os.environ)) is None
        print(json.dumps({"after_sync": after_sync, "rc": rc, "ended": ended, "after": after}))
        """
    )
    r = subprocess.run([sys.executable, "-c", driver, str(WORKER_DIR)], capture_output=True, text=True, env=env,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"after_sync": True, "rc": 0, "ended": True, "after": True}


def test_what_the_client_asks_a_relay_to_run_is_what_its_zygote_forks(env: dict[str, str]) -> None:
    """The argv a relayed fleet sends for the bundle's agent and the sync helper (bundled: a relayed worker has
    the bundle) is what a relay hands its zygote; the helper's stand-alone form, another program or Python, and
    an environment that sets what the interpreter reads at its start run as programs."""
    from tpurun.fleet import bundle
    from tpurun.sync.stream import helper_command
    from tpurun.worker import bundle_name
    from tpurun.worker.relay_wire import Node

    py = "/usr/bin/python3"
    plan = {"node": Node(0, "w0", "127.0.0.1", 22, "u", "w0", "ssh-ed25519 AAAA").to_wire(), "python": py,
            "bundle": bundle_name(), "run": bundle.RUN, "fanout": 2}  # fmt: skip
    asks = [
        (list(helper_command(py, bundled=True)), {}),
        (bundle.program_argv(py, "agent.py", "preflight", "--claim", "j1"), {}),
        (list(helper_command(py)), {}),
        (bundle.program_argv(py, "watchdog.py", "ensure"), {}),
        (bundle.program_argv("/other/python3", "agent.py", "jobs"), {}),
        (bundle.program_argv(py, "agent.py", "jobs"), {"PYTHONPATH": "/x"}),
    ]
    driver = (
        "import json, sys\nsys.path[0] = sys.argv[1]\nimport relay\n"
        "r = relay.Relay(json.loads(sys.argv[2]))\n"
        "print(json.dumps([r.forkable(a, e) for a, e in json.loads(sys.stdin.read())]))\n"
    )
    out = subprocess.run([sys.executable, "-c", driver, str(WORKER_DIR), json.dumps(plan)], input=json.dumps(asks),
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [
        ["sync_helper.py", []], ["agent.py", ["preflight", "--claim", "j1"]], ["", []], ["", []], ["", []], ["", []],
    ]  # fmt: skip
