"""tpurun's command line: commands parse, call one library function, and render its result."""

from __future__ import annotations

import sys
import traceback
from typing import Annotated

import typer

from tpurun import __version__, config, settings, topology, ui
from tpurun.errors import ExitCode, TpurunError

# typer may vendor its own click: find click's exception base through a public typer class
_ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_ClickExit: tuple[type[BaseException], ...] = tuple(
    {typer.Exit, *(c for c in typer.Exit.__mro__ if c.__name__ == "Exit")}
)
_ClickAbort: tuple[type[BaseException], ...] = tuple(
    {typer.Abort, *(c for c in typer.Abort.__mro__ if c.__name__ == "Abort")}
)

app = typer.Typer(
    name="tpurun",
    help="Launch PyTorch/XLA jobs on Cloud TPU VMs and pod slices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
config_app = typer.Typer(help="Show tpurun's resolved settings.", no_args_is_help=True)
app.add_typer(config_app, name="config")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def _version(value: bool) -> None:
    if value:
        print(f"tpurun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Plain output: no colour, no live panels.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug detail.")] = False,
) -> None:
    ui.state.plain = plain or ui.state.plain
    ui.state.debug = debug or ui.state.debug


# ---------------------------------------------------------------- topology


@app.command("topology")
def topology_cmd(
    accelerator_type: Annotated[
        str | None, typer.Argument(metavar="TYPE", help="Accelerator type, e.g. v3-32, v4-16, v5litepod-16.")
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
            ["type", "hosts", "chips/host", "cores/host", "pjrt devices/host", "topology"],
            [(t.name, t.hosts, t.chips_per_host, t.cores_per_host, t.pjrt_devices_per_host, t.topology) for t in tops],
        )
        return
    t = topology.parse_accelerator_type(accelerator_type)
    if json_out:
        ui.print_json(t.to_dict())
        return
    rows = [
        ("generation", t.generation),
        ("API type", t.api_type),
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
        ("default runtime version", t.default_runtime_version),
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
    s = settings.resolve({"project": project, "zone": zone, "tpu": tpu, "api_endpoint": api_endpoint})
    if json_out:
        ui.print_json({x.key: {"value": x.value, "source": x.source} for x in s.all()})
        return
    ui.table(None, ["setting", "value", "source"], [(x.key, x.value or "-", x.source) for x in s.all()])


# ---------------------------------------------------------------- emulator (lazy: the library never imports it)


@app.command(
    "emulator",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def emulator_cmd(ctx: typer.Context) -> None:
    """A local Cloud TPU API whose nodes are real sshd hosts (start, stop, status, faults)."""
    from tpurun.emulator.cli import app as emulator_app

    command = typer.main.get_command(emulator_app)
    rc = command.main(args=list(ctx.args), prog_name="tpurun emulator", standalone_mode=False)
    if isinstance(rc, int) and rc:
        raise typer.Exit(rc)


# ---------------------------------------------------------------- not yet built

_PLACEHOLDERS = {
    "create": "Provision a TPU VM or pod slice.",
    "attach": "Adopt an existing TPU: pin host keys, install the ssh key.",
    "list": "List TPU nodes.",
    "describe": "Describe one TPU node.",
    "delete": "Delete a TPU node.",
    "stop": "Stop a single-host TPU VM.",
    "start": "Start a stopped TPU VM.",
    "exec": "Run a command on every worker.",
    "sync": "Copy a directory to every worker.",
    "ssh": "A shell or one command on one worker.",
    "train": "Run a training script on every core of every worker.",
    "jobs": "List jobs.",
    "logs": "Show a job's logs.",
    "cancel": "Stop a job.",
    "kill-stale": "Free the TPU from stale processes.",
    "doctor": "Check every worker and say what is wrong.",
}


def _placeholder(name: str, help_text: str) -> None:
    def command(ctx: typer.Context) -> None:
        raise TpurunError(f"`tpurun {name}` is not implemented yet")

    command.__doc__ = f"{help_text} (not implemented yet)"
    app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(command)


def register_placeholders(implemented: set[str]) -> None:
    for name, help_text in _PLACEHOLDERS.items():
        if name not in implemented:
            _placeholder(name, help_text)


# ---------------------------------------------------------------- entry point


def _debug_requested(argv: list[str]) -> bool:
    return ui.state.debug or "--debug" in argv or config.DEBUG.on()


# Which module defines each command: `tpurun exec` imports only what exec needs, not every command
# group (cli_nodes alone pulls in provision/startup, sync and train modules). A command not listed here
# (or `--help`, or a typo, so that click can suggest names) loads them all through tpurun.commands;
# `None` means the command lives in this module. tests/cli/test_lazy_commands.py keeps this map true.
COMMAND_MODULES: dict[str, str | None] = {
    "topology": None,
    "config": None,
    "emulator": None,
    **dict.fromkeys(("create", "attach", "list", "describe", "delete", "stop", "start"), "tpurun.cli_nodes"),
    **dict.fromkeys(("exec", "ssh"), "tpurun.cli_remote"),
    "sync": "tpurun.cli_sync",
    **dict.fromkeys(("train", "jobs", "logs", "cancel"), "tpurun.cli_train"),
    **dict.fromkeys(("kill-stale", "doctor"), "tpurun.cli_health"),
}
_ROOT_FLAGS = {"--plain", "--debug", "--version", "-h", "--help"}


_GLOBAL_FLAGS = ("--plain", "--debug")


def hoist_global_flags(args: list[str]) -> list[str]:
    """--plain and --debug work anywhere before `--`: moved in front of the command, so a command never
    refuses them and `train` never hands them to the user's script (after `--` everything is the script's)."""
    end = args.index("--") if "--" in args else len(args)
    flags = [a for a in args[:end] if a in _GLOBAL_FLAGS]
    if not flags:
        return args
    return flags + [a for a in args[:end] if a not in _GLOBAL_FLAGS] + args[end:]


def load_commands(args: list[str]) -> None:
    """Register the command ARGS names (only its module), or every command when that is unclear."""
    import importlib

    name = next((a for a in args if not a.startswith("-")), None)
    if name is None and "--version" in args and not {"-h", "--help"} & set(args):
        return  # `tpurun --version`: eager callback, no command needed
    if name is not None and all(a in _ROOT_FLAGS for a in args[: args.index(name)]) and name in COMMAND_MODULES:
        module = COMMAND_MODULES[name]
        if module is not None:
            importlib.import_module(module)
        return
    importlib.import_module("tpurun.commands")  # registers every command and the placeholders


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every failure becomes one line on stderr and one of the exit codes the README lists."""
    args = hoist_global_flags(sys.argv[1:] if argv is None else argv)
    load_commands(args)
    command = typer.main.get_command(app)
    try:
        rc = command.main(args=args, prog_name="tpurun", standalone_mode=False)
        code = rc if isinstance(rc, int) else 0
    except TpurunError as exc:
        if _debug_requested(args):
            traceback.print_exc()
        ui.err().print(f"error: {exc}", markup=False, style="red")
        code = exc.exit_code
    except _ClickExit as exc:
        code = getattr(exc, "exit_code", 0)
    except _ClickAbort:
        ui.err().print("interrupted", markup=False)
        code = ExitCode.INTERRUPTED
    except _ClickException as exc:
        # one line, like every other error (the framework's own box spans several)
        message = " ".join(str(exc.format_message()).split())  # type: ignore[attr-defined]
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "tpurun"
        ui.err().print(f"error: {message} (see `{where} --help`)", markup=False, style="red")
        code = getattr(exc, "exit_code", 0) or ExitCode.USAGE
    except KeyboardInterrupt:
        ui.err().print("interrupted", markup=False)
        code = ExitCode.INTERRUPTED
    except BrokenPipeError:
        code = 0
    except Exception as exc:  # a bug: say so in one line, traceback only with --debug
        if _debug_requested(args):
            traceback.print_exc()
        ui.err().print(
            f"error: internal error: {type(exc).__name__}: {exc} (run again with --debug for the traceback)",
            markup=False,
            style="red",
        )
        code = 1
    sys.stdout.flush()
    if argv is None:
        sys.exit(code)
    return code
