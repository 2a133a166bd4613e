#!/usr/bin/env python3
"""Relays against straight connections: what a command costs this machine as the pod grows.

For each pod size (one node each, made with `tpurun create` in one in-process emulator), interleaved runs of
the same command with `--relay` and with `--no-relay`:

* exec     `tpurun exec -- true`, and pdsh's `pdsh -R ssh -f 32 -w HOSTS true` (its default fan-out;
           OpenSSH with tpurun's key and the workers' pinned keys) as the peer
* jobs     `tpurun kill-stale --dry-run` (an answer from every worker: a `call` of the Fleet)

and for each: wall time, client CPU seconds (user+sys, of every process of the command: pdsh's ssh clients
too) and peak RSS (GNU time), and the command's peak threads and open sockets (its processes' /proc polled
every 20 ms). The relayed command's cost should not grow with the pod; the straight one's does. 2,048
workers are two slices of v5p-8192 (a multislice queued resource): the largest single slice is 1,536.

    sudo .venv/bin/python scripts/bench/relay_bench.py [--sizes 32,256,1024,2048] [--reps 3] [--wan] [--created]
        [--only exec] [--modes relay,direct,pdsh] [--write]
    sudo .venv/bin/python scripts/bench/relay_bench.py --sizes '' --wan [--against OTHER_CHECKOUT] --reps 5

(`--wan`: `exec` on 8 and 32 workers behind the latency proxy, relayed, direct and the floor; `--against`: also
another checkout's tpurun in the same rounds, for a before and after.)

(`--created`: also a v5p-8192 made by `tpurun create`, its workers running tpurun's watchdog, then `exec`.
`--write` adds this run's sizes, commands and paths to the last run's, in docs/bench/relays.json, and draws
docs/bench/relays.png.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

TYPES = {8: "v4-64", 32: "v4-256", 64: "v4-512", 128: "v4-1024", 256: "v4-2048", 512: "v4-4096", 1024: "v5p-8192"}
SLICES = {2048: ("v5p-8192", 2)}  # past the largest slice (1,536 hosts): a multislice TPU
COMMANDS = {"exec": ["exec", "--", "true"], "kill-stale": ["kill-stale", "--dry-run"]}
MODES = ("relay", "direct", "pdsh")  # pdsh: exec only
PDSH_FANOUT = 32  # pdsh's default


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    """PID's descendants."""
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _is_time(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0] == b"/usr/bin/time"
    except OSError:
        return False


