"""What a TPU costs, through the real CLI against the emulator (whose Billing Catalog google-cloud-billing reads):
its price and cost so far in `list` and `describe`, and `tpurun cost` after it is deleted."""

from __future__ import annotations

import datetime as dt
import json

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


def test_the_report_keeps_a_deleted_tpu_and_its_cost(made):
    created = json.loads(made("describe", "priced", "--json").out)["createTime"]
    up = since(created)
    assert made("delete", "priced", "--yes").code == 0
    gone = since(created)
    report = json.loads(made("cost", "--since", "1h", "--json").out)
    (tpu,) = [t for t in report["tpus"] if t["name"] == "priced"]
    assert tpu["how"] == "deleted" and tpu["acceleratorType"] == "v4-8"
    assert up - 2 <= tpu["hours"] * 3600 <= gone + 2
    assert tpu["cost"] == pytest.approx(tpu["hours"] * 4 * V4_CHIP_HOUR, rel=1e-4)
    assert report["byType"]["v4-8"] == pytest.approx(tpu["cost"])
    assert "priced" in made("cost", "--plain").out  # the table too
