"""Shared test helpers: run the real `tpurun` entry point in a subprocess."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    code: int
    out: str
    err: str


def python38() -> str | None:
    """A working python3.8 (the oldest Python the agent promises to run on), if this machine has one."""
    for cand in [*glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")), shutil.which("python3.8")]:
        if cand and subprocess.run([cand, "-c", "pass"], capture_output=True).returncode == 0:
            return cand
    return None


PY38 = python38()


def tpurun(
    *args: str,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    input: str | None = None,
) -> Result:
    full_env = dict(os.environ)
    full_env.pop("TPURUN_TPU", None)
    if env:
        full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "tpurun", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_clean_error(r: Result, code: int = 2) -> None:
    """One clear line on stderr, the right exit code, and never a traceback."""
    assert r.code == code, (r.code, r.out, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    assert r.err.strip(), "an error must say something on stderr"


def create_node(cli, name: str, accel: str = "v4-16", *extra: str) -> dict:
    """`tpurun create NAME -t ACCEL --json` through the CLI fixture; the node as JSON."""
    r = cli("create", name, "-t", accel, "--json", *extra)
    assert r.code == 0, r.err
    return json.loads(r.out)


def lines_by_core(out: str) -> dict[tuple[int, int], list[str]]:
    """`[wN/cM] line` output grouped by (worker, core), in order."""
    found: dict[tuple[int, int], list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^\[w(\d+)/c(\d+)\] (.*)$", line)
        if m:
            found.setdefault((int(m.group(1)), int(m.group(2))), []).append(m.group(3))
    return found


def job_pids(emulator, node: str, needle: str, workers: list[int] | None = None) -> list[int]:
    """Processes in the emulated workers' own pid namespaces whose command line contains NEEDLE."""
    name = emulator.node_name(node)
    if workers is None:
        workers = list(range(len(emulator.node_info(name)["workers"])))
    return pids_in(emulator, name, workers, needle)


def pids_in(emulator, hosts_key: str, workers: list[int], needle: str) -> list[int]:
    """Processes whose command line contains NEEDLE in the namespaces of WORKERS of the emulator's hosts
    HOSTS_KEY (a node's name, or a Compute Engine group's or VM's path)."""
    pids = []
    for w in workers:
        for pid in emulator.emu.hosts.worker_root_pids(hosts_key, w):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                pids.append(pid)
    return pids


def popen(tp, *args: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> subprocess.Popen:
    """`tpurun ARGS` in the background with TP's (the `cli` fixture's) cwd and env; text pipes."""
    env = {**os.environ, **tp.env}
    env.pop("TPURUN_TPU", None)
    return subprocess.Popen(
        [sys.executable, "-m", "tpurun", *args],
        cwd=tp.cwd, env=env, stdout=stdout, stderr=stderr, text=True,
    )  # fmt: skip


def read_until(proc: subprocess.Popen, predicate, timeout: float = 60) -> list[str]:
    """Lines of PROC's stdout until PREDICATE(lines) holds."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not predicate(lines):
        assert time.monotonic() < deadline, lines
        line = proc.stdout.readline()
        assert line, (lines, proc.stderr.read() if proc.stderr else "")
        lines.append(line.rstrip("\n"))
    return lines


def python_up(code: str, *args: str) -> subprocess.Popen:
    """`python -c CODE ARGS` in the background (not tpurun: a fake TPU holder, a stand-in emulator), returned
    once its first line is `up`, CODE's sign that it is ready; killed if that line never comes."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    try:
        first = read_until(proc, lambda lines: len(lines) == 1)
        assert first == ["up"], first
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """The rest of PROC's stdout and stderr once it exits (through its buffered readers: never
    `communicate()` after `readline()`, which would skip what the reader already buffered)."""
    import threading

    box: dict[str, str] = {}
    t = threading.Thread(target=lambda: box.setdefault("err", proc.stderr.read() if proc.stderr else ""))
    t.start()
    out = proc.stdout.read() if proc.stdout else ""
    proc.wait(timeout=timeout)
    t.join(timeout)
    return out, box.get("err", "")


def calls_since(emulator, before: int) -> list[dict]:
    """The API requests made since BEFORE, except reads of operations: a command that asked for nothing
    has no operation to read, while an earlier test's operation may still be polled to its end meanwhile."""
    return [r for r in emulator.requests(before) if not (r["method"] == "GET" and "/operations/" in r["path"])]


def by_tag(out: str) -> dict[str, list[str]]:
    """OUT's lines by their tag: {"w0": [...], "s1/w0": [...]} for lines `[w0] text`."""
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^\[([^\]]+)\] (.*)$", line)
        if m:
            found.setdefault(m.group(1), []).append(m.group(2))
    return found


