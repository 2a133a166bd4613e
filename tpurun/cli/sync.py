"""`tpurun sync`: the command line around tpurun.sync.sender (options, progress bar, summary, exit code)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from tpurun import settings, ui
from tpurun.cli.options import JsonOpt, LocalOpt, TpuOpt, WorkerOpt
from tpurun.cli.output import stop_on_signals
from tpurun.errors import ExitCode, UsageError
from tpurun.sync.sender import (
    Counters,
    Interrupted,
    WorkerStats,
    build_manifest,
    check_local_dest,
    default_dest,
    early_streams,
    sync,
)
from tpurun.transport import targets


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class _Bar:
    """A rich progress bar (bytes and files) fed from the sending threads' counters."""

    def __init__(self, progress: Counters) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as RichProgress

        self.counters = progress
        self.bar = RichProgress(
            TextColumn("sync"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[files]}"),
            TimeElapsedColumn(),
            console=ui.err(),
            transient=True,
        )
        self.task = self.bar.add_task("sync", total=None, files="")
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(0.1):
            c = self.counters
            self.bar.update(
                self.task,
                total=c.bytes_total or None,
                completed=c.bytes_done,
                files=f"{c.files_done}/{c.files_total} files",
            )

    def __enter__(self) -> _Bar:
        self.bar.start()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.bar.stop()


def _report(stats: list[WorkerStats], dest: str, json_out: bool, elapsed: float, manifest_info: dict) -> int:
    if json_out:
        ui.print_json(
            {
                "dest": dest,
                **manifest_info,
                "seconds": round(elapsed, 3),
                "workers": [s.to_json() for s in stats],
            }
        )
    else:
        rows = []
        for s in stats:
            status = "failed" if s.error or s.errors else "ok"
            rows.append(
                (
                    s.name,
                    f"{s.files_sent}/{s.files_total}",
                    _size(s.bytes_sent),
                    s.deleted,
                    f"{s.seconds:.1f} s",
                    status,
                )
            )
        if ui.is_plain():
            for s, row in zip(stats, rows, strict=True):
                print(
                    f"[{s.name}] {row[5]}: sent {row[1]} files, {row[2]}, deleted {s.deleted}, {row[4]} -> {s.dest or dest}",
                    flush=True,
                )
        else:
            ui.table(f"synced to {dest}", ["worker", "files sent", "bytes", "deleted", "time", "result"], rows)
    unreachable = failed = False
    for s in stats:
        label = f"{s.name} ({s.address})"
        if s.error:
            ui.err().print(f"error: {label}: {s.error}" if not s.unreachable else f"error: {s.error}", markup=False)
            unreachable = unreachable or s.unreachable
            failed = True
        if s.errors:
            path, kind, message = s.errors[0]
            where = f"{s.dest}/{path}" if s.dest else path
            verb = {"write": "cannot write", "verify": "verification failed for", "delete": "cannot delete"}.get(
                kind, "cannot sync"
            )
            more = f" (and {len(s.errors) - 1} more files)" if len(s.errors) > 1 else ""
            ui.err().print(f"error: {label}: {verb} {where}: {message}{more}", markup=False)
            failed = True
    if unreachable:
        return ExitCode.UNREACHABLE
    return ExitCode.PROGRAM_FAILED if failed else ExitCode.OK


def sync_cmd(
    src: Annotated[str, typer.Argument(help="Directory to copy (default: the current one).")] = ".",
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    dest: Annotated[
        str | None,
        typer.Option("--dest", "-d", help="Where on each worker (default ~/<name of SRC>; relative = under ~)."),
    ] = None,
    exclude: Annotated[
        list[str] | None, typer.Option("--exclude", "-x", help="Also skip this gitignore-style pattern (repeatable).")
    ] = None,
    delete: Annotated[
        bool, typer.Option("--delete", help="Remove files in dest that SRC no longer has (ignored files are kept).")
    ] = False,
    worker: WorkerOpt = "all",
    json_out: JsonOpt = False,
) -> None:
    """Incremental, content-checked copy of a directory to every selected worker at once."""
    source = Path(src).expanduser()
    if not source.is_dir():
        raise UsageError(f"{src} is not a directory: sync copies a directory (e.g. `tpurun sync .`)")
    source = source.resolve()
    destination = dest or default_dest(source)
    if not local and not settings.resolve({"tpu": tpu}).tpu.value:
        raise UsageError(
            "no TPU named: sync copies a directory to a TPU's workers; name one with --tpu NAME (or TPURUN_TPU, "
            "or tpu in tpurun.toml), or pass --local to copy it on this machine"
        )
    target = targets.resolve(tpu=tpu, local=local, worker_spec=worker, announce=ui.info)
    if target.local:
        destination = str(check_local_dest(source, destination))
    started = time.monotonic()
    home = settings.resolve({"tpu": tpu}).home_path
    stop = threading.Event()
    progress = Counters()
    try:
        with stop_on_signals(stop) as seen:
            # the connections open (network round trips, key exchange) while this thread builds the
            # manifest (walking and statting the tree): a no-op sync of 5,000 files saves the overlap
            opened, start_helper = early_streams()
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="connect") as pool:
                connecting = pool.submit(target.connect, then=start_helper)
                try:
                    manifest = build_manifest(source, exclude or [], cache_dir=home / "sync-cache")
                finally:
                    errors = connecting.result()  # raises what connect raised
            info = {
                "src": str(source),
                "files": len(manifest.files) + len(manifest.links),
                "bytes": manifest.total_bytes,
                "hashed": manifest.hashed,
            }
            show_bar = not json_out and not ui.is_plain()
            try:
                with _Bar(progress) if show_bar else nullcontext():
                    stats = sync(
                        target.runners, source, destination, manifest=manifest, excludes=exclude or [],
                        delete=delete, progress=progress, stop=stop, connect_errors=errors, opened=opened,
                    )  # fmt: skip
            except Interrupted:
                seen["interrupted"] = True
            if seen["interrupted"]:
                ui.err().print("interrupted: nothing half-written is left on the workers", markup=False)
                raise typer.Exit(ExitCode.INTERRUPTED)
            code = _report(stats, destination, json_out, time.monotonic() - started, info)
    finally:
        target.close()
    raise typer.Exit(code)
