#!/usr/bin/env python3
"""Connect window benchmark: `tpurun exec -- true` on one emulated pod with several TPURUN_CONNECT_WINDOW values.

The window W bounds how many workers tpurun is connecting to at once (the rest wait until a handshake is
over). Each W is run interleaved with the others, N repetitions, directly and behind the latency proxy
(tpurun.testing.latency_proxy) at 50 ms RTT, where each extra wave of handshakes costs its round trips.

Writes docs/bench/window.json and its table in docs/benchmarks.md. Needs root (the emulator). Usage:

    sudo .venv/bin/python scripts/bench/window_bench.py --workers 32 --reps 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

WINDOWS = [4, 8, 16, 32, 64]
RTT = 0.05


def run(bench: common.Bench, workers: int, reps: int, windows: list[int]) -> dict[str, Any]:
    from tpurun.testing.latency_proxy import ProxyGroup, address_map_env, proxy_workers

    node = bench.create(workers)
    info = bench.server.emu.node_info(f"projects/{common.PROJECT}/locations/{common.ZONE}/nodes/{node.name}")

    def exec_with(window: int, extra: dict[str, str]) -> common.Sample:
        env = {**bench.env, "TPURUN_CONNECT_WINDOW": str(window), **extra}
        return common.timed([*common.tpurun_bin(), "exec", "--tpu", node.name, "--", "true"], env, bench.home)

    out: dict[str, Any] = {"workers": workers, "rtt_ms": RTT * 1000}
    out["direct"] = common.interleave({f"W={w}": (lambda w=w: exec_with(w, {})) for w in windows}, reps, label="0 ms ")
    group = ProxyGroup(rtt=RTT).start()
    try:
        mapping = proxy_workers(group, [(w["address"], w["sshPort"]) for w in info["workers"]])
        far = {"TPURUN_ADDRESS_MAP": address_map_env(mapping)}
        out["wan"] = common.interleave(
            {f"W={w}": (lambda w=w: exec_with(w, far)) for w in windows}, reps, label=f"{RTT * 1000:.0f} ms "
        )
    finally:
        group.close()
    bench.delete(node)
    return out


def table(res: dict[str, Any]) -> str:
    rows = [
        f"`tpurun exec -- true` on {res['workers']} emulated workers, by TPURUN_CONNECT_WINDOW (median of the runs, "
        f"ms; min-max), directly and behind the latency proxy at {res['rtt_ms']:.0f} ms RTT. {res['machine']}.",
        "",
        f"| window | direct | CPU (direct) | {res['rtt_ms']:.0f} ms RTT |",
        "| --- | --- | --- | --- |",
    ]
    for name, d in res["direct"].items():
        w = res["wan"][name]
        rows.append(
            f"| {name[2:]} | {d['median'] * 1000:.0f} ({d['min'] * 1000:.0f}-{d['max'] * 1000:.0f}) "
            f"| {d['cpu_median'] * 1000:.0f} | {w['median'] * 1000:.0f} ({w['min'] * 1000:.0f}-{w['max'] * 1000:.0f}) |"
        )
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=32, choices=sorted(common.V4_FOR_WORKERS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--windows", default=",".join(map(str, WINDOWS)))
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    with common.bench_emulator() as bench:
        res = run(bench, args.workers, args.reps, windows)
    res["machine"] = common.machine_line(common.machine())
    common.publish(res, table(res), "window", "## The connect window", write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
