#!/usr/bin/env python3
"""What the profiler server tpurun starts in every process of a job costs a step, and what a capture takes
(docs/benchmarks.md, "Profiles (#54)").

It runs `tpurun train --local` of a JAX loop (a jitted 256x256 matmul and tanh, CPU) with `--profile` and with
`--no-profile`, ROUNDS times each, interleaved; each run times STEPS steps after a warm-up and prints its median
step. Then one detached run with the server, captured by `tpurun profile --duration 1s` REPS times: the command's
wall time and the file's size. This part needs no root and no emulator: the local pod is this machine.

`--hosts 2,32`: then, on emulated pods of that many hosts (a v4-16, a v4-256; the emulator needs root), one JAX
process a host (`--launch host`) stepping the same function with a pause between steps (`--pause`, so that 32 of
them leave a 2-core machine's cores to the capture; the hosts load JAX one after the other, see bench_pod), captured from every host (`--worker all`) by `tpurun profile
--duration 1s` POD_REPS times: the wall time, the bytes and how late the latest worker started. The load average
is read before and after each pod's captures. Usage:

    .venv/bin/python scripts/bench/profile_bench.py --rounds 5 --steps 2000 --reps 3
    sudo .venv/bin/python scripts/bench/profile_bench.py --rounds 0 --reps 0 --hosts 2,32 --pod-reps 3
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

LOOP = r"""
import os, socket, statistics, sys, time
worker = int(os.environ.get("TPURUN_WORKER_ID", "0"))
if sys.argv[3:] == ["one-by-one"] and worker:  # see bench_pod: JAX loaded once the previous host serves
    previous = ("localhost", int(os.environ["TPURUN_PROFILE_PORT"]) + 64 * (worker - 1))
    while True:
        try:
            socket.create_connection(previous, timeout=5).close()
            break
        except OSError:
            time.sleep(0.2)
import jax, jax.numpy as jnp

@jax.jit
def step(x):
    return jnp.tanh(x @ x) * 0.5

x = jnp.ones((256, 256))
for _ in range(50):
    x = step(x).block_until_ready()
steps = int(sys.argv[1])
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
if steps == 0:
    print("stepping", flush=True)
    while True:
        x = step(x).block_until_ready()
        if pause:
            time.sleep(pause)
times = []
for _ in range(steps):
    t = time.perf_counter()
    x = step(x).block_until_ready()
    times.append(time.perf_counter() - t)
