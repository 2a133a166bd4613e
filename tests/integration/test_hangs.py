"""When a pod job hangs, tpurun says which host and where: on an emulated 4-host pod, with the runtimes' own
rendezvous (jax.distributed over gloo on CPU), one host made late on purpose."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.helpers import create_node, finish, popen, read_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Worker 2 arrives late at jax.distributed.initialize; the others wait there for it (jax's own coordinator).
LATE_JAX = """\
import os, time
import jax

if os.environ["TPURUN_WORKER_ID"] == "2":
    print("worker 2 dawdles before initialize", flush=True)
    time.sleep(float(os.environ["DAWDLE"]))
jax.distributed.initialize()
print("joined as process", jax.process_index(), "of", jax.process_count(), flush=True)
"""


def test_a_host_late_at_jax_distributed_initialize_is_named_while_the_others_wait(cli):
    d = create_node(cli, "hang", "v4-32")
    addresses = [ep["internalIp"] for ep in d["workerEndpoints"]]
    assert len(addresses) == 4
    (cli.cwd / "late.py").write_text(LATE_JAX)
    train = popen(
        cli, "--plain", "train", "late.py", "--runtime", "cpu", "--launch", "host", "--env", "DAWDLE=45",
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        lines = read_until(train, lambda ls: any("dawdles" in x for x in ls), timeout=180)
        dawdling = time.monotonic()
        lines += read_until(train, lambda ls: any("waiting at jax.distributed.initialize" in x for x in ls))
        named = time.monotonic() - dawdling
        said = next(x for x in lines if "waiting at jax.distributed.initialize" in x)
        # the processes of w0, w1, w3 are in; w2 is named with its address and its last line
        assert "3 of 4 processes in" in said, said
        assert f"not there: w2 ({addresses[2]}), last line" in said and "'worker 2 dawdles before initialize'" in said
        assert named < 30, (named, lines)

        # `jobs` says the same, from the workers' own records
        (row,) = json.loads(cli("jobs", "--json").out)
        assert row["status"] == "running" and row["waiting"]["at"] == "jax.distributed.initialize", row
        assert [(m["name"], m["address"]) for m in row["waiting"]["missing"]] == [("w2", addresses[2])]
        assert "waiting at jax.distributed.initialize" in cli("jobs").out

        # and so does `logs --follow` (here on worker 2's own lines, for every worker's state)
        job = row["job_id"]
        follow = popen(cli, "--plain", "logs", job, "--follow", stderr=subprocess.STDOUT)
        seen = read_until(follow, lambda ls: any("waiting at jax.distributed.initialize" in x for x in ls))
        assert any(f"not there: w2 ({addresses[2]})" in x for x in seen), seen
        out, _ = finish(follow, timeout=180)
        assert "no longer waiting at jax.distributed.initialize" in out

        out, _ = finish(train, timeout=180)
    finally:
        if train.poll() is None:
            train.kill()
    lines += out.splitlines()
    assert train.returncode == 0, lines[-30:]
    assert sum("joined as process" in x for x in lines) == 4
    assert any("no longer waiting at jax.distributed.initialize" in x for x in lines)
