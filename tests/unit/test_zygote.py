"""A relay's zygote forks the bundle's agent: what the forked agent does (its answers, exit codes, the job it
starts from `--first`, its own session) is what `python agent.py ...` does, and the zygote ends with its
relay. The relayed jobs of tests/integration/test_relays.py run every agent of theirs this way."""

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
from tpurun.worker import AGENT_PATH, WORKER_DIR

PYTHONS = [sys.executable] + ([PY38] if PY38 else [])

# Run as a relay is (`python`): makes a zygote before any thread, has it fork the agent for each command
# on stdin (a JSON list of [args, input]), prints what each did, then closes the zygote's socket and says
# whether the zygote ended.
DRIVER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path[0] = sys.argv[1]
    import zygote
    z = zygote.Zygote()
    out = []
    for args, data in json.loads(sys.stdin.read()):
        child = z.spawn(args, dict(os.environ))
        try:  # (a command that does not read its stdin may have ended and been reaped already)
            own_session = os.getsid(child.pid) == child.pid
        except ProcessLookupError:
            own_session = None
        os.write(child.stdin.fileno(), data.encode())
        child.stdin.close()
        got, err = child.stdout.read(), child.stderr.read()
        out.append({"rc": child.wait(), "out": got.decode(), "err": err.decode(), "own_session": own_session,
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


def forked(env: dict[str, str], commands: list[tuple[list[str], str]], python: str = sys.executable) -> dict:
    r = subprocess.run(
        [python, "-c", DRIVER, str(WORKER_DIR)],
        input=json.dumps(commands), capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def started(env: dict[str, str], args: list[str], data: str = "", python: str = sys.executable) -> dict:
    r = subprocess.run(
        [python, str(AGENT_PATH), *args], input=data, capture_output=True, text=True, env=env, timeout=60
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


def test_an_idle_zygote_ends_and_its_relay_starts_programs_after(env: dict[str, str]) -> None:
    """No child and no request for IDLE_SECONDS: the zygote ends (a running job's worker is spared its pages), and
    what the relay asks for after is refused (the relay starts it as a program)."""
    driver = textwrap.dedent(
        """
        import json, os, sys, time
        sys.path[0] = sys.argv[1]
        import zygote
        zygote.IDLE_SECONDS = 0.5
        z = zygote.Zygote()
        child = z.spawn(["jobs"], dict(os.environ))
        child.stdin.close()
        child.stdout.read()
        rc = child.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{z.pid}"):  # ended, and reaped by its relay
            time.sleep(0.01)
        ended = not os.path.exists(f"/proc/{z.pid}")
        print(json.dumps({"rc": rc, "ended": ended, "after": z.spawn(["jobs"], dict(os.environ)) is None}))
        """
    )
    r = subprocess.run([sys.executable, "-c", driver, str(WORKER_DIR)], capture_output=True, text=True, env=env,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"rc": 0, "ended": True, "after": True}
