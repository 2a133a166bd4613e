"""`tpurun jobs` combines every worker's state of a job: a failure on one worker only is a failure."""

from __future__ import annotations

import json

import pytest

from tests.helpers import create_node

pytestmark = pytest.mark.integration


def test_a_job_failed_on_worker_1_only_reads_failed_naming_it(cli):
    create_node(cli, "half", "v4-16")
    (cli.cwd / "half.py").write_text("import os, sys\nsys.exit(3 if os.environ['TPURUN_WORKER_ID'] == '1' else 0)\n")
    r = cli("train", "half.py", "--runtime", "cpu", "--cores", "1", "--launch", "chip", "--python", "python3")
    assert r.code == 1, r.err
    (row,) = json.loads(cli("jobs", "--json").out)
    assert (row["status"], row["detail"]) == ("failed", "w1/c0: exit code 3"), row
    r = cli("jobs")
    assert r.code == 0 and "failed (w1/c0: exit code 3)" in " ".join(r.out.split()), r.out
