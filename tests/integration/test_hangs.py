"""When a pod job hangs, tpurun says which host and where, on emulated pods with the runtimes' own code: the
rendezvous watch (jax.distributed with one host late on purpose), `--hang-timeout` and `tpurun stacks` (torch
gloo with one rank that never reaches all_reduce), and one host of a pod run alone (`--worker`)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import by_tag, create_node, finish, job_pids, popen, read_until
from tests.integration.test_compute import PROBE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Worker 2 arrives late at jax.distributed.initialize; the others wait there for it (jax's own coordinator).
# It comes once the test has seen it named everywhere (the file `go` beside the script, which the test makes
# on worker 2), at the latest after DAWDLE seconds.
LATE_JAX = """\
import os, time
import jax

if os.environ["TPURUN_WORKER_ID"] == "2":
    print("worker 2 dawdles before initialize", flush=True)
    go = os.path.join(os.path.dirname(os.path.abspath(__file__)), "go")
    deadline = time.monotonic() + float(os.environ["DAWDLE"])
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.1)
jax.distributed.initialize()
print("joined as process", jax.process_index(), "of", jax.process_count(), flush=True)
"""


def test_a_host_late_at_jax_distributed_initialize_is_named_while_the_others_wait(cli):
    d = create_node(cli, "hang", "v4-32")
    addresses = [ep["internalIp"] for ep in d["workerEndpoints"]]
    assert len(addresses) == 4
    (cli.cwd / "late.py").write_text(LATE_JAX)
    train = popen(
        cli, "--plain", "train", "late.py", "--runtime", "cpu", "--launch", "host", "--env", "DAWDLE=150",
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
        go = subprocess.run(cli.ssh(addresses[2], f"touch {cli.cwd.name}/go"), capture_output=True, text=True)
        assert go.returncode == 0, go.stderr  # worker 2 may come now
        out, _ = finish(follow, timeout=180)
        assert "no longer waiting at jax.distributed.initialize" in out

        out, _ = finish(train, timeout=180)
    finally:
        if train.poll() is None:
            train.kill()
    lines += out.splitlines()
    assert train.returncode == 0, lines[-30:]
    assert sorted(x.split()[0] for x in lines if "] joined as process" in x) == ["[w0]", "[w1]", "[w2]", "[w3]"]
    assert any("no longer waiting at jax.distributed.initialize" in x for x in lines)


# One rank never reaches all_reduce: the others wait in it (gloo, blocked in C++). Run once per chip
# (--launch chip: torchrun's variables), or once per host with torch.multiprocessing.spawn making 2 ranks
# per host (the processes a script's spawner makes, which the hook follows).
STUCK_RANK = """\
import os, sys, time
import torch
import torch.distributed as dist


def rank_main(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    print("rank", rank, "joined", flush=True)
    if rank == world - 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)


def spawned(i, w, n):
    rank_main(2 * w + i, 2 * n)


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        import torch.multiprocessing as mp

        w, n = int(os.environ["TPURUN_WORKER_ID"]), int(os.environ["TPURUN_NUM_WORKERS"])
        mp.spawn(spawned, args=(w, n), nprocs=2)
