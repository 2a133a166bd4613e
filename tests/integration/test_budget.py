"""`--budget USD` through the real CLI on emulated TPUs with real sshd workers: `train --budget` stops the job on
every worker's own supervisor when its TPU's price has spent the money (attached or detached, the client gone),
its end `budget` and exit 125 in `train`, `jobs --json` and `logs`, nothing left running; `create --budget` has
the TPU's own watchdog delete it when its price has spent the money, no client running; bad input is one line
and exit 2, before anything is made or started.

The budgets are cents: a v5litepod-16 at $1.20 a chip-hour costs $19.20 an hour, so $0.03 lasts 5.6 s."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator

import pytest

from tests.helpers import assert_clean_error, create_node, delete_every_tpu, pids_in
from tests.integration.conftest import Cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ZONE = "us-central1-a"  # where a v5litepod has a published price (the emulator's default zone has none)
PER_HOUR = 16 * 1.20  # a v5litepod-16: 16 chips at the published $1.20 per chip-hour in us-central1
BUDGET = 0.03
SECONDS = BUDGET / PER_HOUR * 3600  # 5.6 s
FOREVER = (
    "import os, time\n"
    "print('started', time.time(), 'w' + os.environ['TPURUN_WORKER_ID'], flush=True)\n"
    "while True:\n"
    "    time.sleep(0.2)\n"
)
TRAIN = ("train", "forever.py", "--runtime", "cpu", "--launch", "host", "--grace", "1")


@pytest.fixture(scope="module")
def pod(emulator, tmp_path_factory) -> Iterator[Cli]:
    """One v5litepod-16 (4 workers) the train tests share; the script that runs until it is stopped."""
    cli = Cli.under(tmp_path_factory.mktemp("budget"), emulator)
    cli.env["TPURUN_ZONE"] = ZONE
    (cli.cwd / "forever.py").write_text(FOREVER)
    try:
        create_node(cli, "spend", "v5litepod-16")
        yield cli
    finally:
        delete_every_tpu(emulator)


def _left(emulator, node: str = "spend") -> list[int]:
    """The script's processes on every worker of NODE."""
    name = f"projects/{emulator.project}/locations/{ZONE}/nodes/{node}"
    return pids_in(emulator, name, list(range(len(emulator.node_info(name)["workers"]))), "forever.py")


def _row(cli: Cli, job: str) -> dict:
    return next(j for j in json.loads(cli("jobs", "--json").out) if j["job_id"] == job)


def test_train_budget_stops_the_job_on_every_worker_when_spent(pod, emulator):
    before = time.time()
    r = pod("--plain", *TRAIN, "--budget", str(BUDGET), timeout=120)
    ended = time.time()
    assert r.code == 125, (r.out[-2000:], r.err[-2000:])
    starts = [float(line.split()[2]) for line in r.out.splitlines() if " started " in line]
    assert len(starts) == 4, r.out  # every worker's process ran
    # its budget's time, no less (the clock starts with the job), and stopped within seconds of it
    assert SECONDS - 1 <= ended - before, (ended - before, r.err)
    assert ended - min(starts) <= SECONDS + 6, (ended - min(starts), r.err)
    assert r.err.count(" price as of ") == 1, r.err  # where the price came from, said once
    assert "--budget $0.03: 5s of spend at $19.20/h" in r.err, r.err
    assert "the job's --budget is spent" in r.err and "failed" not in r.err, r.err
    assert "its --budget of $0.03 was spent" in r.err, r.err
    assert _left(emulator) == []  # nothing left on any worker
    job = next(j["job_id"] for j in json.loads(pod("jobs", "--json").out))
    row = _row(pod, job)
    assert (row["end"], row["exit_code"]) == ("budget", 125), row
    r = pod("logs", job, "--follow")  # ended: its end, and train's exit code
    assert r.code == 125 and "ended (budget): its --budget was spent; it was stopped" in r.err, r.err


def test_a_detached_job_is_stopped_at_its_budget_with_no_client(pod, emulator):
    r = pod(*TRAIN, "--detach", "--budget", str(BUDGET))
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    assert _left(emulator) != []  # it runs, and no tpurun does
    deadline = time.monotonic() + 60
    while _left(emulator):  # stopped on every worker (seen there, not through a CLI start a poll)
        assert time.monotonic() < deadline, _left(emulator)
        time.sleep(0.1)
    while (row := _row(pod, job))["end"] is None:  # its supervisors' word on how it ended, once they wrote it
        assert time.monotonic() < deadline, row
        time.sleep(0.2)
    assert (row["end"], row["exit_code"]) == ("budget", 125), row
    assert _left(emulator) == []


