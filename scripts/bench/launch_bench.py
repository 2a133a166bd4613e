#!/usr/bin/env python3
"""Launch benchmark: `tpurun exec -- true` against pdsh, parallel-ssh and a bare paramiko loop (the floor).

On emulated nodes of 8, 32, 64 (and 128 with --full) workers, interleaved run by run, N repetitions:

* tpurun   `tpurun exec --tpu NODE -- true` (includes the Cloud TPU API get_node call it makes)
* pdsh     `pdsh -R ssh -f N -w HOSTS true`, OpenSSH with tpurun's key and pinned known_hosts
* pssh     `parallel-ssh -p N -H HOSTS -x '<same ssh options>' true`
* floor    this script with --floor: Python + paramiko, one thread per worker: connect (same key,
           same pinned host keys, RejectPolicy), exec `true`, read the exit status, close.

For each: wall time, and CPU seconds (user+sys) and peak RSS of the client process (wait4).
WAN: an 8-worker node behind the latency proxy (tpurun.testing.latency_proxy) at 0, 25, 50 and 100 ms
RTT, tpurun and the floor; the extra round trips = (time - time at 0 ms) / RTT.

Writes docs/bench/launch.json, docs/bench/launch_vs_workers.png, docs/bench/rtt.png and the
generated table in docs/benchmarks.md. Needs root (the emulator). Usage:

    sudo .venv/bin/python scripts/bench/launch_bench.py --quick      # 8 and 32 workers, 3 reps
    sudo .venv/bin/python scripts/bench/launch_bench.py              # 8, 32, 64; 5 reps
    sudo .venv/bin/python scripts/bench/launch_bench.py --full       # 8, 32, 64, 128; 5 reps
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

RTTS_MS = [0, 25, 50, 100]


def floor_main(key: str, known_hosts: str, user: str, hosts: list[str]) -> int:
    """The floor: paramiko connect + exec `true` + exit status + close, one thread per worker."""
    import paramiko

    pkey = paramiko.Ed25519Key.from_private_key_file(key)
    codes: dict[str, int] = {}

    def one(hostport: str) -> None:
        host, _, port = hostport.partition(":")
        c = paramiko.SSHClient()
        c.load_host_keys(known_hosts)
        c.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            c.connect(host, port=int(port or 22), username=user, pkey=pkey, allow_agent=False, look_for_keys=False)
            chan = c.get_transport().open_session()  # type: ignore[union-attr]
            chan.exec_command("true")
            codes[hostport] = chan.recv_exit_status()
        except Exception as exc:  # a failure shows in the exit code
            print(f"{hostport}: {exc}", file=sys.stderr)
            codes[hostport] = 255
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(codes.values(), default=0)


class Contenders:
    def __init__(self, bench: common.Bench) -> None:
        self.bench = bench

    def tpurun(self, node: common.Node, env: dict[str, str] | None = None) -> common.Sample:
        return common.timed(
            [*common.tpurun_bin(), "exec", "--tpu", node.name, "--", "true"], env or self.bench.env, self.bench.home
        )

    def pdsh(self, hosts: list[str]) -> common.Sample:
        env = dict(self.bench.env)
        env["PDSH_SSH_ARGS"] = shlex.join(self.bench.ssh_options()) + " -l%u %h"
        env["PDSH_RCMD_TYPE"] = "ssh"
        return common.timed(
            ["pdsh", "-R", "ssh", "-l", "root", "-f", str(len(hosts)), "-w", ",".join(hosts), "true"], env
        )

    def pssh(self, hosts: list[str]) -> common.Sample:
        argv = ["parallel-ssh", "-p", str(len(hosts)), "-l", "root", "-t", "60"]
        argv += ["-x", shlex.join(self.bench.ssh_options())]
        for h in hosts:
            argv += ["-H", h]
        return common.timed([*argv, "true"], self.bench.env, self.bench.home)

    def floor(self, hosts: list[str]) -> common.Sample:
        b = self.bench
        argv = [sys.executable, __file__, "--floor", str(b.key), str(b.known_hosts), "root", *hosts]
        return common.timed(argv, b.env, b.home)


def launch(bench: common.Bench, sizes: list[int], reps: int) -> dict[str, Any]:
    c = Contenders(bench)
    out: dict[str, Any] = {}
    for n in sizes:
        node = bench.create(n)
        hosts = node.workers
        out[str(n)] = common.interleave(
            {
                "tpurun": lambda node=node: c.tpurun(node),
                "pdsh": lambda hosts=hosts: c.pdsh(hosts),
                "parallel-ssh": lambda hosts=hosts: c.pssh(hosts),
                "floor": lambda hosts=hosts: c.floor(hosts),
            },
            reps,
            label=f"{n:>3} workers ",
        )
        bench.delete(node)
    return out


def wan(bench: common.Bench, reps: int) -> dict[str, Any]:
    from tpurun.testing.latency_proxy import ProxyGroup

    c = Contenders(bench)
    node = bench.create(8)
    group = ProxyGroup(rtt=0.0)
    out: dict[str, Any] = {}
    try:
        env, proxied = bench.behind(group, node)
        for rtt_ms in RTTS_MS:
            group.set_rtt(rtt_ms / 1000)
            out[str(rtt_ms)] = common.interleave(
                {"tpurun": lambda: c.tpurun(node, env), "floor": lambda: c.floor(proxied)},  # noqa: B023
                reps,
                label=f"{rtt_ms:>3} ms RTT ",
            )
    finally:
        group.close()
        bench.delete(node)
    base = out[str(RTTS_MS[0])]
    for rtt_ms in RTTS_MS[1:]:
        for name, r in out[str(rtt_ms)].items():
            r["round_trips"] = (r["median"] - base[name]["median"]) / (rtt_ms / 1000)
        t, f = out[str(rtt_ms)]["tpurun"], out[str(rtt_ms)]["floor"]
        t["beyond_floor_rtt"] = (t["median"] - f["median"]) / (rtt_ms / 1000)
    return out


def plots(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    common.BENCH_DOCS.mkdir(parents=True, exist_ok=True)
    launch_r = result["launch"]
    sizes = sorted(int(n) for n in launch_r)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in [("tpurun", "o-"), ("pdsh", "s--"), ("parallel-ssh", "^--"), ("floor", "k:")]:
        med = [launch_r[str(n)][name]["median"] * 1000 for n in sizes]
        lo = [m - launch_r[str(n)][name]["min"] * 1000 for m, n in zip(med, sizes, strict=True)]
        hi = [launch_r[str(n)][name]["max"] * 1000 - m for m, n in zip(med, sizes, strict=True)]
        ax.errorbar(sizes, med, yerr=[lo, hi], fmt=style, capsize=3, label=name)
        cpu = [launch_r[str(n)][name]["cpu_median"] * 1000 for n in sizes]
        ax2.plot(sizes, cpu, style, label=name)
    ax.set(xlabel="workers", ylabel="wall time (ms), median and min-max", title="launch `true` on every worker")
    ax2.set(xlabel="workers", ylabel="client CPU ms (user+sys, median)", title="the client's own CPU cost")
    for a in (ax, ax2):
        a.set_xticks(sizes)
        a.grid(alpha=0.3)
        a.legend()
        a.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(common.BENCH_DOCS / "launch_vs_workers.png", dpi=110)
    plt.close(fig)

    w = result.get("wan")
    if w:
        rtts = sorted(int(r) for r in w)
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for name, style in [("tpurun", "o-"), ("floor", "k:")]:
            med = [w[str(r)][name]["median"] * 1000 for r in rtts]
            ax.plot(rtts, med, style, label=name)
        floor = [w[str(r)]["floor"]["median"] * 1000 + r for r in rtts]
        ax.plot(rtts, floor, "g--", alpha=0.6, label="floor + 1 RTT (target)")
        ax.set(
            xlabel="RTT (ms)",
            ylabel="wall time (ms), median",
            title="exec `true` on 8 workers behind the latency proxy",
        )
        ax.set_xticks(rtts)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(common.BENCH_DOCS / "rtt.png", dpi=110)
        plt.close(fig)


def launch_rows(launch: dict[str, Any]) -> list[str]:
    """The launch table (header and one row per workers × contender), also used by run_all.py."""
    lines = [
        "| workers | contender | median (ms) | min-max (ms) | tpurun / it | client CPU (ms) | client peak RSS (MiB) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, row in sorted(launch.items(), key=lambda kv: int(kv[0])):
        t = row["tpurun"]["median"]
        for name, r in row.items():
            if r.get("failures"):  # a contender that failed (e.g. not installed) has no time worth showing
                lines.append(f"| {n} | {name} | failed in {r['failures']} of {r['n']} runs | | | | |")
                continue
            ratio = "" if name == "tpurun" else f"{t / r['median']:.2f}×"
            lines.append(
                f"| {n} | {name} | {r['median'] * 1000:.0f} | {r['min'] * 1000:.0f}-{r['max'] * 1000:.0f} | {ratio} "
                f"| {r['cpu_median'] * 1000:.0f} | {r['rss_mib_max']:.0f} |"
            )
    return lines


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"Measured {m['date']} on {common.machine_line(m)}; {result['repetitions']} interleaved repetitions "
        f"(after one warm-up round), `{result['command']}`.",
        "",
        *launch_rows(result["launch"]),
    ]
    w = result.get("wan")
    if w:
        lines += [
            "",
            "WAN: 8 workers behind the latency proxy (the 0 ms row is the proxy alone).",
            "",
            "| RTT (ms) | tpurun median (ms) | floor median (ms) | tpurun − floor (RTTs) | tpurun round trips vs 0 ms | floor round trips vs 0 ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for rtt, row in sorted(w.items(), key=lambda kv: int(kv[0])):
            t, f = row["tpurun"], row["floor"]
            beyond = f"{t['beyond_floor_rtt']:.2f}" if "beyond_floor_rtt" in t else ""
            rt_t = f"{t['round_trips']:.1f}" if "round_trips" in t else ""
            rt_f = f"{f['round_trips']:.1f}" if "round_trips" in f else ""
            lines.append(
                f"| {rtt} | {t['median'] * 1000:.0f} | {f['median'] * 1000:.0f} | {beyond} | {rt_t} | {rt_f} |"
            )
    lines += ["", "![launch time vs workers](bench/launch_vs_workers.png)"]
    if w:
        lines += ["", "![launch time vs RTT](bench/rtt.png)"]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--floor":
        key, known_hosts, user, *hosts = sys.argv[2:]
        return floor_main(key, known_hosts, user, hosts)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 32 workers, 3 repetitions")
    ap.add_argument("--full", action="store_true", help="8, 32, 64 and 128 workers")
    ap.add_argument("--sizes", help="comma-separated worker counts (overrides --quick/--full)")
    ap.add_argument("--reps", type=int, help="repetitions (default 3 quick, 5 otherwise)")
    ap.add_argument("--no-wan", action="store_true", help="skip the latency-proxy runs")
    ap.add_argument("--wan-only", action="store_true", help="only the latency-proxy runs")
    ap.add_argument("--out", default=str(common.BENCH_DOCS / "launch.json"), help="results JSON")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = ap.parse_args()
    sizes = [8, 32] if args.quick else [8, 32, 64, 128] if args.full else [8, 32, 64]
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",")]
    reps = args.reps or (3 if args.quick else 5)
    command = "sudo .venv/bin/python scripts/bench/launch_bench.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result: dict[str, Any] = {"machine": common.machine(), "repetitions": reps, "command": command.strip()}
    t0 = time.monotonic()
    with common.bench_emulator() as bench:
        if not args.wan_only:
            result["launch"] = launch(bench, sizes, reps)
        if not args.no_wan:
            result["wan"] = wan(bench, reps)
    result["seconds"] = round(time.monotonic() - t0, 1)
    print(f"done in {result['seconds']:.0f}s")
    if args.no_write:
        print(json.dumps(result, indent=1))
        return 0
    out = Path(args.out)
    if args.wan_only and out.exists():  # keep the earlier launch results
        result = {**json.loads(out.read_text()), "wan": result["wan"], "machine": result["machine"]}
    elif out.exists():  # sizes measured earlier and not now are kept (this run's win)
        old = json.loads(out.read_text())
        result["launch"] = {**old.get("launch", {}), **result["launch"]}
        if args.no_wan and "wan" in old:
            result["wan"] = old["wan"]
    common.write_json(out, result)
    plots(result)
    common.replace_section(
        common.DOCS / "benchmarks.md",
        "launch",
        table(result),
        "## Launch: tpurun exec vs pdsh, parallel-ssh and the paramiko floor",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
