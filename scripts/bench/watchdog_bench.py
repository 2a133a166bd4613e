"""The TPU watchdog's own cost on a worker: CPU seconds per hour and memory.

    sudo .venv/bin/python scripts/bench/watchdog_bench.py                 # writes docs/bench/watchdog.json
    sudo .venv/bin/python scripts/bench/watchdog_bench.py --window 30 --prod 60 --no-write

One v4-8 (a single worker, whose watchdog is the one that decides: every look it also calls the API)
in an emulator run by this process, created with `--autostop 1d`, so the watchdog is armed: each look
re-reads the setting from the metadata server, scans every process of the worker for TPU devices
and tpurun jobs, publishes its state as a guest attribute, and calls nodes.get and
nodes.getGuestAttributes with the VM's token.

- Fast looks (one per second) for WINDOW seconds, on the worker as booted (a handful of processes),
  then with PROCS more (a detached job's children, each with 16 open files; a TPU VM runs a few
  hundred processes): CPU per look.
- Looks as deployed (every 30 s) for PROD seconds: CPU seconds per hour.

CPU is the watchdog process's utime+stime (/proc/PID/stat), memory its RSS and peak RSS (VmRSS,
VmHWM). The floor for memory: the same interpreter running `time.sleep` and nothing else.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

SLEEPERS = """import os, sys, time
n = int(sys.argv[1])
for _ in range(n):
    if os.fork() == 0:
        files = [open("/dev/null") for _ in range(16)]
        time.sleep(3600)
        os._exit(0)
print("sleepers", n, flush=True)
time.sleep(3600)
"""
TICKS = os.sysconf("SC_CLK_TCK")


def watchdog_pid() -> int:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"watchdog.py") for a in argv) and b"run" in argv:
                return int(name)
    raise SystemExit("error: no watchdog process found")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def memory_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def measure(pid: int, seconds: float) -> dict[str, float]:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    mem = memory_kib(pid)
    return {"cpu": c1 - c0, "wall": t1 - t0, "rss_kib": mem["VmRSS"], "peak_kib": mem["VmHWM"]}


def floor_rss(python: str) -> int:
    """RSS of the watchdog's interpreter doing nothing but sleep."""
    p = subprocess.Popen([python, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(1.5)
        return memory_kib(p.pid)["VmRSS"]
    finally:
        p.kill()
        p.wait()


def arm(bench: common.Bench, tick: float) -> None:
    """(Re)set the autostop setting with looks every TICK seconds; the watchdog reads it at its next look."""
    bench.tpurun("autostop", "wd", "1d", env={**bench.env, "TPURUN_WATCHDOG_TICK": str(tick)})


def render(res: dict[str, Any]) -> str:
    fast, busy, prod = res["fast"], res["fast_procs"], res["production"]

    def per_look(r: dict[str, float]) -> float:
        return r["cpu"] / r["wall"] * r["tick"] * 1000

    per_hour = prod["cpu"] / prod["wall"] * 3600
    lines = [
        f"Measured {res['machine']['date']} on {common.machine_line(res['machine'])}; `{res['command']}` "
        f"({res['seconds']:.0f} s). The watchdog of a v4-8's worker 0, armed (`--autostop 1d`): every look reads "
        "its setting, scans the worker's processes, publishes its state, and calls the API twice. CPU per hour "
        "is at the deployed look every 30 s: measured in the last row, per look × 120 in the others.",
        "",
        "| scenario | look every | measured for | CPU per look | CPU per hour | share of one core | RSS | peak RSS |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, r in (
        ("booted worker", fast),
        (f"+{res['procs']} processes, 16 files each", busy),
        ("as deployed (booted worker)", prod),
    ):
        hour = r["cpu"] / r["wall"] * 3600 if r is prod else per_look(r) / 1000 * 120
        lines.append(
            f"| {label} | {r['tick']:.0f} s | {r['wall']:.0f} s | {per_look(r):.1f} ms | {hour:.2f} s | "
            f"{hour / 36:.4f} % | {r['rss_kib'] / 1024:.1f} MiB | {r['peak_kib'] / 1024:.1f} MiB |"
        )
    lines += [
        "",
        f"As deployed the watchdog costs **{per_hour:.2f} CPU seconds per hour** "
        f"({per_hour / 36:.4f} % of one core) and **{prod['rss_kib'] / 1024:.1f} MiB** of memory: "
        f"{prod['rss_kib'] / res['floor_rss_kib']:.2f}x the {res['floor_rss_kib'] / 1024:.1f} MiB of its interpreter "
        "doing nothing (the floor). Most of a look is the process scan, which grows with the number of processes "
        "and their open files (second row).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=60, help="seconds of each fast-look measurement")
    ap.add_argument("--prod", type=float, default=300, help="seconds of the as-deployed measurement")
    ap.add_argument("--procs", type=int, default=300)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    res = common.record(__file__, procs=args.procs)
    with common.bench_emulator() as bench:
        bench.tpurun("create", "wd", "-t", "v4-8", "--autostop", "1d", env={**bench.env, "TPURUN_WATCHDOG_TICK": "1"})
        bench.nodes["wd"] = common.Node("wd", [])
        pid = watchdog_pid()
        res["floor_rss_kib"] = floor_rss(os.readlink(f"/proc/{pid}/exe"))
        time.sleep(2)
        res["fast"] = {**measure(pid, args.window), "tick": 1.0}
        print("booted worker:", res["fast"], flush=True)
        jobs = bench.job_dir(sleepers=SLEEPERS)
        env = {**bench.env, "TPURUN_TPU": "wd"}
        argv = [*common.tpurun_bin(), "train", "sleepers.py", str(args.procs), "--runtime", "cpu", "--launch", "host"]
        argv.append("--detach")
        job = subprocess.run(argv, env=env, cwd=jobs, capture_output=True, text=True, check=True).stdout.strip()
        time.sleep(3)
        res["fast_procs"] = {**measure(pid, args.window), "tick": 1.0}
        print(f"+{args.procs} processes:", res["fast_procs"], flush=True)
        subprocess.run([*common.tpurun_bin(), "cancel", job], env=env, cwd=jobs, capture_output=True, check=False)
        arm(bench, 30)
        time.sleep(32)  # the watchdog finishes its last fast look and sleeps its first 30 s
        res["production"] = {**measure(pid, args.prod), "tick": 30.0}
        print("as deployed:", res["production"], flush=True)
    res["seconds"] = time.monotonic() - t0
    common.publish(res, render(res), "watchdog", "### The TPU watchdog's own cost", write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
