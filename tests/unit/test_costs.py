"""The spend ledger folded into TPUs' lives and the cost report, from ledger lines as tpurun writes them."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import pytest

from tpurun import costs
from tpurun.cloud import ledger
from tpurun.errors import UsageError

T0 = dt.datetime(2026, 11, 1, 22, 0, tzinfo=dt.timezone.utc)
PRICE = {"per_chip_hour": 1.2, "chips": 16, "provisioning": "on-demand", "source": "catalog", "as_of": "2026-11-01",
         "sku": "X"}  # fmt: skip


def at(hours: float) -> str:
    return ledger.stamp(T0 + dt.timedelta(hours=hours))


def write(home, *events):
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ledger.FILE, "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def tpu(event, hours, ids=("1",), **more):
    return {"at": at(hours), "what": "tpu", "event": event, "project": "p", "zone": "us-central1-a", "name": "t",
            "ids": list(ids), **more}  # fmt: skip


def made(hours=0.0, ids=("1",)):
    return tpu("created", hours, ids, acceleratorType="v5litepod-16", provisioning="on-demand",
               createTime=at(hours), price=PRICE)  # fmt: skip


def test_a_life_is_its_creation_to_its_deletion_less_its_stops(tmp_path):
    write(tmp_path, made(), tpu("stopped", 1), tpu("started", 3), tpu("deleted", 4))
    (life,) = ledger.lives(tmp_path)
    assert life.up_hours() == pytest.approx(2.0)  # 0-1 and 3-4
    assert life.cost() == pytest.approx(38.4)
    assert life.ended == "deleted"


def test_a_tpu_made_again_under_its_name_is_another_life(tmp_path):
    write(tmp_path, made(0, ("1",)), tpu("deleted", 1, ("1",)), made(2, ("2",)), tpu("gone", 5, ("2",)))
    first, second = ledger.lives(tmp_path)
    assert (first.up_hours(), second.up_hours(), second.ended) == (pytest.approx(1.0), pytest.approx(3.0), "gone")


def test_a_stop_never_followed_by_a_start_ends_its_billing(tmp_path):
    write(tmp_path, made(), tpu("stopped", 2))
    (life,) = ledger.lives(tmp_path)
    assert life.up_hours(until=T0 + dt.timedelta(hours=10)) == pytest.approx(2.0)


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    write(tmp_path, made())
    with open(tmp_path / ledger.FILE, "a") as f:
        f.write('{"at": "2026-11-01T23:00:00+00:00", "what": "tpu", "eve')
    assert len(ledger.lives(tmp_path)) == 1


def test_the_report_clips_to_its_window_and_splits_days_at_utc_midnight(tmp_path):
    write(tmp_path, made(), tpu("deleted", 4))  # 22:00 to 02:00 the next day
    rep = costs.report(tmp_path, dt.timedelta(hours=3), until=T0 + dt.timedelta(hours=4))  # from 23:00
    (row,) = rep.tpus
    assert row.hours == pytest.approx(3.0)
    assert rep.by_day() == {"2026-11-01": pytest.approx(19.2), "2026-11-02": pytest.approx(38.4)}
    assert rep.by_type() == {"v5litepod-16": pytest.approx(57.6)}
    assert rep.to_dict()["total"] == pytest.approx(57.6)


def test_a_tpu_gone_before_the_window_is_not_in_it(tmp_path):
    write(tmp_path, made(), tpu("deleted", 1))
    assert costs.report(tmp_path, dt.timedelta(hours=1), until=T0 + dt.timedelta(hours=5)).tpus == []


def test_a_tpu_without_a_price_counts_its_hours_and_says_so(tmp_path):
    write(tmp_path, {**made(), "price": None}, tpu("deleted", 2))
    rep = costs.report(tmp_path, dt.timedelta(days=30), until=T0 + dt.timedelta(hours=5))
    assert (rep.tpus[0].hours, rep.tpus[0].cost, rep.unpriced) == (pytest.approx(2.0), None, ["t"])


def test_a_job_costs_its_tpus_price_for_its_hours(tmp_path):
    write(
        tmp_path,
        {"at": at(1), "what": "job", "event": "started", "job": "j", "attempt": 0, "tpu": "t", "price": PRICE},
        {"at": at(9), "what": "job", "event": "ended", "job": "j", "attempt": 0, "end": "finished",
         "endedAt": at(1.5)},
    )  # fmt: skip
    (job,) = costs.report(tmp_path, dt.timedelta(days=1), until=T0 + dt.timedelta(hours=10)).jobs
    assert (job.hours, job.cost, job.how) == (pytest.approx(0.5), pytest.approx(9.6), "finished")


@pytest.mark.parametrize("bad", ["", "30", "d", "-3d", "0h", "3y", "abc"])
def test_an_unknown_since_is_refused(bad):
    with pytest.raises(UsageError, match="--since"):
        costs.parse_since(bad)


def test_the_command_refuses_a_bad_since_in_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "tpurun", "cost", "--since", "3y"], capture_output=True, text=True,
        env={"TPURUN_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) <= 2 and "--since" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_plot_is_a_png_of_the_spend_per_day(tmp_path):
    write(tmp_path, made(), tpu("deleted", 30))
    out = tmp_path / "spend.png"
    costs.plot(costs.report(tmp_path, dt.timedelta(days=3), until=T0 + dt.timedelta(hours=40)), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
