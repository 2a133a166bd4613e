"""`tpurun stacks` on one worker, through the real agent: who is asked, who is never signalled, what each reader
gives; and how tpurun groups and words what the agents answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_agent import RUN, agent, home, script, start  # noqa: F401  (home: fixture)
from tpurun import config
from tpurun.job import stacks
from tpurun.worker import protocol, protocol_calls

# The main thread blocks in C (a lock it already holds), a thread sleeps, a forked child sleeps, a child runs
# Python without tpurun's hook (-I ignores PYTHONPATH), another replaces itself with a program (exec) after
# the hook registered: the last two must never get the signal, whose default action would end them.
STUCK = """
    import os, subprocess, sys, threading, time
    threading.Thread(target=lambda: time.sleep(600), name="napper", daemon=True).start()
    lock = threading.Lock()
    lock.acquire()
    if os.fork() == 0:
        time.sleep(600)
    plain = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(600)"])
    execd = subprocess.Popen([sys.executable, "-c", "import os; os.execv('/bin/sleep', ['sleep', '600'])"])
    print("ready", plain.pid, execd.pid, flush=True)
    lock.acquire()
"""


def _line(text: str) -> int:
    """The line of STUCK (as the agent's test helper writes it: dedented) that holds TEXT."""
    import textwrap

    return next(i for i, x in enumerate(textwrap.dedent(STUCK).splitlines(), 1) if text in x)


def _ready(home_dir: Path, job: str) -> tuple[int, int]:
    log = home_dir / ".tpurun" / "jobs" / job / "w0-c0.log"
    deadline = time.time() + 60
    while time.time() < deadline:
        if log.exists() and log.read_text().startswith("ready"):
            _, plain, execd = log.read_text().split()[:3]
            time.sleep(0.5)  # the exec'd child has become sleep
            return int(plain), int(execd)
        time.sleep(0.05)
    raise AssertionError("the job never got ready")


def _ask(home_dir: Path, job: str, path: str) -> list[protocol_calls.ProcessStack]:
    r = subprocess.run(
        [sys.executable, str(Path(protocol.__file__).with_name("agent.py")), "stacks", job],
        capture_output=True,
        text=True,
        env=dict(os.environ, HOME=str(home_dir), PATH=path),
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return [protocol_calls.ProcessStack.from_dict(p) for p in json.loads(r.stdout)]


def _main(ps: protocol_calls.ProcessStack) -> list[list]:
    return next(t for t in ps.threads if t.main).frames


def test_every_hooked_process_answers_and_no_other_is_signalled(home: Path, tmp_path: Path) -> None:  # noqa: F811
    p = script(tmp_path, "stuck.py", STUCK)
    job = f"st1-{RUN}"
    start(home, job, [{"core": 0, "argv": [sys.executable, p], "env": {}}], launch="chip")
    plain, execd = _ready(home, job)
    try:
        no_spy = ":".join(d for d in os.environ["PATH"].split(":") if not (Path(d) / "py-spy").exists())
        found = {ps.pid: ps for ps in _ask(home, job, no_spy)}
        main = next(ps for ps in found.values() if ps.slot == 0 and not ps.child)
        assert main.source is protocol_calls.StackSource.FAULTHANDLER
        # blocked in C, read all the same; and its other thread
        assert _main(main)[0][1:] == [_line("print(") + 1, "<module>", "lock.acquire()"]
        assert any(t.frames and t.frames[0][1] == _line("napper") for t in main.threads if not t.main)
        forked = [ps for ps in found.values() if ps.child and ps.source is protocol_calls.StackSource.FAULTHANDLER]
        assert [_main(ps)[0][1] for ps in forked] == [_line("os.fork") + 1]  # the forked child, its own file
        for pid in (plain, execd):
            assert found[pid].source is protocol_calls.StackSource.NONE and found[pid].why.startswith(
                "no stacks handler"
            )
            os.kill(pid, 0)  # still alive: never sent the signal
        assert "exec" in found[execd].why
    finally:
        agent(home, "stop", job, "--grace", "1")


def _py_spy() -> Path:
    """py-spy, which scripts/test installs off PATH (TPURUN_TEST_PY_SPY), or the one on PATH."""
    found = config.TEST_PY_SPY.raw() or shutil.which("py-spy") or ""
    if not os.access(found, os.X_OK):
        if config.REQUIRE_EMULATOR.on():  # scripts/test: what it installs must be there
            pytest.fail(f"no py-spy at {found!r}")
        pytest.skip("no py-spy here (scripts/test installs one)")
    return Path(found)


def test_py_spy_reads_every_process_with_its_native_frames(home: Path, tmp_path: Path) -> None:  # noqa: F811
    spy = _py_spy()
    p = script(tmp_path, "stuck.py", STUCK)
    job = f"st2-{RUN}"
    start(home, job, [{"core": 0, "argv": [sys.executable, p], "env": {}}], launch="chip")
    plain, _ = _ready(home, job)
    try:
        found = {ps.pid: ps for ps in _ask(home, job, f"{spy.parent}:{os.environ['PATH']}")}
        main = next(ps for ps in found.values() if ps.slot == 0 and not ps.child)
        assert main.source is protocol_calls.StackSource.PY_SPY
        frames = _main(main)
        assert [f[1:3] for f in frames if f[1]][0] == [_line("print(") + 1, "<module>"]
        assert any(f[1] == 0 for f in frames)  # native frames (the lock's wait in C)
        assert found[plain].source is protocol_calls.StackSource.PY_SPY  # from outside: no hook needed
        os.kill(plain, 0)
    finally:
        agent(home, "stop", job, "--grace", "1")


# ---------------------------------------------------------------- grouping and words


def _proc(worker: int, slot: int | None, frames: list[list], child: bool = False, pid: int = 1) -> stacks.Process:
    ps = protocol_calls.ProcessStack(
        pid, 0, slot, child, "python3 train.py", "/home/u/proj", protocol_calls.StackSource.FAULTHANDLER,
        [protocol_calls.ThreadStack("0x1", True, frames)],
    )  # fmt: skip
    name = f"w{worker}" if slot == protocol.HOST else f"w{worker}/c{slot}"
    return stacks.Process(worker, name + (f"+{pid}" if child else ""), ps)


REDUCE = [
    ["/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", 2942, "all_reduce", "work.wait()"],
    ["/home/u/proj/train.py", 88, "step", "dist.all_reduce(t)"],
    ["/home/u/proj/train.py", 120, "<module>", "step()"],
]
SLEEP = [["/home/u/proj/data.py", 40, "load", "time.sleep(60)"], ["/home/u/proj/train.py", 120, "<module>", "step()"]]


def test_the_odd_one_comes_first_and_each_group_says_where_in_the_scripts_words(tmp_path: Path) -> None:
    procs = [_proc(w, c, REDUCE) for w in range(8) for c in range(4) if (w, c) != (5, 2)]
    procs.append(_proc(5, 2, SLEEP))
    procs.append(protocol_less := _proc(5, 2, [], child=True, pid=77))
    protocol_less.stack.threads, protocol_less.stack.why = [], "no stacks handler: not a Python process"
    got = stacks.group("job1", procs, tmp_path)
    assert got.summary() == "w5/c2 at data.py:40 (time.sleep(60)) · 31 processes in all_reduce at train.py:88"
    assert [p.name for p in got.unread] == ["w5/c2+77"]
    text = got.path.read_text()
    assert text.count("== w") == 33 and "-- read by faulthandler" in text
    data = got.to_json()
    assert data["groups"][0]["processes"] == ["w5/c2"] and len(data["groups"][1]["processes"]) == 31
    assert data["unread"] == [{"process": "w5/c2+77", "why": "no stacks handler: not a Python process"}]


def test_a_stack_outside_the_script_names_the_library_file() -> None:
    g = stacks.Group([stacks.Frame("/usr/lib/python3.11/threading.py", 320, "wait", "waiter.acquire()")])
    assert g.where("/home/u/proj") == "in wait (threading.py:320)"
    assert stacks.Group([]).where("/home/u/proj") == "in no Python frame"


def test_the_stacks_signal_does_nothing_to_a_process_without_a_handler() -> None:
    # should a process exec between the agent's check and its signal, nothing happens to it
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        os.kill(sleeper.pid, protocol.STACKS_SIGNAL)
        time.sleep(0.2)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