def _threads_sockets(pid: int) -> tuple[int, int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        sockets = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    sockets += 1
            except OSError:
                pass
        return threads, sockets
    except (OSError, StopIteration):
        return 0, 0


_SS_SOCKET = re.compile(r"^\S+\s+\S+\s+(\S+)\s+(\S+)\s+users:.*?pid=(\d+),")


def _tcp_sent(pids: set[int], into: dict[tuple[str, str], int]) -> None:
    """The bytes each TCP connection of PIDS has sent so far (the kernel's tcp_info, through `ss`), into INTO."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True).stdout
    which = None
    for line in out.splitlines():
        m = _SS_SOCKET.match(line)
        if m:
            which = (m.group(1), m.group(2)) if int(m.group(3)) in pids else None
        elif which and "bytes_sent:" in line:
            into[which] = int(line.split("bytes_sent:")[1].split()[0])


def measured(
    argv: list[str], env: dict[str, str], cwd: Path | None = None, stdout: Any = None, *, tcp: bool = False
) -> dict[str, Any]:
    """ARGV under GNU time, the peak threads and sockets of its processes polled meanwhile (every 20 ms); with TCP, also the
    bytes it sent over TCP (its connections' counters read every 100 ms: a connection's last 100 ms before
    it closes are not counted)."""
    peak = [0, 0]
    sent: dict[tuple[str, str], int] = {}
    done = threading.Event()

    def poll() -> None:
        last_ss = 0.0
        while not done.is_set():
            pids = set()
            for p in _children(os.getpid()):  # /usr/bin/time (and the emulator's workers, not measured)
                if _is_time(p):
                    pids.update(_tree(p))  # tpurun, or pdsh and its ssh clients
            now = [_threads_sockets(q) for q in pids]
            peak[0], peak[1] = max(peak[0], sum(t for t, _ in now)), max(peak[1], sum(s for _, s in now))
            if tcp and pids and time.monotonic() - last_ss > 0.1:
                last_ss = time.monotonic()
                _tcp_sent(pids, sent)
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    sample = common.timed(argv, env, cwd, stdout)
    done.set()
    poller.join()
    return {"wall": sample.wall, "cpu": sample.cpu, "rss": sample.rss_mib, "threads": peak[0], "sockets": peak[1],
            "sent": sum(sent.values()), "code": sample.code}  # fmt: skip


def _client(bench: common.Bench) -> Any:
    """google-cloud-tpu's client on the bench's emulator."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import tpu_v2

    return tpu_v2.TpuClient(
        transport="rest", client_options={"api_endpoint": bench.endpoint}, credentials=AnonymousCredentials()
    )


def made(bench: common.Bench, name: str, accelerator_type: str) -> None:
    """A READY node made through the Cloud TPU API (no startup script, so no watchdog of tpurun's on each
    worker: a Python process per worker would crowd 1,024 emulated workers out of this machine's memory),
    then adopted with `tpurun attach` (host keys pinned, tpurun's key installed)."""
    from google.cloud import tpu_v2

    from tpurun.emulator.pytest_plugin import fast_polling

    client = _client(bench)
    node = tpu_v2.Node(
        accelerator_type=accelerator_type,
        runtime_version="tpu-ubuntu2204-base",
        network_config=tpu_v2.NetworkConfig(enable_external_ips=True),  # reached from this machine
    )
    op = client.create_node(parent=f"projects/{common.PROJECT}/locations/{common.ZONE}", node_id=name, node=node)
    op.result(polling=fast_polling().with_timeout(1800))
    bench.tpurun("attach", name)


def made_slices(bench: common.Bench, name: str, accelerator_type: str, slices: int) -> list[str]:
    """A multislice TPU NAME of SLICES slices made through a queued resource (no startup script, as made()),
    then adopted with `tpurun attach`; its slices' node names."""
    from google.api_core.exceptions import NotFound
    from google.cloud import tpu_v2

    from tpurun.emulator.pytest_plugin import fast_polling

    client = _client(bench)
    parent = f"projects/{common.PROJECT}/locations/{common.ZONE}"
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
        parent=parent,
        multislice_params=tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(node_count=slices, node_id_prefix=name),
        node=tpu_v2.Node(
            accelerator_type=accelerator_type,
            runtime_version="tpu-ubuntu2204-base",
            network_config=tpu_v2.NetworkConfig(enable_external_ips=True),
        ),
    )
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
    op = client.create_queued_resource(parent=parent, queued_resource_id=name, queued_resource=qr)
    op.result(polling=fast_polling().with_timeout(1800))
    nodes = [f"{name}-{i}" for i in range(slices)]
    for node in nodes:  # the queued resource is made at once; its slices when it is provisioned
        while True:
            try:
                if client.get_node(name=f"{parent}/nodes/{node}").state == tpu_v2.Node.State.READY:
                    break
            except NotFound:
                pass
            time.sleep(2)
    bench.tpurun("attach", name)
    return nodes


