#!/usr/bin/env python3
"""Hang forensics benchmark: `tpurun stacks` on a big pod, and what the hook costs every process it starts in.

* stacks: a detached host-launch job on an emulated v4 node of 32 workers, each host process making 4 chip
  processes (a process pool setting PJRT_LOCAL_PROCESS_RANK, as xmp.spawn does) that then sleep, so 160
  Python processes of the job (and each pool's helper processes). Timed: `tpurun stacks JOB` (every
  process of every worker read through its own faulthandler, parsed, grouped, the dump written) against
  `tpurun exec -- true` on the same workers (the fan-out floor: one SSH command per worker) and `tpurun exec --
  python3 -c pass` (a Python started on every worker, as the agent is), interleaved.
* hook: a Python process's start with the hook as a job's process has it (the job's variables set, the
  hook first on PYTHONPATH) against the same start without the hook, and against the hook before hang
  forensics (its file at a given git revision, default 3dc8c03), interleaved: `python3 -c pass`, and
  `python3 -c "import torch.distributed"` (which the hook now wraps as it loads). The delta is what each
  process of a job pays.

Writes docs/bench/hangs.json and a section of docs/benchmarks.md. The stacks part needs root (the emulator).
    sudo .venv/bin/python scripts/bench/hang_bench.py [--reps 7] [--workers 32] [--hook-reps 40] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

HOST = """
import concurrent.futures, multiprocessing, os, time

def replica(rank):
    os.environ.setdefault("PJRT_LOCAL_PROCESS_RANK", str(rank))  # what torch_xla's spawner sets first
    print("up", rank, flush=True)
    time.sleep(3600)

if __name__ == "__main__":
    with concurrent.futures.ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(replica, range(4)))