def delete_every_tpu(emulator, keep: frozenset[str] = frozenset()) -> None:
    """A test's clean-up: every queued resource and node in every zone of the emulator deleted, waited for
    (one already being deleted is left to finish); the nodes and queued resources named in KEEP (full names),
    and the nodes of those queued resources, are left."""
    from tpurun.emulator.pytest_plugin import fast_polling

    client = emulator.client()
    ops = []
    for qr in list(client.list_queued_resources(parent=emulator.parent)):
        if qr.name in keep:
            continue
        try:
            ops.append(client.delete_queued_resource(request={"name": qr.name, "force": True}))
        except Exception:
            pass  # already being deleted
    every_zone = emulator.parent.rsplit("/", 1)[0] + "/-"  # tests make TPUs in other zones too
    for node in list(client.list_nodes(parent=every_zone)):
        if node.name in keep or node.queued_resource in keep:
            continue
        try:
            ops.append(client.delete_node(name=node.name))
        except Exception:
            pass  # already being deleted
    for op in ops:
        try:
            op.result(polling=fast_polling())
        except Exception:
            pass


# A job that runs until it is stopped, each worker's process saying so twice a second, in a function of its own
# (`tpurun stacks` finds its main thread there); first it writes who and where it is to ~/loop.txt (for download).
LOOP = """import getpass, os, socket, time
with open(os.path.expanduser("~/loop.txt"), "w") as f:
    f.write(getpass.getuser() + " " + socket.gethostname())
def wait_here(w):
    while True:
        print("tick", w, flush=True)
        time.sleep(0.5)
wait_here(os.environ["TPURUN_WORKER_ID"])
"""


def detached_loop(cli, workers: int, *flags: str) -> str:
    """LOOP started detached on the default TPU (with FLAGS), returned once each of its WORKERS has ticked
    (as `logs` shows it): the job's id."""
    (cli.cwd / "loop.py").write_text(LOOP)
    r = cli("train", *flags, "loop.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    deadline = time.monotonic() + 90
    while len({line.split()[0] for line in cli("logs", *flags, job).out.splitlines() if " tick " in line}) < workers:
        assert time.monotonic() < deadline, cli("logs", *flags, job)
        time.sleep(0.2)
    return job


def autostop_starts_the_watchdogs(cli, emulator, node: str, workers: int) -> None:
    """`tpurun autostop` on the TPU NODE (its full name) as on a TPU tpurun did not make: its startup script
    someone else's (so its boot starts no watchdog) and no watchdog running on its WORKERS. autostop starts
    one on each over SSH; then it is turned off again and the script given back."""
    from tpurun.emulator.pytest_plugin import fast_polling

    client, name, tpu = emulator.client(), node.rsplit("/", 1)[-1], list(range(workers))
    made = client.get_node(name=node)
    script = made.metadata["startup-script"]
    made.metadata["startup-script"] = "#!/bin/bash\necho made by someone else\n"
    client.update_node(node=made, update_mask="metadata").result(polling=fast_polling())
    try:
        for pid in pids_in(emulator, node, tpu, "watchdog.py run"):
            os.kill(pid, 9)
        deadline = time.monotonic() + 30
        while pids_in(emulator, node, tpu, "watchdog.py run"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = cli("autostop", name, "1h")
        assert r.code == 0, r.err
        assert f"{name}: starting the watchdog on every worker" in r.err, r.err
        running = [w for w in tpu if pids_in(emulator, node, [w], "watchdog.py run")]
        assert running == tpu, running  # `ensure` returns once it runs
        r = cli("autostop", name, "off")
        assert r.code == 0, r.err
    finally:
        now = client.get_node(name=node)
        now.metadata["startup-script"] = script
        client.update_node(node=now, update_mask="metadata").result(polling=fast_polling())
