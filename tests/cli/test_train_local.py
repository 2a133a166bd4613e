"""tpurun train on this machine (the local default): arguments, dry run, and a real run of the agent."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.helpers import tpurun


def test_unknown_options_and_after_dashdash_go_to_the_script(tmp_path):
    (tmp_path / "t.py").write_text("print(1)\n")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    r = tpurun(
        "train", "t.py", "--lr", "0.1", "--runtime", "cpu", "--cores", "2", "--dry-run", "--json", "--", "--cores", "x y",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert [p["command"][1:] for p in d["processes"]] == [["t.py", "--lr", "0.1", "--cores", "x y"]] * 2
    assert d["processes"][0]["command"][0] == sys.executable  # this machine: tpurun's own interpreter
    assert {p["env"]["RANK"] for p in d["processes"]} == {"0", "1"}
    assert "one-host pod" in r.err


def test_a_misspelt_option_is_refused_unless_after_dashdash(tmp_path):
    (tmp_path / "t.py").write_text("print(1)\n")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    for typo, meant in (("--detatch", "--detach"), ("--dry_run", "--dry-run"), ("--max-restart=2", "--max-restarts")):
        r = tpurun("train", "t.py", "--runtime", "cpu", typo, "--dry-run", cwd=tmp_path, env=env)
        assert r.code == 2 and f"did you mean {meant}?" in r.err and f"-- {typo}" in r.err, r.err
        assert "Traceback" not in r.err and r.out == ""
    r = tpurun("train", "t.py", "--runtime", "cpu", "--dry-run", "--json", "--", "--detatch", cwd=tmp_path, env=env)
    assert r.code == 0, r.err
    assert json.loads(r.out)["processes"][0]["command"][1:] == ["t.py", "--detatch"]


def test_cpu_processes_are_bounded_by_the_host_unless_oversubscribed(tmp_path):
    (tmp_path / "t.py").write_text("print(1)\n")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    for bad in (["--cores", "9"], ["--core", "8"]):
        r = tpurun("train", "t.py", "--runtime", "cpu", *bad, "--dry-run", cwd=tmp_path, env=env)
        assert r.code == 2 and "at most 8 devices" in r.err and "--oversubscribe" in r.err, r.err
    r = tpurun("train", "t.py", "--runtime", "cpu", "--cores", "9", "--oversubscribe", "--dry-run", "--json",
               cwd=tmp_path, env=env)  # fmt: skip
    assert r.code == 0, r.err
    assert len(json.loads(r.out)["processes"]) == 9


def test_notes_talk_about_the_framework_the_script_imports(tmp_path):
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    (tmp_path / "j.py").write_text("import jax\nimport jax.numpy as jnp\nprint(jnp.ones(2))\n")
    (tmp_path / "t.py").write_text("import torch\nimport torch_xla\n")
    r = tpurun("train", "j.py", "--runtime", "cpu", "--cores", "2", "--dry-run", cwd=tmp_path, env=env)
    assert r.code == 0 and "jax.distributed.initialize()" in r.err and "torch_xla" not in r.err, r.err
    r = tpurun("train", "t.py", "--runtime", "cpu", "--cores", "2", "--dry-run", cwd=tmp_path, env=env)
    assert r.code == 0 and "torch_xla has no cross-process collectives" in r.err and "jax" not in r.err, r.err


def test_local_run_streams_every_core_and_fails_fast(tmp_path):
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    (tmp_path / "ok.py").write_text(
        "import os\nfor i in range(3): print('n', i, os.environ['RANK'], os.environ['PJRT_DEVICE'], flush=True)\n"
    )
    r = tpurun("train", "ok.py", "--cores", "3", cwd=tmp_path, env=env)
    assert r.code == 0, r.err
    for c in range(3):
        assert re.findall(rf"^\[w0/c{c}\] n (\d) {c} CPU$", r.out, re.M) == ["0", "1", "2"]
    # the summary names each process's end in the agent's words
    assert len(re.findall(r"^\S*\s*w0/c\d\s+exited\s+0\s", r.err, re.M)) == 3, r.err
    (tmp_path / "bad.py").write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    print('bye'); sys.exit(7)\ntime.sleep(300)\n"
    )
    r = tpurun("train", "bad.py", "--cores", "2", cwd=tmp_path, env=env, timeout=60)
    assert r.code == 1
    assert "w0/c1" in r.err and "exit code 7" in r.err and "bye" in r.err


def test_metrics_report_per_core(tmp_path):
    """--metrics with real torch_xla on CPU: a summary line per core and the full report in the job dir."""
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    (tmp_path / "m.py").write_text(
        "import torch, torch_xla\nx = torch.ones(3, device=torch_xla.device()) * 2\nprint('sum', x.sum().item())\n"
    )
    r = tpurun("train", "m.py", "--metrics", cwd=tmp_path, env=env, timeout=300)
    assert r.code == 0, r.err
    assert "[w0/c0] sum 6.0" in r.out
    summary = next(line for line in r.out.splitlines() if "tpurun metrics:" in line)
    assert "compiles=" in summary and "execute_time=" in summary
    report = summary.rsplit("report=", 1)[1]
    text = open(report).read()
    assert "CompileTime" in text and "ExecuteTime" in text


def test_metrics_report_per_chip_process_in_a_host_launch(tmp_path):
    """--metrics in a host launch: xmp.spawn's process reports as its chip, the host process as [w0]."""
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    (tmp_path / "s.py").write_text(
        "import torch, torch_xla\nimport torch_xla.distributed.xla_multiprocessing as xmp\n"
        "def fn(i):\n    x = torch.ones(3, device=torch_xla.device()) * 2\n    print('sum', x.sum().item())\n"
        "if __name__ == '__main__':\n    xmp.spawn(fn)\n"
    )
    r = tpurun("train", "s.py", "--metrics", "--launch", "host", cwd=tmp_path, env=env, timeout=300)
    assert r.code == 0, r.err
    assert "[w0/c0] sum 6.0" in r.out
    chip = next(line for line in r.out.splitlines() if line.startswith("[w0/c0] tpurun metrics:"))
    assert "executes=0" not in chip and open(chip.rsplit("report=", 1)[1]).read().count("ExecuteTime")
    assert re.search(r"^\[w0\] tpurun metrics: .*report=.*/w0\.metrics\.txt$", r.out, re.M), r.out