"""


SLEEP_AT = next(i for i, x in enumerate(STUCK_RANK.splitlines(), 1) if "time.sleep(3600)" in x)
REDUCE_AT = next(i for i, x in enumerate(STUCK_RANK.splitlines(), 1) if "dist.all_reduce(t)" in x)
ODD = f"w1/c1 at stuck.py:{SLEEP_AT} (time.sleep(3600))"
IN_REDUCE = f"3 processes in all_reduce at stuck.py:{REDUCE_AT}"


def test_a_rank_that_never_reaches_all_reduce_is_caught_and_its_stacks_say_where(cli, emulator):
    create_node(cli, "stuck", "v4-16")
    (cli.cwd / "stuck.py").write_text(STUCK_RANK)
    # attached, --on-hang stop: the stacks summary, exit 124, nothing left running
    r = cli(
        "--plain", "train", "stuck.py", "--runtime", "cpu", "--launch", "chip", "--cores", "2",
        "--hang-timeout", "15s", "--on-hang", "stop", timeout=300,
    )  # fmt: skip
    assert r.code == 124, (r.out[-2000:], r.err[-3000:])
    assert f"{ODD} · {IN_REDUCE}" in r.err.splitlines(), r.err[-3000:]
    assert "made no progress for 15s and was stopped (--on-hang stop)" in r.err
    assert job_pids(emulator, "stuck", "stuck.py") == []

    # detached, the ranks made by the script's spawner (torch.multiprocessing.spawn): `tpurun stacks` shows
    # the same, and each host process waiting for its two
    r = cli("train", "stuck.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = cli("--plain", "stacks", job)
        if r.code == 0 and IN_REDUCE in r.out:
            break
        time.sleep(2)
    summary = r.out.splitlines()[0]
    assert summary.startswith(f"{ODD} · 2 processes in ") and summary.endswith(f" · {IN_REDUCE}"), r.out
    data = json.loads(cli("stacks", job, "--json").out)
    groups = [sorted(g["processes"]) for g in data["groups"]]
    assert groups[0] == ["w1/c1"] and groups[-1] == ["w0/c0", "w0/c1", "w1/c0"], groups
    assert ["w0", "w1"] in groups  # each host process, waiting in torch.multiprocessing.spawn for its two
    dump = Path(data["dump"]).read_text()
    assert dump.count("== w") >= 6 and dump.count("thread 0x") >= 6  # every process, every thread, as read
    assert cli("cancel", job).code == 0
    assert job_pids(emulator, "stuck", "stuck.py") == []
    # the job has ended: said in one line on stderr, nothing on stdout but --json's document, not an error
    r = cli("stacks", job)
    assert (r.code, r.out) == (0, ""), (r.out, r.err)
    assert f"job {job} has no process left on the workers asked: it has ended" in r.err
    r = cli("stacks", job, "--json")
    assert r.code == 0 and json.loads(r.out)["groups"] == [], r.out


def _probe_of(r_out: str, tag: str) -> dict:
    """The JSON line a PROBE run printed on the worker tagged TAG (any of its processes)."""
    lines = [t for k, v in by_tag(r_out).items() if k.split("/")[0] == tag for t in v]
    return json.loads(next(t for t in lines if t.startswith("{")))


def test_one_host_of_a_pod_runs_as_the_single_host_slice_it_is(cli):
    """pytorch/xla #7714, jax #22436: a pod's host started alone waits for the others its metadata lists.
    `--worker 1` gives its runtimes one host's bounds, address and worker count, as torch_xla's own
    configure_topology and jax's own cluster detection read them on the emulated VM."""
    d = create_node(cli, "alone", "v4-16")
    addresses = [ep["internalIp"] for ep in d["workerEndpoints"]]
    (cli.cwd / "probe.py").write_text(
        PROBE.replace('os.environ["TPURUN_WORKER_ID"]', 'os.environ.get("TPURUN_WORKER_ID")')
    )

    r = cli("train", "probe.py", "--runtime", "pjrt", "--worker", "1", timeout=300)
    assert r.code == 0, r.err[-3000:]
    assert sorted({k.split("/")[0] for k in by_tag(r.out)}) == ["w1"]  # that host only, named as itself
    assert "w1 alone, as a v4-8 single-host slice (--worker)" in r.err
    seen = _probe_of(r.out, "w1")
    assert (seen["cluster"], seen["id"], seen["count"]) == ("gketpu", 0, 1), seen
    assert seen["coordinator"] == f"{addresses[1]}:8482"
    # (torch_xla names the one host of a single-host slice localhost, whatever the variable says)
    assert (seen["chips"], seen["local"], seen["worker_id"], seen["worker_ips"]) == (4, 4, 0, ["localhost"])
    assert seen["last"] == {"TPU_PROCESS_BOUNDS": "2,2,1", "CLOUD_TPU_TASK_ID": "3", "TPU_VISIBLE_CHIPS": "3"}

    # the same host as part of the pod: what its metadata says (2 hosts), which a host alone would wait on
    r = cli("train", "probe.py", "--runtime", "pjrt", timeout=300)
    assert r.code == 0, r.err[-3000:]
    whole = _probe_of(r.out, "w1")
    assert (whole["id"], whole["count"], whole["last"]["TPU_PROCESS_BOUNDS"]) == (1, 2, "2,2,2"), whole
    assert whole["last"]["CLOUD_TPU_TASK_ID"] == "7"

    # exec on that worker alone: the same single-host slice
    r = cli("exec", "--worker", "1", "--", "python3", f"{cli.cwd.name}/probe.py", timeout=300)  # train synced it
    assert r.code == 0, r.err[-3000:]
    assert "w1 alone: its runtime sees the v4-8 single-host slice it is on its own" in r.err
    got = json.loads(next(x.split(" ", 1)[1] for x in r.out.splitlines() if x.startswith("[w1] {")))
    assert (got["id"], got["count"], got["coordinator"], got["last"]) == (0, 1, seen["coordinator"], seen["last"]), got