"""

HOOK_DIR = common.ROOT / "tpurun" / "worker" / "hook"


def bench_stacks(bench: common.Bench, workers: int, reps: int) -> dict[str, Any]:
    node = bench.create(workers)
    work = Path(tempfile.mkdtemp(prefix="hang-bench-", dir=bench.home))
    (work / "host.py").write_text(HOST)
    env = dict(bench.env, TPURUN_TPU=node.name)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*common.tpurun_bin(), *args], env=env, cwd=work, capture_output=True, text=True)

    started = run("train", "host.py", "--runtime", "cpu", "--launch", "host", "--python", "python3", "--detach")
    if started.returncode != 0:
        raise SystemExit(f"error: the job did not start: {started.stderr[-2000:]}")
    job = started.stdout.strip().splitlines()[-1]
    want = workers * 4
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # every chip process up (its line in the logs)
        up = sum(1 for line in run("--plain", "logs", job).stdout.splitlines() if "] up " in line)
        if up >= want:
            break
        time.sleep(2)
    asked = run("stacks", job, "--json")
    if asked.returncode != 0:
        raise SystemExit(f"error: tpurun stacks failed ({asked.returncode}): {asked.stderr[-2000:]}")
    data = json.loads(asked.stdout)
    read = sum(len(g["processes"]) for g in data["groups"])
    print(f"  stacks: {read} processes read, {len(data['unread'])} without stacks; {data['summary'][:120]}")
    res = common.interleave(
        {
            "stacks": lambda: common.timed([*common.tpurun_bin(), "stacks", job, "--json"], env, work),
            "exec floor": lambda: common.timed([*common.tpurun_bin(), "exec", "--", "true"], env, work),
            "exec python": lambda: common.timed(
                [*common.tpurun_bin(), "exec", "--", "python3", "-c", "pass"], env, work
            ),
        },
        reps,
        label=f"{workers}w ",
    )
    run("cancel", job)
    bench.delete(node)
    return {"workers": workers, "processes_read": read, "unread": len(data["unread"]), **res}


def hook_env(hook_dir: Path | None, job_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPURUN_")}
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as on a worker: the hook's compiled file is kept after its first run
    if hook_dir is None:
        return env
    env.update(
        {
            "PYTHONPATH": str(hook_dir),
            "TPURUN_JOB_ID": "bench",
            "TPURUN_JOB_DIR": str(job_dir),
            "TPURUN_LOG_SOCKET": "tpurun-bench-none",
            "TPURUN_STACKS_SIGNAL": "40",
            "TPURUN_SUPERVISOR_PID": "1",
        }
    )
    return env


def bench_hook(reps: int, before_rev: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="hook-bench-"))
    (tmp / "stacks").mkdir()
    before = tmp / "before"
    before.mkdir()
    old = subprocess.run(
        ["git", "show", f"{before_rev}:tpurun/worker/hook/sitecustomize.py"],
        cwd=common.ROOT,
        capture_output=True,
        check=True,
    ).stdout
    (before / "sitecustomize.py").write_bytes(old)
    envs = {
        "no hook": hook_env(None, tmp),
        f"hook at {before_rev}": hook_env(before, tmp),
        "hook now": hook_env(HOOK_DIR, tmp),
    }
    out: dict[str, Any] = {"before": before_rev, "import_ms": {}}
    for name, env in envs.items():  # the hook's own import, as the interpreter times it (no process noise)
        samples = []
        for _ in range(reps):
            r = subprocess.run(
                [sys.executable, "-X", "importtime", "-c", "pass"], env=env, capture_output=True, text=True
            )
            top = [ln for ln in r.stderr.splitlines() if ln.endswith("|   sitecustomize")]
            samples.append(int(top[0].split("|")[1]) / 1000 if top else 0.0)
        out["import_ms"][name] = statistics.median(samples)
        print(f"  import of sitecustomize, {name}: median {out['import_ms'][name]:.2f} ms", flush=True)
    for what, code in (("start", "pass"), ("import torch.distributed", "import torch.distributed")):
        argv = [sys.executable, "-c", code]
        contenders = {name: (lambda e=e, a=argv: common.timed(a, e)) for name, e in envs.items()}
        out[what] = common.interleave(contenders, reps, warmup=2, label=f"{what}: ")
    return out


def table(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [common.machine_line(m), ""]
    s = res.get("stacks")
    if s:
        st, fl, py = s["stacks"], s["exec floor"], s["exec python"]
        lines += [
            f"`tpurun stacks JOB` on {s['workers']} emulated workers, {s['processes_read']} Python processes of the job "
            f"read ({s['unread']} without stacks), against `tpurun exec -- true` on the same workers, "
            f"{st['n']} runs each, interleaved:",
            "",
            "| command | median | min-max | client CPU |",
            "| --- | --- | --- | --- |",
            f"| `tpurun stacks` | {st['median'] * 1000:.0f} ms | {st['min'] * 1000:.0f}-{st['max'] * 1000:.0f} ms | {st['cpu_median'] * 1000:.0f} ms |",
            f"| `tpurun exec -- true` (floor) | {fl['median'] * 1000:.0f} ms | {fl['min'] * 1000:.0f}-{fl['max'] * 1000:.0f} ms | {fl['cpu_median'] * 1000:.0f} ms |",
            f"| `tpurun exec -- python3 -c pass` (a Python on every worker) | {py['median'] * 1000:.0f} ms | {py['min'] * 1000:.0f}-{py['max'] * 1000:.0f} ms | {py['cpu_median'] * 1000:.0f} ms |",
            "",
            f"stacks / exec floor: {st['median'] / fl['median']:.2f}×; stacks / a Python on every worker: "
            f"{st['median'] / py['median']:.2f}× (the emulated workers share this machine's 2 cores: 32 agents "
            "starting at once are most of the difference; each real TPU host has its own).",
            "",
        ]
    h = res.get("hook")
    if h:
        before = f"hook at {h['before']}"
        lines += [
            f"A Python process's start, as a job's process ({h['start']['no hook']['n']} runs each, interleaved, "
            "wall time median (min-max)):",
            "",
            f"| | no hook | {before} | hook now | now − before |",
            "| --- | --- | --- | --- | --- |",
        ]
        for what in ("start", "import torch.distributed"):
            r = h[what]
            cells = [
                f"{r[k]['median'] * 1000:.1f} ({r[k]['min'] * 1000:.1f}-{r[k]['max'] * 1000:.1f}) ms"
                for k in ("no hook", before, "hook now")
            ]
            delta = (r["hook now"]["median"] - r[before]["median"]) * 1000
            lines.append(
                f'| `python3 -c "{"pass" if what == "start" else what}"` | '
                + " | ".join(cells)
                + f" | {delta:+.1f} ms |"
            )
        imp = h.get("import_ms")
        if imp:
            lines += [
                "",
                "The hook's own import, as `python3 -X importtime -c pass` times it (median; no hook: the "
                "interpreter's own `sitecustomize`, if any): "
                + ", ".join(f"{k} {v:.2f} ms" for k, v in imp.items())
                + ". The whole-process numbers above move by a few ms from run to run on this 2-core machine; "
                "this one is the hook's share.",
            ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--hook-reps", type=int, default=40)
    ap.add_argument("--before", default="3dc8c03", help="the git revision whose hook is 'before'")
    ap.add_argument("--only", choices=["stacks", "hook"], default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    res: dict[str, Any] = {"machine": common.machine()}
    kept = common.BENCH_DOCS / "hangs.json"
    if args.only and kept.exists():  # one part again: the other part's last results stay
        res = {**json.loads(kept.read_text()), **res}
    if args.only in (None, "hook"):
        res["hook"] = bench_hook(args.hook_reps, args.before)
    if args.only in (None, "stacks"):
        with common.bench_emulator() as bench:
            res["stacks"] = bench_stacks(bench, args.workers, args.reps)
    common.publish(
        res, table(res), "hangs", "Hang forensics: `tpurun stacks` and the hook's cost", write=not args.no_write
    )


if __name__ == "__main__":
    main()
