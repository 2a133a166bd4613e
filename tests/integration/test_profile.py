"""`tpurun profile`: a detached, unmodified JAX script on an emulated 2-host pod captured by its own runtime's
profiler server on every host at once, into one session directory whose files xprof itself opens and which hold
the script's jitted function; one host alone (`--worker`); a hung job (its step stuck, as in a collective whose
peer never comes) profiled all the same; a job that ended, an unknown job and a bad duration each said in one
line; a torch_xla script captured the same way."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import create_node, delete_every_tpu, popen, read_until
from tests.integration.conftest import Cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# Nothing of tpurun or of a profiler in it: each host steps its own jitted function until it is stopped (a few
# hundred steps a second, not as fast as it can: two such hosts would take both of the suite's cores).
LOOP = """\
import time
import jax, jax.numpy as jnp

@jax.jit
def tpurun_profiled_step(x):
    return jnp.tanh(x @ x) * 0.5

x = jnp.ones((128, 128))
print("stepping", flush=True)
while True:
    x = tpurun_profiled_step(x).block_until_ready()
    time.sleep(0.002)
"""
# Nothing of tpurun either: a few steps, then a step that never returns (its callback waits forever, as a collective
# waits for a peer that never comes), so no work runs while it is captured.
HUNG = """\
import threading
import jax, jax.numpy as jnp

@jax.jit
def tpurun_profiled_step(x):
    return jnp.tanh(x @ x) * 0.5

def stuck(y):
    print("hanging", flush=True)
    threading.Event().wait()
    return y

@jax.jit
def tpurun_hung_step(x):
    y = tpurun_profiled_step(x)
    return jax.pure_callback(stuck, jax.ShapeDtypeStruct(y.shape, y.dtype), y)

x = jnp.ones((128, 128))
for _ in range(3):
    x = tpurun_profiled_step(x).block_until_ready()
tpurun_hung_step(x).block_until_ready()
"""
END = "print('done', flush=True)\n"
# torch_xla on CPU, nothing of tpurun or a profiler in it either: one process per host stepping until stopped
XLA_LOOP = """\
import time
import torch, torch_xla, torch_xla.core.xla_model as xm

x = torch.ones(128, 128, device=torch_xla.device())
print("stepping", flush=True)
while True:
    x = torch.tanh(x @ x) * 0.5
    xm.mark_step()
    time.sleep(0.002)
"""


@pytest.fixture(scope="module")
def pod(emulator, tmp_path_factory) -> Iterator[Cli]:
    """One v4-16 (two hosts) the tests share, with the looping script running detached on both."""
    cli = Cli.under(tmp_path_factory.mktemp("profile"), emulator)
    (cli.cwd / "loop.py").write_text(LOOP)
    (cli.cwd / "hung.py").write_text(HUNG)
    (cli.cwd / "end.py").write_text(END)
    (cli.cwd / "xla_loop.py").write_text(XLA_LOOP)
    try:
        create_node(cli, "prof", "v4-16")
        yield cli
    finally:
        delete_every_tpu(emulator)


def _detached(pod: Cli, script: str, line: str) -> Iterator[str]:
    """SCRIPT started detached on both hosts, the job's id given once each host's process has printed LINE;
    cancelled after."""
    r = pod("train", script, "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    follow = popen(pod, "--plain", "logs", job, "--follow")
    try:
        read_until(follow, lambda lines: sum(line in x for x in lines) == 2, timeout=180)
    finally:
        follow.kill()
        follow.wait()
    try:
        yield job
    finally:
        assert pod("cancel", job).code == 0


@pytest.fixture
def looping(pod) -> Iterator[str]:
    yield from _detached(pod, "loop.py", "stepping")


@pytest.fixture
def hung(pod) -> Iterator[str]:
    yield from _detached(pod, "hung.py", "hanging")


def _events(path: Path) -> str:
    """The trace xprof itself makes of a capture file, as its trace viewer reads it."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([str(path)], "trace_viewer@", {})
    return data.decode() if isinstance(data, bytes) else data


def _modules(path: Path, tmp: Path) -> dict[str, str]:
    """The XLA modules xprof itself finds in a capture file (as its graph and memory viewers list them), each with
    its memory viewer's page of it; read from a copy, as xprof writes its module files beside the capture."""
    from xprof.convert import raw_to_tool_data

    tmp.mkdir()
    copy = tmp / path.name
    shutil.copy(path, copy)
    raw_to_tool_data.xspace_to_tool_names([str(copy)])
    names = [f.name.removesuffix(".hlo_proto.pb") for f in tmp.glob("*.hlo_proto.pb")]
    pages = {
        n: raw_to_tool_data.xspace_to_tool_data([str(copy)], "memory_viewer", {"module_name": n})[0] for n in names
    }
    return {n: p.decode() if isinstance(p, bytes) else p for n, p in pages.items()}