def _nodes(emulator) -> list[str]:
    where = f"projects/{emulator.project}/locations/{ZONE}"
    return [n.name.rsplit("/", 1)[-1] for n in emulator.client().list_nodes(parent=where)]


def test_bad_budget_is_one_line_and_exit_2_before_anything(pod, emulator):
    records = sorted((pod.tpurun_home / "jobs").glob("*.json"))
    for bad in ("-1", "abc", "0", "1e3"):
        for r in (pod(*TRAIN, "--budget", bad), pod("create", "never", "-t", "v5litepod-4", "--budget", bad)):
            assert_clean_error(r)
            assert len(r.err.strip().splitlines()) == 1 and f"--budget {bad}" in r.err, r.err
    assert sorted((pod.tpurun_home / "jobs").glob("*.json")) == records  # nothing started
    assert _nodes(emulator) == ["spend"]  # nothing created


def _gone_within(emulator, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while name in _nodes(emulator):
        assert time.monotonic() < deadline, f"{name} still exists after {timeout} s"
        time.sleep(0.2)


def test_create_budget_deletes_the_tpu_through_its_watchdog_while_a_job_runs(pod, emulator):
    cli = Cli(pod.cwd, pod.home, {**pod.env, "TPURUN_WATCHDOG_TICK": "0.5"}, emulator)
    before = len(emulator.requests())
    asked = time.time()
    r = cli("create", "cheap", "-t", "v5litepod-8", "--budget", "0.05")  # $9.60/h: 18.75 s
    life = 0.05 / 9.60 * 3600
    assert r.code == 0, r.err
    assert "cheap: --budget $0.05, deletes it at " in r.err and "$9.60/h, catalog price as of " in r.err, r.err
    budget = json.loads(cli("describe", "cheap", "--json").out)["budget"]
    assert budget["usd"] == 0.05 and abs(dt.datetime.fromisoformat(budget["deleteAt"]).timestamp() - asked - life) < 5
    r = cli(*TRAIN, "--tpu", "cheap", "--detach")  # a job does not keep it: the budget outranks it
    assert r.code == 0, r.err
    _gone_within(emulator, "cheap", 90)
    gone = time.time()
    assert life - 1 <= gone - asked <= life + 15, gone - asked
    calls = [c for c in emulator.requests(before) if c["method"] == "DELETE" and c["path"].endswith("/nodes/cheap")]
    assert calls and calls[0]["status"] == 200 and calls[0]["caller"].startswith("vm:"), calls  # its own watchdog


def test_a_tpu_with_no_published_price_refuses_a_budget(pod, emulator):
    r = pod("create", "free", "-t", "v4-8", "--budget", "1")  # v4 is priced in us-central2 alone
    assert_clean_error(r)
    assert "v4-8 has no published price in us-central1-a" in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert "free" not in _nodes(emulator)


def test_time_stopped_does_not_count_against_a_create_budget(pod, emulator):
    def budget() -> dict:
        return json.loads(pod("describe", "pause", "--json").out)["budget"]

    assert pod("create", "pause", "-t", "v5litepod-8", "--budget", "1").code == 0  # $9.60/h: 6m15s
    first = dt.datetime.fromisoformat(budget()["deleteAt"]).timestamp()
    asked = time.time()
    r = pod("stop", "pause")
    assert r.code == 0, r.err
    done, stopped = time.time(), budget()
    assert stopped["deleteAt"] is None and first - done - 1 <= stopped["secondsLeft"] <= first - asked + 1, stopped
    r = pod("start", "pause")
    assert r.code == 0, r.err
    before = time.time()
    started = budget()
    after = time.time()
    again = dt.datetime.fromisoformat(started["deleteAt"]).timestamp()
    # the clock went on from where the stop left it: later by the time it was stopped, not before; what describe
    # says is left is the deadline seen from when it looked (bounded by the moments around its call)
    assert again - first >= 1, (first, again, started)
    assert again - after - 1 <= started["secondsLeft"] <= again - before + 1, (before, after, again, started)
    assert "left once started" not in pod("describe", "pause").out