def test_lightning_example_trains_under_tpurun(tmp_path):
    """Lightning joins tpurun's processes as it would torchrun's (DDP over gloo on CPU) and learns digits."""
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).parents[2] / "examples" / "digits_lightning.py", tmp_path / "digits_lightning.py")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    r = tpurun("train", "digits_lightning.py", "--cores", "2", "--runtime", "cpu", cwd=tmp_path, env=env, timeout=600)
    assert r.code == 0, r.err[-2000:]
    assert re.search(r"^\[w0/c1\] \[rank 1/2\] epoch 15 ", r.out, re.M), r.out[-2000:]
    final = re.search(r"^\[w0/c0\] final test accuracy: ([0-9.]+)$", r.out, re.M)
    assert final and float(final.group(1)) >= 0.90, r.out[-2000:]


def test_cancel_of_an_ended_job_says_it_had_ended(tmp_path):
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    (tmp_path / "q.py").write_text("print('done')\n")
    r = tpurun("train", "q.py", "--runtime", "cpu", "--json", cwd=tmp_path, env=env, timeout=120)
    assert r.code == 0, r.err
    said = json.loads(r.out)  # its end, and where the lines it does not print went
    job = said["job_id"]
    assert (said["end"], said["exit_code"], said["logs"]["command"]) == ("finished", 0, f"tpurun logs {job}"), said
    (row,) = json.loads(tpurun("jobs", "--json", cwd=tmp_path, env=env, timeout=60).out)
    assert (row["job_id"], row["status"], row["end"], row["exit_code"]) == (job, "finished", "finished", 0), row
    r = tpurun("cancel", job, cwd=tmp_path, env=env, timeout=120)
    assert r.code == 0, r.err
    assert "had already ended (finished)" in r.err and "stopped on" not in r.err, r.err
    # --tpu, as `exec` and `jobs` take it, checked against the job's record
    r = tpurun("logs", job, "--tpu", "local", cwd=tmp_path, env=env, timeout=120)
    assert r.code == 0 and "done" in r.out, r.err
    for verb in ("logs", "cancel"):
        r = tpurun(verb, job, "--tpu", "pod", cwd=tmp_path, env=env, timeout=120)
        assert r.code == 2 and f"job {job} ran on local, not on pod" in r.err and "Traceback" not in r.err, r.err