def test_every_host_is_captured_at_once_into_one_session_xprof_opens(pod, looping):
    started = time.monotonic()
    r = pod("profile", looping, "--duration", "1s", "--out", "prof", "--json")
    took = time.monotonic() - started
    assert r.code == 0, (r.out, r.err)
    got = json.loads(r.out)
    session = pod.cwd / got["session"]  # relative to where tpurun ran, as given
    assert session.parent == pod.cwd / "prof" / "plugins" / "profile"
    assert sorted(p.name for p in session.iterdir()) == ["w0.xplane.pb", "w1.xplane.pb"]
    assert [f["process"] for f in got["files"]] == ["w0", "w1"] and got["missing"] == {} and got["late"] == {}
    assert got["bytes"] == sum(f.stat().st_size for f in session.iterdir())
    for f in sorted(session.glob("*.xplane.pb")):
        assert "PjitFunction(tpurun_profiled_step)" in _events(f), f
    assert "open it with: xprof --logdir prof  (or: tensorboard --logdir prof)" in r.err
    print(f"profile of 2 hosts, 1 s each: {took:.1f} s, {got['bytes'] / 1e6:.1f} MB")

    # one host alone, into the default directory, said in words
    r = pod("--plain", "profile", looping, "--duration", "500ms", "--worker", "1")
    assert r.code == 0, (r.out, r.err)
    (row,) = r.out.splitlines()
    process, _, path = row.split("\t")
    assert process == "w1" and Path(pod.cwd, path).name == "w1.xplane.pb", row
    assert Path(pod.cwd, path).parent.parent.parent.parent == pod.cwd / "tpurun-profiles" / looping
    assert "open it with: xprof --logdir" in r.err


def test_a_torch_xla_job_is_captured_by_its_own_server_on_every_host(pod):
    jobs = _detached(pod, "xla_loop.py", "stepping")
    job = next(jobs)
    try:
        r = pod("profile", job, "--duration", "1s", "--out", "xla", "--json")
        assert r.code == 0, (r.out, r.err)
        got = json.loads(r.out)
        session = pod.cwd / got["session"]
        assert sorted(p.name for p in session.iterdir()) == ["w0.xplane.pb", "w1.xplane.pb"], got
        for f in sorted(session.glob("*.xplane.pb")):
            assert "ExecuteComputation" in _events(f), f  # torch_xla's PJRT client ran the step while captured
    finally:
        next(jobs, None)


def test_a_hung_job_is_profiled_from_every_host(pod, hung, tmp_path):
    """Every host's step is stuck: the servers answer all the same, with no trace events (nothing ran), and each
    file holds the modules the process compiled, its stuck step's among them, which xprof's viewers open."""
    started = time.monotonic()
    r = pod("profile", hung, "--duration", "500ms", "--out", "hung", "--json")
    took = time.monotonic() - started
    assert r.code == 0, (r.out, r.err)
    got = json.loads(r.out)
    session = pod.cwd / got["session"]
    assert sorted(p.name for p in session.iterdir()) == ["w0.xplane.pb", "w1.xplane.pb"]
    assert got["missing"] == {} and got["errors"] == {}, got
    for f in sorted(session.glob("*.xplane.pb")):
        assert "PjitFunction" not in _events(f), f  # nothing stepped while it was captured
        modules = _modules(f, tmp_path / f.stem)
        (stuck,) = [n for n in modules if n.startswith("jit_tpurun_hung_step(")]
        assert "jit(tpurun_hung_step)/jit(tpurun_profiled_step)" in modules[stuck], (f, stuck)
    print(f"profile of a hung job, 2 hosts, 500 ms each: {took:.1f} s, {got['bytes'] / 1e3:.0f} kB")


def test_an_ended_job_an_unknown_one_and_a_bad_duration_are_said_in_one_line(pod):
    r = pod("train", "end.py", "--runtime", "cpu", "--launch", "host", "--json")
    assert r.code == 0, r.err
    job = json.loads(r.out)["job_id"]
    r = pod("profile", job, "--duration", "1s")
    assert r.code == 2 and r.out == "", (r.out, r.err)
    assert r.err.strip().splitlines() == [f"error: job {job} has ended (finished): there is nothing to profile"], r.err

    r = pod("profile", "no-such-job")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and "unknown job 'no-such-job'" in r.err, r.err

    for bad in ("0s", "soon", "20m"):
        r = pod("profile", job, "--duration", bad)
        assert r.code == 2 and r.err.strip().splitlines() == [
            f"error: --duration {bad}: use e.g. 3s, 1.5s or 500ms (from 10ms to 600s)"
        ], r.err
    r = pod("profile", job, "--out", "gs://bucket/x")
    assert r.code == 2 and "a bucket is not written to" in r.err and len(r.err.strip().splitlines()) == 1, r.err