print("STEP_US", statistics.median(times) * 1e6, flush=True)
"""


TYPES = {2: "v4-16", **common.V4_FOR_WORKERS}  # hosts -> an accelerator type of that many


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def bench_pod(bench: common.Bench, hosts: int, reps: int, pause: float, one_by_one: bool) -> dict:
    """`tpurun profile JOB --worker all --duration 1s` of a JAX loop on every host of an emulated pod of HOSTS."""
    name = f"prof{hosts}"
    t = time.monotonic()
    bench.tpurun("create", name, "-t", TYPES[hosts])
    bench.nodes[name] = common.Node(name, bench.pin_for_peers(name))
    print(f"created {name} ({hosts} hosts) in {time.monotonic() - t:.0f} s", flush=True)
    work = bench.home / name
    work.mkdir()
    (work / "loop.py").write_text(LOOP)
    env = dict(bench.env, TPURUN_TPU=name)

    def tpurun(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*common.tpurun_bin(), *args], cwd=work, env=env, capture_output=True, text=True)

    # The emulated hosts share this machine's network, so each host's server takes the next free port of its slot
    # (+64); two hosts whose runtimes load at the same moment can both find a port free and both serve on it (gRPC
    # binds with SO_REUSEPORT), and a capture then reaches either (seen here: 5 of 32 hosts' servers shared a port
    # with another's). On a pod each host has its own network; here, with ONE_BY_ONE, host N loads JAX once host
    # N-1's server answers, so each host's server is on its own port, the Nth of the ladder.
    argv = ["--", "0", str(pause), *(["one-by-one"] if one_by_one else [])]
    r = tpurun("train", "loop.py", "--runtime", "cpu", "--launch", "host", "--detach", *argv)
    if r.returncode != 0:
        raise SystemExit(f"error: the job did not start: {r.stderr[-2000:]}")
    job = r.stdout.split()[-1]
    t = time.monotonic()
    while sum("stepping" in x for x in tpurun("--plain", "logs", job).stdout.splitlines()) < hosts:
        if time.monotonic() - t > 900:
            raise SystemExit(f"error: not every host stepping after 900 s: {tpurun('--plain', 'logs', job).stdout}")
        time.sleep(2)
    print(f"  {hosts} hosts stepping {time.monotonic() - t:.0f} s after the start; load {load()}", flush=True)
    runs = []
    before = load()
    try:
        for _ in range(reps):
            t = time.monotonic()
            r = tpurun("profile", job, "--worker", "all", "--duration", "1s", "--json", "--out", "prof")
            wall = time.monotonic() - t
            got = json.loads(r.stdout) if r.stdout.strip() else {}
            runs.append({"wall": wall, "rc": r.returncode, "files": len(got.get("files", [])),
                         "bytes": got.get("bytes", 0), "late": max(got.get("late", {}).values(), default=0.0),
                         "missing": got.get("missing", {}), "errors": got.get("errors", {})})  # fmt: skip
            print(f"  {hosts} hosts: {wall:.1f} s, rc {r.returncode}, {runs[-1]['files']} files, "
                  f"{runs[-1]['bytes'] / 1e3:.0f} kB, latest start {runs[-1]['late']} s; without a file: "
                  f"{runs[-1]['missing'] or 'none'}; not asked: {runs[-1]['errors'] or 'none'}", flush=True)  # fmt: skip
    finally:
        after = load()
        tpurun("cancel", job)
        bench.delete(bench.nodes[name])
    return {"hosts": hosts, "runs": runs, "load_before": before, "load_after": after}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hosts", default="", help="emulated pods of these many hosts, e.g. 2,32")
    ap.add_argument("--pod-reps", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between the pods' steps")
    ap.add_argument("--at-once", action="store_true", help="the pods' hosts load JAX at once (see bench_pod)")
    args = ap.parse_args()
    tp = common.tpurun_bin()
    print(common.machine_line(common.machine()), f"load {load()}", flush=True)
    if args.rounds and args.reps:
        local(tp, args)
    if args.hosts:
        with common.bench_emulator() as bench:
            pods = [bench_pod(bench, int(n), args.pod_reps, args.pause, not args.at_once) for n in args.hosts.split(",")]
        print("| capture, `--duration 1s`, every host | wall time of `tpurun profile` (median, min-max) | bytes (median) "
              "| latest start | load average before / after |")  # fmt: skip
        print("| --- | ---: | ---: | ---: | --- |")
        for p in pods:
            ok = [r for r in p["runs"] if r["rc"] == 0] or p["runs"]
            walls = [r["wall"] for r in ok]
            print(f"| {p['hosts']} hosts (emulated) | {statistics.median(walls):.1f} s ({min(walls):.1f}-{max(walls):.1f}), "
                  f"{len(ok)} of {len(p['runs'])} runs, {min(r['files'] for r in ok)}-{max(r['files'] for r in ok)} files | "
                  f"{statistics.median(r['bytes'] for r in ok) / 1e3:.0f} kB | "
                  f"{max(r['late'] for r in ok):.2f} s | {p['load_before']} / {p['load_after']} |")  # fmt: skip


def local(tp: list[str], args: argparse.Namespace) -> None:
    """The step with and without the server, and a capture of one host, on this machine (`train --local`)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "loop.py").write_text(LOOP)
        env = {**os.environ, "TPURUN_HOME": str(work / "home")}
        step = {"--profile": [], "--no-profile": []}
        for _ in range(args.rounds):
            for flag in step:
                argv = [*tp, "--plain", "train", "--local", "loop.py", "--runtime", "cpu", flag, "--", str(args.steps)]
                out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, check=True).stdout
                step[flag].append(float(next(x for x in out.split() if x.replace(".", "").isdigit())))
        argv = [*tp, "train", "--local", "loop.py", "--runtime", "cpu", "--detach", "--", "0"]
        job = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
        deadline = time.monotonic() + 120
        while "stepping" not in subprocess.run([*tp, "logs", job], cwd=work, env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        walls, sizes = [], []
        try:
            for _ in range(args.reps):
                t = time.monotonic()
                r = subprocess.run([*tp, "profile", job, "--duration", "1s", "--json"], cwd=work, env=env,
                                   capture_output=True, text=True, check=True)  # fmt: skip
                walls.append(time.monotonic() - t)
                sizes.append(json.loads(r.stdout)["bytes"])
        finally:
            subprocess.run([*tp, "cancel", job], cwd=work, env=env, capture_output=True)
    on, off = statistics.median(step["--profile"]), statistics.median(step["--no-profile"])
    print("| JAX loop step, median (µs) | with the server | without | difference |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| {args.rounds} runs × {args.steps} steps each | {on:.1f} | {off:.1f} | {100 * (on - off) / off:+.1f}% |")
    print(f"capture of 1 host, 1 s: {statistics.median(walls):.2f} s wall (median of {args.reps}), "
          f"{statistics.median(sizes) / 1e6:.1f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
