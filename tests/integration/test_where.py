"""--project and --zone on every command that reaches a TPU, and `list --all-zones`: a TPU outside the
zone TPURUN_ZONE chooses is reached when named with its zone, refused when not (exit 3, naming the zone looked
in, the zone tpurun made it in and the flag to use), and a job started there is followed by `logs`, `jobs` and
`cancel` from its record, whatever the settings."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import assert_clean_error, create_node

pytestmark = pytest.mark.integration

FAR = "us-east5-a"  # not the zone the settings name (TPURUN_ZONE is the emulator's)


def test_a_tpu_in_another_zone_is_reached_by_every_command_given_its_zone(cli, emulator):
    assert emulator.zone != FAR
    create_node(cli, "near", "v4-8")
    far = create_node(cli, "far", "v4-16", "--zone", FAR)
    assert far["zone"] == FAR
    (cli.cwd / "job.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")

    missed = cli("exec", "--tpu", "far", "--", "hostname")
    assert_clean_error(missed, 3)
    assert f"no TPU named 'far' in project {emulator.project}, zone {emulator.zone}" in missed.err, missed.err
    # the zone came from TPURUN_ZONE, so it is where far is looked for; the error names where tpurun made it
    assert f"tpurun made far in zone {FAR}: pass `--zone {FAR}`; the zone here comes from env TPURUN_ZONE" in missed.err

    r = cli("exec", "--tpu", "far", "--zone", FAR, "--", "hostname")
    assert r.code == 0 and r.out.count("[w") == 2, (r.out, r.err)
    for command in (
        ("sync", "--tpu", "far", "--zone", FAR),
        ("kill-stale", "--tpu", "far", "--zone", FAR, "--dry-run"),
        ("ssh", "--tpu", "far", "--zone", FAR, "--worker", "1", "--", "true"),
        ("exec", "--tpu", "far", "--zone", FAR, "--project", emulator.project, "--", "true"),
    ):
        r = cli(*command)
        assert r.code == 0, (command, r.out, r.err)

    r = cli("train", "job.py", "--tpu", "far", "--zone", FAR, "--runtime", "cpu", "--cores", "1",
            "--python", "python3", "--detach", "--json")  # fmt: skip
    assert r.code == 0, r.err
    job = json.loads(r.out)["job_id"]
    # the job's record knows where its TPU is: no --zone needed to follow or stop it
    for _ in range(50):
        r = cli("logs", job, "--tail", "5")
        assert r.code == 0, r.err
        if r.out.count("started") == 2:  # one process on each worker of far
            break
        time.sleep(0.2)
    assert sorted(r.out.splitlines()) == ["[w0/c0] started", "[w1/c0] started"], r.out
    (row,) = json.loads(cli("jobs", "--zone", FAR, "--json").out)
    assert (row["job_id"], row["tpu"], row["status"]) == (job, "far", "running"), row
    assert json.loads(cli("jobs", "--zone", emulator.zone, "--json").out) == []
    r = cli("cancel", job)
    assert r.code == 0 and "stopped on 2 worker(s)" in r.err, (r.out, r.err)

    here = [v["name"] for v in json.loads(cli("list", "--json").out)]
    assert here == ["near"], here
    everywhere = {(v["zone"], v["name"]) for v in json.loads(cli("list", "--all-zones", "--json").out)}
    assert everywhere == {(emulator.zone, "near"), (FAR, "far")}, everywhere
    table = cli("list", "--all-zones")
    assert table.code == 0 and FAR in table.out and "ZONE" in table.out, table.out
    assert_clean_error(cli("list", "--all-zones", "--zone", FAR), 2)