def test_jobs_never_cuts_a_status(tmp_path):
    """A job whose TPU cannot be asked: its status says why in whole words, not 40 characters of it."""
    home = tmp_path / "tpurun-home"
    (home / "jobs").mkdir(parents=True)
    record = {
        "job_id": "20260101-000000-abcd", "tpu": "gone-node", "workers": [0], "cores": {"0": [-1]},
        "created": "2026-01-01T00:00:00", "detached": True, "command": ["t.py"], "python": "python3",
    }  # fmt: skip
    (home / "jobs" / "20260101-000000-abcd.json").write_text(json.dumps(record))
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "TPURUN_HOME": str(home)}
    env.update({"TPURUN_PROJECT": "", "TPURUN_ZONE": "", "CLOUDSDK_CONFIG": str(tmp_path / "no-gcloud")})
    r = tpurun("jobs", "--json", cwd=tmp_path, env=env, timeout=60)
    assert r.code == 0, r.err
    (row,) = json.loads(r.out)
    assert row["status"] == "unknown" and row["seen"].rstrip().endswith((".", ")", "`")), row
    assert len(row["seen"]) > 60, row["seen"]


def test_a_default_tpu_without_project_names_local_as_a_way_out(tmp_path):
    """tpurun.toml names a TPU but no project/zone is set: the error says where the TPU came from and --local."""
    (tmp_path / "tpurun.toml").write_text('tpu = "demo"\n')
    (tmp_path / "q.py").write_text("print('hi')\n")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "CLOUDSDK_CONFIG": str(tmp_path / "g")}
    env.update({"TPURUN_PROJECT": "", "TPURUN_ZONE": ""})
    r = tpurun("train", "q.py", cwd=tmp_path, env=env, timeout=60)
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert "--local" in r.err and "tpurun.toml" in r.err and "'demo'" in r.err, r.err


def test_sync_without_a_tpu_refuses(tmp_path):
    """No TPU named: sync says so instead of copying the directory somewhere on this machine."""
    work = tmp_path / "proj"
    work.mkdir()
    (work / "a.txt").write_text("a")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "TPURUN_TPU": ""}
    r = tpurun("sync", cwd=work, env=env, timeout=60)
    assert r.code == 2 and "--tpu" in r.err and "--local" in r.err and "Traceback" not in r.err, r.err
    assert not (tmp_path / "proj" / "proj").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["proj"]


def test_global_flags_work_after_the_command_and_never_reach_the_script(tmp_path):
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    for args in (["topology", "v4-8", "--plain"], ["config", "show", "--debug"], ["jobs", "--plain"]):
        r = tpurun(*args, cwd=tmp_path, env=env, timeout=60)
        assert r.code == 0, (args, r.err)
    (tmp_path / "argv.py").write_text("import sys\nprint('argv', sys.argv[1:])\n")
    r = tpurun("train", "argv.py", "x", "--plain", "--runtime", "cpu", cwd=tmp_path, env=env, timeout=120)
    assert r.code == 0 and "[w0/c0] argv ['x']" in r.out, (r.out, r.err)
    r = tpurun("train", "argv.py", "--runtime", "cpu", "--", "--plain", cwd=tmp_path, env=env, timeout=120)
    assert r.code == 0 and "[w0/c0] argv ['--plain']" in r.out, (r.out, r.err)  # after --: the script's


