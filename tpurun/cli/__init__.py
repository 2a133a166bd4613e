"""tpurun's command line: commands parse, call one library function, and render its result."""

from __future__ import annotations

import inspect
import logging
import sys
import traceback
from typing import Annotated

import typer

from tpurun import __version__, config, ui
from tpurun.errors import ExitCode, TpurunError, UsageError

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
    help="Launch PyTorch (PyTorch/XLA, Lightning) and JAX jobs on Cloud TPU VMs and pod slices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


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


# ---------------------------------------------------------------- commands

# Every command: its name (the one place it is written) and the function that implements it, in the
# order `tpurun --help` lists them. `tpurun exec` imports only tpurun.cli.remote, not every command
# module (cli.nodes alone pulls in provisioning, sync and train); --help, no command or a typo (so
# that click can suggest names) register them all. tests/cli/test_lazy_commands.py keeps this true.
COMMANDS: dict[str, str] = {
    "topology": "basic:topology_cmd",
    "create": "nodes:create_cmd",
    "attach": "nodes:attach_cmd",
    "list": "nodes:list_cmd",
    "describe": "nodes:describe_cmd",
    "delete": "nodes:delete_cmd",
    "stop": "nodes:stop_cmd",
    "start": "nodes:start_cmd",
    "autostop": "nodes:autostop_cmd",
    "maintenance": "nodes:maintenance_cmd",
    "exec": "remote:exec_cmd",
    "ssh": "remote:ssh_cmd",
    "iap-tunnel": "remote:iap_tunnel_cmd",  # hidden: `tpurun ssh`'s ProxyCommand through IAP
    "sync": "sync:sync_cmd",
    "download": "sync:download_cmd",
    "train": "train:train_cmd",
    "jobs": "train:jobs_cmd",
    "logs": "train:logs_cmd",
    "cancel": "train:cancel_cmd",
    "stacks": "train:stacks_cmd",
    "profile": "profile:profile_cmd",
    "kill-stale": "health:kill_stale_cmd",
    "doctor": "health:doctor_cmd",
    "cost": "cost:cost_cmd",
    "emulator": "basic:emulator_cmd",
    "config": "basic:config_app",  # a group: typer lists groups after commands
}
_ROOT_FLAGS = {"--plain", "--debug", "--version", "-h", "--help"}
_registered: set[str] = set()


def command_module(name: str) -> str:
    return f"tpurun.cli.{COMMANDS[name].partition(':')[0]}"


def _register(name: str) -> None:
    import importlib

    if name in _registered:
        return
    _registered.add(name)
    module, _, attr = COMMANDS[name].partition(":")
    fn = getattr(importlib.import_module(f"tpurun.cli.{module}"), attr)
    if isinstance(fn, typer.Typer):
        for info in fn.registered_commands:
            if info.help is None and info.callback is not None:
                info.help = flowing(info.callback.__doc__)
        app.add_typer(fn, name=name)
    else:
        app.command(name, **({"help": flowing(fn.__doc__)} | getattr(fn, "typer_kwargs", {})))(fn)


def flowing(doc: str | None) -> str | None:
    """A docstring as help text: each paragraph one line, which the help then wraps to the terminal's width
    (rich keeps a docstring's own line breaks, which cut its sentences where the source was wrapped)."""
    if not doc:
        return doc
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


def _debug_requested(argv: list[str]) -> bool:
    return ui.state.debug or "--debug" in argv or config.DEBUG.on()


_GLOBAL_FLAGS = ("--plain", "--debug")


def hoist_global_flags(args: list[str]) -> list[str]:
    """--plain and --debug work anywhere before `--`: moved in front of the command, so a command never
    refuses them and `train` never hands them to the user's script (after `--` everything is the script's)."""
    end = args.index("--") if "--" in args else len(args)
    flags = [a for a in args[:end] if a in _GLOBAL_FLAGS]
    if not flags:
        return args
    return flags + [a for a in args[:end] if a not in _GLOBAL_FLAGS] + args[end:]


def refuse_misspelt_options(command: object, args: list[str]) -> None:
    """A command that hands unknown options to the user's program (train) refuses, before `--`, one that
    is nearly one of its own (`--detatch`): a typo must not silently become the script's argument."""
    import difflib

    name = next((a for a in args if not a.startswith("-")), None)
    sub = getattr(command, "commands", {}).get(name) if name else None
    if name is None or sub is None or not sub.context_settings.get("ignore_unknown_options"):
        return
    own = [o for p in sub.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
    end = args.index("--") if "--" in args else len(args)
    for arg in args[args.index(name) + 1 : end]:
        option = arg.split("=", 1)[0]
        if not option.startswith("--") or option in own:
            continue
        near = difflib.get_close_matches(option, own, n=1, cutoff=0.8)
        if near:
            raise UsageError(
                f"unknown option {option} of `tpurun {name}`: did you mean {near[0]}?",
                hint=f"an argument for your script goes after --: `tpurun {name} SCRIPT -- {arg}`",
            )


def load_commands(args: list[str]) -> None:
    """Register the command ARGS names (only its module), or every command when that is unclear."""
    name = next((a for a in args if not a.startswith("-")), None)
    if name is None and "--version" in args and not {"-h", "--help"} & set(args):
        return  # `tpurun --version`: eager callback, no command needed
    if name is not None and all(a in _ROOT_FLAGS for a in args[: args.index(name)]) and name in COMMANDS:
        _register(name)
        return
    for each in COMMANDS:
        _register(each)


class _WarningsToTerminal(logging.Handler):
    """The library logs (it prints nothing); its warnings reach the user as `warning: ...` lines."""

    def emit(self, record: logging.LogRecord) -> None:
        ui.warn(record.getMessage())


def _show_library_warnings() -> None:
    logger = logging.getLogger("tpurun")
    if not any(isinstance(h, _WarningsToTerminal) for h in logger.handlers):
        handler = _WarningsToTerminal(logging.WARNING)
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every failure becomes one line on stderr and one of the exit codes the README lists."""
    _show_library_warnings()
    args = hoist_global_flags(sys.argv[1:] if argv is None else argv)
    load_commands(args)
    command = typer.main.get_command(app)
    try:
        refuse_misspelt_options(command, args)
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
        code = _internal_error(exc, _debug_requested(args))
    sys.stdout.flush()
    if argv is None:
        sys.exit(int(code))
    return int(code)


def _internal_error(exc: Exception, debug: bool) -> ExitCode:
    """An exception tpurun did not expect: a bug in tpurun, not in the user's program or input. One line saying
    so and where its traceback went (above, with --debug; else nowhere: --debug shows it); exit 70."""
    if debug:
        traceback.print_exc()
    where = "its traceback is above" if debug else "no traceback was kept: run again with --debug to see it"
    ui.err().print(
        f"error: internal error, a bug in tpurun: {type(exc).__name__}: {exc} ({where}; please report it)",
        markup=False,
        style="red",
    )
    return ExitCode.INTERNAL
