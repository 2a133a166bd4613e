"""Commands that need no TPU: topology, config, and the emulator's own command group."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from tpurun import settings, topology, ui
from tpurun.cli.options import JsonOpt, parsing
from tpurun.cloud.backend import Kind
from tpurun.errors import TpurunError

config_app = typer.Typer(help="Show tpurun's resolved settings.", no_args_is_help=True)


# ---------------------------------------------------------------- topology


def topology_cmd(
    accelerator_type: Annotated[
        str | None,
        typer.Argument(metavar="TYPE", help="Accelerator type, e.g. v3-32, v4-16, v5litepod-16, v6e-8, tpu7x-32."),
    ] = None,
    list_all: Annotated[bool, typer.Option("--list", help="List every accelerator type.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """What an accelerator type is: hosts, chips, cores, PJRT devices and device files per host."""
    if list_all or accelerator_type is None:
        if accelerator_type is None and not list_all:
            raise TpurunError("give an accelerator type such as v4-32, or --list to see them all")
        tops = [topology.parse_accelerator_type(n) for n in topology.all_accelerator_types()]
        if json_out:
            ui.print_json([t.to_dict() for t in tops])
            return
        ui.table(
            None,
            ["type", "hosts", "chips/host", "cores/host", "pjrt devices/host", "topology", "machine type"],
            [
                (
                    t.name,
                    t.hosts,
                    t.chips_per_host,
                    t.cores_per_host,
                    t.pjrt_devices_per_host,
                    t.topology,
                    t.machine_type or "-",
                )
                for t in tops
            ],  # fmt: skip
        )
        return
    t = topology.parse_accelerator_type(accelerator_type)
    if json_out:
        ui.print_json(t.to_dict())
        return
    rows = [
        ("generation", t.generation),
        ("API type", t.api_type or "-"),
        ("physical topology", t.topology),
        ("hosts (TPU VMs)", t.hosts),
        ("chips", t.chips),
        ("TensorCores", t.cores),
        ("chips per host", t.chips_per_host),
        ("cores per chip", t.cores_per_chip),
        ("cores per host", t.cores_per_host),
        ("PJRT devices per host", t.pjrt_devices_per_host),
        ("host bounds", t.host_bounds),
        ("chips per host bounds", t.chips_per_host_bounds),
        ("device files", " ".join(t.device_files)),
        ("made by", ", ".join(Kind(b).api_name for b in t.backends)),
        ("default runtime version", t.default_runtime_version or "-"),
        ("Compute Engine machine type", t.machine_type or "-"),
        ("PCI device (subsystem)", f"{t.pci_ids[0]} ({t.pci_ids[1]})"),
    ]
    ui.table(t.name, ["field", "value"], rows)


# ---------------------------------------------------------------- config


@config_app.command("show")
def config_show(
    project: Annotated[str | None, typer.Option(help="GCP project.")] = None,
    zone: Annotated[str | None, typer.Option(help="Zone, e.g. us-central2-b.")] = None,
    tpu: Annotated[str | None, typer.Option(help="Default TPU name.")] = None,
    api_endpoint: Annotated[str | None, typer.Option(help="Cloud TPU API endpoint.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Every resolved setting with the source it came from."""
    from tpurun.cloud import oslogin

    s = settings.resolve({"project": project, "zone": zone, "tpu": tpu, "api_endpoint": api_endpoint})
    shown = [oslogin.account_setting(s, os.environ) if x.key == "account" else x for x in s.all()]
    if json_out:
        ui.print_json({x.key: {"value": x.value, "source": x.source} for x in shown})
        return
    ui.table(None, ["setting", "value", "source"], [(x.key, x.value or "-", x.source) for x in shown])


# ---------------------------------------------------------------- emulator (lazy: the library never imports it)


@parsing(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def emulator_cmd(ctx: typer.Context) -> None:
    """A local Cloud TPU API whose nodes are real sshd hosts (start, stop, status, faults)."""
    from tpurun.emulator import cli

    rc = cli.run(list(ctx.args), resolve=settings.resolve)
    if rc:
        raise typer.Exit(rc)