_GLOO = """import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("sum", t.item(), flush=True)
dist.destroy_process_group()
"""


def test_gloo_connection_chatter_stays_off_the_terminal_unless_asked(tmp_path):
    """torch.distributed's gloo prints one "[Gloo] Rank N is connected" line per process: hidden on the
    terminal and in `logs`, shown with --debug, always kept in the job's log files."""
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    (tmp_path / "g.py").write_text(_GLOO)
    r = tpurun("train", "g.py", "--cores", "2", "--runtime", "cpu", cwd=tmp_path, env=env, timeout=300)
    assert r.code == 0, r.err
    assert sorted(re.findall(r"^\[w0/c\d\] sum 3.0$", r.out, re.M)) == ["[w0/c0] sum 3.0", "[w0/c1] sum 3.0"], r.out
    assert "[Gloo]" not in r.out + r.err
    job = re.search(r"job (\S+):", r.err).group(1)
    replay = tpurun("logs", job, cwd=tmp_path, env=env, timeout=120)
    assert replay.code == 0 and "sum 3.0" in replay.out and "[Gloo]" not in replay.out, replay.out
    shown = tpurun("logs", job, "--debug", cwd=tmp_path, env=env, timeout=120)
    assert len(re.findall(r"^\[w0/c\d\] \[Gloo\] Rank \d is connected to 1 peer ranks", shown.out, re.M)) == 2
    r = tpurun("--debug", "train", "g.py", "--cores", "2", "--runtime", "cpu", cwd=tmp_path, env=env, timeout=300)
    assert r.code == 0 and r.out.count("[Gloo] Rank") == 2, r.out


STUCK = """\
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
if os.environ["RANK"] == "1":
    time.sleep(600)
dist.all_reduce(torch.ones(1))
"""


def test_a_job_that_makes_no_progress_is_reported_and_stopped_with_124(tmp_path):
    (tmp_path / "stuck.py").write_text(STUCK)
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    train = ("train", "stuck.py", "--runtime", "cpu", "--launch", "chip", "--cores", "2")
    r = tpurun(*train, "--detach", "--hang-timeout", "5s", cwd=tmp_path, env=env)
    assert r.code == 2 and "--hang-timeout watches an attached job" in r.err and "Traceback" not in r.err
    r = tpurun("--plain", *train, "--hang-timeout", "6s", "--on-hang", "stop", cwd=tmp_path, env=env, timeout=180)
    assert r.code == 124, r.err[-3000:]
    summary = next(x for x in r.err.splitlines() if " · " in x)  # two groups of one: in the order of their names
    assert summary.split(" · ") == ["w0/c0 in all_reduce at stuck.py:8", "w0/c1 at stuck.py:7 (time.sleep(600))"]
    assert "made no progress for 6s and was stopped (--on-hang stop)" in r.err
    dump = next(x for x in r.err.splitlines() if x.startswith("the whole dump: ")).split(": ", 1)[1]
    assert "stuck.py" in open(dump).read()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--restarts", "crash=1"], "unknown kind 'crash' in --restarts"),
        (["--restarts", "program=-1"], "cannot be negative"),
        (["--on-notice", "signal:SIGNOPE"], "unknown signal 'SIGNOPE' in --on-notice"),
    ],
)
def test_bad_restart_budgets_and_notices_are_one_line_and_exit_2(tmp_path, args, says):
    """Refused before anything is asked or started: one line, exit 2, even with a TPU named that does not exist."""
    (tmp_path / "q.py").write_text("print('hi')\n")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "TPURUN_TPU": "nowhere"}
    r = tpurun("train", "q.py", *args, cwd=tmp_path, env=env, timeout=60)
    assert r.code == 2 and says in r.err and "Traceback" not in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1, r.err
