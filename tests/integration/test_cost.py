"""What a TPU costs, through the real CLI against the emulator (whose Billing Catalog google-cloud-billing reads):
its price and cost so far in `list` and `describe`, and `tpurun cost` after it is deleted."""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest

V4_CHIP_HOUR = 3.22  # the emulator's catalogue: v4 in us-central2, on demand (docs/cost.md)


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def since(text: str) -> float:
    return (now() - dt.datetime.fromisoformat(text.replace("Z", "+00:00"))).total_seconds()


@pytest.fixture(scope="module")
def made(emulator, tmp_path_factory):
    from tests.integration.conftest import Cli

    cli = Cli.under(tmp_path_factory.mktemp("cost"), emulator)
    assert cli("create", "priced", "-t", "v4-8").code == 0
    return cli


def test_list_and_describe_say_the_price_and_the_cost_so_far(made):
    before = now()
    (row,) = [t for t in json.loads(made("list", "--json").out) if t["name"] == "priced"]
    after = now()
    assert row["pricePerHour"] == pytest.approx(4 * V4_CHIP_HOUR)  # a v4-8 is 4 chips
    assert row["price"]["source"] == "catalog" and row["price"]["provisioning"] == "on-demand"
    created = dt.datetime.fromisoformat(row["createTime"].replace("Z", "+00:00"))
    hours = row["costSoFar"] / row["pricePerHour"]
    assert (before - created).total_seconds() - 1 <= hours * 3600 <= (after - created).total_seconds() + 1
    shown = made("describe", "priced", "--plain").out
    assert "$12.88/h (4 chips at $3.220, on-demand; Billing Catalog of" in shown


def test_a_job_costs_its_tpus_time_in_train_jobs_and_the_report(made):
    (made.cwd / "nap.py").write_text("import time\ntime.sleep(2)\nprint('rested', flush=True)\n")
    begun = now()
    r = made("train", "nap.py", "--tpu", "priced", "--runtime", "cpu", "--json")
    wall = (now() - begun).total_seconds()
    assert r.code == 0, r.err
    result = json.loads(r.out)
    rate = 4 * V4_CHIP_HOUR
    assert 2 * rate / 3600 <= result["cost"] <= wall * rate / 3600
    (row,) = [j for j in json.loads(made("jobs", "--json").out) if j["job_id"] == result["job_id"]]
    assert row["cost"] == pytest.approx(result["cost"]) and row["pricePerHour"] == pytest.approx(rate)
    (job,) = [j for j in json.loads(made("cost", "--json").out)["jobs"] if j["job"] == result["job_id"]]
    assert job["end"] == "finished" and job["cost"] == pytest.approx(result["cost"], rel=1e-3, abs=1e-5)
    assert re.search(r"cost: \$0\.0\d+ of priced's time", made("train", "nap.py", "--tpu", "priced", "--runtime", "cpu").err)


def test_the_report_keeps_a_deleted_tpu_and_its_cost(made):
    created = json.loads(made("describe", "priced", "--json").out)["createTime"]
    up = since(created)
    assert made("delete", "priced", "--yes").code == 0
    gone = since(created)
    report = json.loads(made("cost", "--since", "1h", "--json").out)
    (tpu,) = [t for t in report["tpus"] if t["name"] == "priced"]
    assert tpu["how"] == "deleted" and tpu["acceleratorType"] == "v4-8"
    assert up - 2 <= tpu["hours"] * 3600 <= gone + 2
    assert tpu["cost"] == pytest.approx(tpu["hours"] * 4 * V4_CHIP_HOUR, rel=1e-3)  # each rounded to 6 places
    assert report["byType"]["v4-8"] == pytest.approx(tpu["cost"])
    assert "priced" in made("cost", "--plain").out  # the table too
