"""What IAP's TCP forwarding costs: `tpurun exec -- true` and a first `tpurun sync` on a private pod (no external
addresses) through the emulator's IAP endpoint, against the same on a public pod straight from here.

    sudo .venv/bin/python scripts/bench/iap_bench.py              # writes docs/bench/iap.json and its section
    sudo .venv/bin/python scripts/bench/iap_bench.py --reps 2 --no-write

One emulator in this process, two pods of 32 hosts (v4-256) made by `tpurun create`, one with `--internal-ips`,
and the firewall rule that lets IAP's range in (inserted through Google's Compute Engine client, as gcloud would).
Contenders, interleaved (order rotated each round), each its own `tpurun` process:

- direct: the public pod, each worker dialled at its address (32 SSH connections);
- iap: the private pod, each worker through its own tunnel (32 WebSockets to the IAP endpoint, 32 SSH
  connections inside them);
- iap, relays: the private pod with `--relay`: only the 4 roots are tunnelled to, they reach the rest inside
  the network;
- direct, relays: the public pod with `--relay`, for the relays' own cost.

Then one worker alone (`--worker 0`), direct against through IAP: what one tunnel costs (its WebSocket's
handshake and the session's first frame, and the bytes pumped through this process), i.e. what each root
costs a relayed command.

The sync is a first one each time: a tree of FILES files (KIB KiB each) to a destination no round used before,
removed afterwards (not timed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

WORKERS = 32
FILES, KIB = 64, 64  # the sync's tree: 4 MiB


def allow_iap(endpoint: str) -> None:
    """The firewall rule Google's docs give for IAP, in the bench project (gcloud compute firewall-rules create
    allow-ssh-ingress-from-iap --direction=INGRESS --action=allow --rules=tcp:22 --source-ranges=35.235.240.0/20)."""
    from google.cloud import compute_v1

    from tpurun.emulator.pytest_plugin import global_client

    client = global_client(endpoint, compute_v1.FirewallsClient)
    rule = compute_v1.Firewall(
        name="allow-ssh-ingress-from-iap",
        direction="INGRESS",
        allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
        source_ranges=["35.235.240.0/20"],
    )
    client.insert(project=common.PROJECT, firewall_resource=rule).result(timeout=60)


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = common.record(__file__, reps=args.reps, workers=WORKERS, tree=f"{FILES} x {KIB} KiB")
    import time

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpurun-iap-") as tmp, common.bench_emulator() as bench:
        allow_iap(bench.endpoint)
        public = bench.create(WORKERS)
        bench.tpurun("create", "private", "-t", common.V4_FOR_WORKERS[WORKERS], "--internal-ips")
        bench.nodes["private"] = common.Node("private", [])
        tree = Path(tmp) / "tree"
        tree.mkdir()
        for i in range(FILES):
            (tree / f"f{i:03}.bin").write_bytes(bytes([i % 251]) * (KIB * 1024))
        tpurun = common.tpurun_bin()
        ways = {
            "direct": [public.name],
            "iap": ["private"],
            "iap, relays": ["private", "--relay"],
            "direct, relays": [public.name, "--relay"],
        }

        def exec_(tpu: str, *more: str) -> Callable[[], common.Sample]:
            return lambda: common.timed([*tpurun, "--plain", "exec", "--tpu", tpu, *more, "--", "true"], bench.env)

        def sync(name: str, tpu: str, *more: str) -> Callable[[], common.Sample]:
            rounds = [0]

            def once() -> common.Sample:
                rounds[0] += 1
                dest = f"/root/iap-bench-{name.replace(', ', '-')}-{rounds[0]}"
                sample = common.timed([*tpurun, "--plain", "sync", str(tree), "--tpu", tpu, *more, "--dest", dest],
                                      bench.env)  # fmt: skip
                bench.tpurun("exec", "--tpu", tpu, *more, "--", "rm", "-rf", dest, check=False)
                return sample

            return once

        for tpu, *more in ways.values():  # every path used once: the bundle installed, the records written
            bench.tpurun("exec", "--tpu", tpu, *more, "--", "true")
        res["exec"] = common.interleave(
            {name: exec_(tpu, *more) for name, (tpu, *more) in ways.items()}, args.reps, label="exec "
        )
        res["sync"] = common.interleave(
            {name: sync(name, tpu, *more) for name, (tpu, *more) in ways.items()}, args.reps, label="sync "
        )
        res["one"] = common.interleave(
            {"direct": exec_(public.name, "--worker", "0"), "iap": exec_("private", "--worker", "0")},
            args.reps,
            label="one worker ",
        )
    res["seconds"] = time.monotonic() - started
    return res


def render(res: dict[str, Any]) -> str:
    def cell(x: dict[str, Any]) -> str:
        failed = f", {x['failures']} failed" if x["failures"] else ""
        return f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f}){failed} | {x['cpu_median']:.2f}"

    lines = [
        common.measured(res, f"{res['reps']} interleaved rounds, medians (min-max)"),
        "",
        f"{res['workers']} workers; the sync a first one of a {res['tree']} tree. Client CPU: the tpurun process's "
        "user+sys seconds (its tunnels' threads included).",
        "",
        "| command | path | wall (s) | client CPU (s) |",
        "| --- | --- | --- | --- |",
    ]
    for command, key in (("exec -- true", "exec"), ("first sync", "sync")):
        for path, x in res[key].items():
            lines.append(f"| {command} | {path} | {cell(x)} |")
    one = res["one"]
    d, i = one["direct"], one["iap"]
    lines += [
        "",
        "One worker alone (`exec --worker 0 -- true`): what one tunnel costs, i.e. what each root costs a relayed "
        "command.",
        "",
        "| path | wall (s) | client CPU (s) |",
        "| --- | --- | --- |",
        f"| direct | {cell(d)} |",
        f"| iap | {cell(i)} |",
        f"| one tunnel | +{(i['median'] - d['median']) * 1000:.0f} ms | +{(i['cpu_median'] - d['cpu_median']) * 1000:.0f}"
        " ms |",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    res = run(args)
    common.publish(res, render(res), "iap", "## IAP's TCP forwarding (#52)", write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
