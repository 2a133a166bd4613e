"""`python -m tpurun.emulator serve ...`: the emulator server process `tpurun emulator start` detaches.

It runs in the foreground until POST /emulator/v1/shutdown, SIGTERM or SIGINT, then tears every
worker down before exiting. `server.json` in the state dir says where it listens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from tpurun.config import EMULATOR_SLOTS
from tpurun.emulator.api import EmulatorServer
from tpurun.emulator.model import ApiError, Capacity, Delays, EmulatorConfig, default_max_workers, parse_slots
from tpurun.emulator.state import Emulator


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tpurun.emulator")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the emulator in the foreground")
    s.add_argument("--state-dir", type=Path, required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--ssh-port", type=int, default=22)
    s.add_argument("--key-propagation-delay", type=float, default=0.5)
    s.add_argument("--max-workers", type=int, default=None)  # None: model.default_max_workers
    s.add_argument("--capacity", action="append", default=[])
    for name in Delays.__dataclass_fields__:
        s.add_argument(f"--delay-{name}", type=float, default=None)
    return p


def build(args: argparse.Namespace) -> EmulatorServer:
    """The server for ARGS, bound but not yet serving."""
    from tpurun.emulator.hosts import WorkerHosts

    state_dir: Path = args.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    delays = Delays()
    for name in Delays.__dataclass_fields__:
        v = getattr(args, f"delay_{name}")
        if v is not None:
            setattr(delays, name, v)
    cap = Capacity()
    for spec in args.capacity:
        k, v = Capacity.parse(spec)
        cap.limits[k] = v
    config = EmulatorConfig(
        state_dir=state_dir,
        delays=delays,
        capacity=cap,
        max_workers_per_node=args.max_workers or default_max_workers(),
        slots=parse_slots(EMULATOR_SLOTS.raw()),
    )
    hosts = WorkerHosts(state_dir, ssh_port=args.ssh_port, key_propagation_delay=args.key_propagation_delay)
    try:
        return EmulatorServer(Emulator(hosts, config), port=args.port)
    except BaseException:
        hosts.close()
        raise


def serve(args: argparse.Namespace) -> int:
    try:
        server = build(args)
    except (OSError, ValueError, ApiError) as e:
        print(f"emulator: cannot start: {e}", file=sys.stderr)
        return 1
    info = args.state_dir.resolve() / "server.json"
    tmp = info.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "port": server.port, "endpoint": server.endpoint}))
    tmp.replace(info)

    def on_signal(signum: int, frame: object) -> None:
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start_thread()
    print(f"emulator listening on {server.endpoint} (pid {os.getpid()})", flush=True)
    server.wait()
    info.unlink(missing_ok=True)
    print("emulator stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