def pdsh_argv(bench: common.Bench, hosts: list[str]) -> tuple[list[str], dict[str, str]]:
    """pdsh running `true` on HOSTS through OpenSSH, with its default fan-out, and its environment."""
    env = dict(bench.env, PDSH_RCMD_TYPE="ssh")
    env["PDSH_SSH_ARGS"] = " ".join(bench.ssh_options()) + " -l%u %h"
    return ["pdsh", "-R", "ssh", "-l", "root", "-f", str(PDSH_FANOUT), "-w", ",".join(hosts), "true"], env


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="32,256,1024,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated commands of " + ", ".join(COMMANDS))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated paths of " + ", ".join(MODES))
    ap.add_argument(
        "--wan", action="store_true", help="also 8 and 32 workers behind the latency proxy at 0 and 50 ms RTT"
    )
    ap.add_argument("--rtts", default="0,50", help="with --wan: the two RTTs in ms (default 0,50)")
    ap.add_argument("--against", default="", help="with --wan: also the tpurun of this checkout (a before and after)")
    ap.add_argument("--created", action="store_true", help="also a v5p-8192 made by `tpurun create`, then exec")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]  # none: --wan or --created alone
    results: dict[str, Any] = {"machine": common.machine(), "commands": [], "sizes": {}}
    saved = common.BENCH_DOCS / "relays.json"
    if args.write and saved.exists():  # a run adds its sizes, commands and paths to the last run's
        results = json.loads(saved.read_text()) | {"machine": results["machine"]}
        results.setdefault("commands", [])
    results["commands"].append(shlex.join(sys.argv[1:]))
    with common.bench_emulator() as bench:
        bench.server.emu.config.max_workers_per_node = max(
            [s for s in sizes if s in TYPES] + [32] + ([1024] if args.created else [])
        )
        for size in sizes:
            name = f"relay{size}"
            t0 = time.monotonic()
            if size in SLICES:
                nodes = made_slices(bench, name, *SLICES[size])
            else:
                made(bench, name, TYPES[size])
                nodes = [name]
            hosts = bench.pin_for_peers(*nodes)
            print(f"created {name} ({size} workers) in {time.monotonic() - t0:.1f}s", flush=True)
            bench.nodes[name] = common.Node(name, hosts)
            rows = results["sizes"].setdefault(str(size), {})
            for what, command in COMMANDS.items():
                if args.only and what not in args.only.split(","):
                    continue
                modes = [m for m in args.modes.split(",") if m != "pdsh" or what == "exec"]
                rows[what] = rows.get(what, {}) | measure_modes(bench, name, hosts, command, modes, args.reps)
            if args.write:
                common.write_json(saved, results)  # kept as it goes: a later size may not fit this machine
            bench.delete(bench.nodes[name])
        if args.wan:
            lo, hi = (int(ms) for ms in args.rtts.split(","))
            results["wan"] = wan(bench, args.reps, args.against, (lo, hi))
        if args.created:
            results["created"] = created(bench, args.reps)
    results["sizes"] = dict(sorted(results["sizes"].items(), key=lambda kv: int(kv[0])))
    if args.write:
        plot(results)
    text = table(results)
    common.publish(results, text, "relays", "## Relays: the client's cost as the pod grows (#42)", write=args.write)
    return 0


def measure_modes(
    bench: common.Bench, name: str, hosts: list[str], command: list[str], modes: list[str], reps: int
) -> dict[str, Any]:
    """COMMAND on NAME by each of MODES, interleaved (the order rotated each round), REPS times after one
    unmeasured round: each mode's medians and its failed runs."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(reps + 1):  # the first round warms up, unmeasured
        k = rep % len(modes)
        for mode in modes[k:] + modes[:k]:
            if mode == "pdsh":
                argv, env = pdsh_argv(bench, hosts)
            else:
                argv, env = (
                    [
                        *common.tpurun_bin(),
                        command[0],
                        "--tpu",
                        name,
                        f"--{'no-' if mode == 'direct' else ''}relay",
                        *command[1:],
                    ],
                    bench.env,
                )
            got = measured(argv, env)
            if rep:
                runs[mode].append(got)
            print(f"  {len(hosts)} {command[0]} {mode}: {got}", flush=True)
    return {
        mode: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu", "rss", "threads", "sockets")}
        | {"failures": sum(1 for r in rs if r["code"] not in (0, 1))}
        for mode, rs in runs.items()
    }


def plot(res: dict[str, Any]) -> None:
    """docs/bench/relays.png: `exec -- true`'s cost to this machine against the pod's size, by path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for mode, style in (("relay", "o-"), ("direct", "s--"), ("pdsh", "^:")):
        rows = [(int(n), r["exec"][mode]) for n, r in res["sizes"].items() if mode in r.get("exec", {})]
        if not rows:
            continue
        xs = [n for n, _ in rows]
        for ax, key in zip(axes, ("cpu", "rss", "sockets"), strict=True):
            ax.plot(xs, [r[key] for _, r in rows], style, label=mode)
    for ax, label in zip(axes, ("client CPU (s, user+sys)", "client peak RSS (MiB)", "peak open sockets"), strict=True):
        ax.set(xscale="log", yscale="log", xlabel="workers", ylabel=label)
        ax.set_xticks(sorted(int(n) for n in res["sizes"]), [str(n) for n in sorted(int(n) for n in res["sizes"])])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("`exec -- true`: this machine's cost as the pod grows (pdsh: its ssh clients included)")
    fig.tight_layout()
    fig.savefig(common.BENCH_DOCS / "relays.png", dpi=100)
    plt.close(fig)


def _used_mib() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def _run(argv: list[str], bench: common.Bench) -> dict[str, Any]:
    """ARGV under GNU time with its stderr kept: wall, client CPU, peak RSS, the lines it printed, its exit code,
    and this machine's peak memory in use meanwhile (every process of every emulated worker)."""
    peak, done = [_used_mib()], threading.Event()

    def poll() -> None:
        while not done.wait(0.5):
            peak[0] = max(peak[0], _used_mib())

    threading.Thread(target=poll, daemon=True).start()
    with tempfile.NamedTemporaryFile("r", prefix="bench-time-") as tf:
        t0 = time.monotonic()
        proc = subprocess.run(
            ["/usr/bin/time", "-q", "-f", "%U %S %M", "-o", tf.name, *argv],
            env=bench.env, cwd=bench.home, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.monotonic() - t0
        user, system, rss = tf.read().split()[-3:]
    done.set()
    printed = proc.stdout.splitlines() + proc.stderr.splitlines()
    return {"wall": wall, "cpu": float(user) + float(system), "rss": int(rss) / 1024, "lines": len(printed),
            "code": proc.returncode, "peak_used": peak[0], "said": proc.stderr.strip().splitlines()[-3:]}  # fmt: skip


def created(bench: common.Bench, reps: int) -> dict[str, Any]:
    """A v5p-8192 (1,024 hosts) made by `tpurun create`, so that every worker runs tpurun's watchdog as on a real
    TPU, then `exec -- true` (through relays, as `auto` chooses at that size) REPS + 1 times: the first installs
    tpurun's bundle on every worker."""
    name = "made1024"
    out: dict[str, Any] = {"create": _run([*common.tpurun_bin(), "create", name, "-t", "v5p-8192"], bench)}
    print(f"  created {name}: {out['create']}", flush=True)
    bench.nodes[name] = common.Node(name, [])
    time.sleep(30)  # the watchdogs' first looks
    out["idle_used"] = _used_mib()
    out["exec"] = []
    for _ in range(reps + 1):
        out["exec"].append(_run([*common.tpurun_bin(), "exec", "--tpu", name, "--", "true"], bench))
        print(f"  exec on {name}: {out['exec'][-1]}", flush=True)
    bench.delete(bench.nodes[name])
    return out


WAN_SIZES = (8, 32)
WAN_RTTS_MS = (0, 50)


def wan(bench: common.Bench, reps: int, against: str = "", rtts: tuple[int, int] = WAN_RTTS_MS) -> dict[str, Any]:
    """`exec -- true` on 8 and 32 workers whose addresses this machine reaches through the latency proxy (the relays
    reach each other at their own addresses, as inside a slice), relayed, direct, and the floor (launch_bench's:
    paramiko's connect, exec and exit status, a thread per worker), interleaved at RTTS (ms); with AGAINST
    (another checkout of tpurun), its relayed and direct exec too, in the same rounds (a before and after). Per size
    and contender: the medians, the round trips the higher RTT adds, and how far beyond the floor it is there."""
    import launch_bench

    from tpurun.testing.latency_proxy import ProxyGroup

    c = launch_bench.Contenders(bench)
    out: dict[str, Any] = {}
    for size in WAN_SIZES:
        name = f"wan{size}"
        made(bench, name, TYPES[size])
        node = bench.nodes[name] = common.Node(name, bench.pin_for_peers(name))
        group = ProxyGroup(rtt=0.0)
        known = bench.known_hosts.read_text().splitlines()  # the last size's proxies' addresses are this one's
        bench.known_hosts.write_text("".join(f"{line}\n" for line in known if not line.startswith("127.78.")))
        try:
            env, proxied = bench.behind(group, node)

            def tpurun(flag: str, env: dict[str, str], name: str = name) -> Callable[[], common.Sample]:
                argv = [*common.tpurun_bin(), "exec", "--tpu", name, flag, "--", "true"]
                return lambda: common.timed(argv, env, bench.home)

            contenders = {"relay": tpurun("--relay", env), "direct": tpurun("--no-relay", env)}
            if against:
                before = dict(env, PYTHONPATH=against)
                contenders |= {
                    "relay, before": tpurun("--relay", before),
                    "direct, before": tpurun("--no-relay", before),
                }
            contenders["floor"] = lambda proxied=proxied: c.floor(proxied)
            rows = out[str(size)] = {}
            for rtt_ms in rtts:
                group.set_rtt(rtt_ms / 1000)
                rows[str(rtt_ms)] = common.interleave(contenders, reps, label=f"{size:>2} workers {rtt_ms:>2} ms ")
        finally:
            group.close()
        bench.delete(node)
        lo, hi = (rows[str(r)] for r in rtts)
        rtt = (rtts[1] - rtts[0]) / 1000
        for who in contenders:
            rows[who] = {
                "round_trips": (hi[who]["median"] - lo[who]["median"]) / rtt,
                "beyond_floor": (hi[who]["median"] - hi["floor"]["median"]) / rtt,
            }
    return out


def wan_table(wan: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "`exec -- true` behind the latency proxy (this machine's side only; the relays reach each other at their own "
        "addresses, as inside a slice), interleaved with the floor (paramiko's connect, exec and exit status, a thread "
        "per worker). Round trips = (median at the higher RTT − median at 0 ms) / RTT; beyond the floor = (median − "
        "the floor's median) / RTT, at the higher RTT.",
        "",
        "| workers | path | RTTs (ms) | medians (s) | round trips the RTT adds | beyond the floor (RTTs) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for size, rows in wan.items():
        lo, hi = sorted((k for k in rows if k.isdigit()), key=int)
        for who, r in rows.items():
            if who.isdigit():
                continue
            a, b = rows[lo][who]["median"], rows[hi][who]["median"]
            beyond = "" if who == "floor" else f"{r['beyond_floor']:.1f}"
            lines.append(f"| {size} | {who} | {lo}, {hi} | {a:.2f}, {b:.2f} | {r['round_trips']:.1f} | {beyond} |")
    return lines


def table(res: dict[str, Any]) -> str:
    lines = [
        common.machine_line(res["machine"]),
        "",
        "Commands: " + "; ".join(f"`sudo .venv/bin/python scripts/bench/relay_bench.py {c}`" for c in res["commands"])
        + ". Medians of interleaved runs. CPU, RSS, threads and sockets are the command's own processes' (pdsh's: "
        + f"pdsh and its ssh clients, {PDSH_FANOUT} at once).",
        "",
        "| workers | command | path | wall (s) | client CPU (s) | client peak RSS (MiB) | peak threads | peak sockets |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for size, rows in res["sizes"].items():
        for what, modes in rows.items():
            for mode, r in modes.items():
                bad = f" ({r['failures']} failed)" if r["failures"] else ""
                lines.append(
                    f"| {size} | {what} | {mode}{bad} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['rss']:.0f} | "
                    f"{r['threads']:.0f} | {r['sockets']:.0f} |"
                )
    if "wan" in res:
        lines += wan_table(res["wan"])
    if "created" in res:
        made = res["created"]
        lines += [
            "",
            "A v5p-8192 (1,024 hosts) made by `tpurun create` (`--created`: every worker runs tpurun's watchdog), "
            f"this machine using {made['idle_used'] / 1024:.1f} GiB with the pod idle; then `exec -- true`, "
            "relayed (the first run installs tpurun's bundle on every worker).",
            "",
            "| command | exit | wall (s) | client CPU (s) | client peak RSS (MiB) | lines printed | machine's peak memory (GiB) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]  # fmt: skip
        for what, r in [("create", made["create"]), *(("exec", r) for r in made["exec"])]:
            lines.append(
                f"| {what} | {r['code']} | {r['wall']:.1f} | {r['cpu']:.2f} | {r['rss']:.0f} | {r['lines']} | "
                f"{r['peak_used'] / 1024:.1f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
