"""One place that resolves project, zone, TPU name, API endpoint and tpurun's home.

Precedence (docs/configuration.md): command-line flag > TPURUN_* environment variable > tpurun.toml in the
current directory or a parent > $XDG_CONFIG_HOME/tpurun/config.toml > the active gcloud
configuration (read as files; gcloud itself is not needed).
"""

from __future__ import annotations

import configparser
import enum
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from tpurun import config
from tpurun.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

KEYS = ("project", "zone", "tpu", "api_endpoint", "relay", "account", "via")
RELAY_MODES = ("on", "off", "auto")
VIA_WAYS = ("auto", "iap", "direct")  # or a ProxyCommand of the user's, which names the worker's host (%h)
ENV = {key: config.SETTINGS[key].name for key in KEYS}
PROJECT_FILE = config.PROJECT_FILE
DEFAULT_ENDPOINT = "https://tpu.googleapis.com"


class Layer(enum.Enum):
    """How a setting was given: on the command line, in the environment, in a file (tpurun.toml, the user's
    config, gcloud's configuration), by a record (a job's, or tpurun's of where a TPU is), or not at all."""

    FLAG = "flag"
    ENV = "env"
    FILE = "file"
    RECORD = "record"
    UNSET = "unset"


@dataclass(frozen=True)
class Setting:
    key: str
    value: str | None
    source: str  # where it came from, e.g. "flag --zone", "env TPURUN_ZONE", "/p/tpurun.toml"
    layer: Layer = Layer.RECORD

    @property
    def chosen(self) -> bool:
        """Chosen for this command (a flag, the environment, a record), not only this place's default (a file)."""
        return self.layer in (Layer.FLAG, Layer.ENV, Layer.RECORD)

    @property
    def default(self) -> bool:
        """The default of this place (the environment, a file), neither named on the command line nor by a record."""
        return self.layer in (Layer.ENV, Layer.FILE)


@dataclass(frozen=True)
class Settings:
    project: Setting
    zone: Setting
    tpu: Setting
    api_endpoint: Setting
    home: Setting
    searched: tuple[str, ...]  # every place that was looked at, for error messages
    relay: Setting = Setting("relay", None, "not set", Layer.UNSET)
    account: Setting = Setting("account", None, "not set", Layer.UNSET)
    via: Setting = Setting("via", None, "not set", Layer.UNSET)

    def all(self) -> list[Setting]:
        return [self.project, self.zone, self.tpu, self.api_endpoint, self.relay, self.via, self.account, self.home]

    @property
    def relay_mode(self) -> str:
        """on, off or auto (the default): whether workers are reached through relays inside the slice."""
        mode = (self.relay.value or "auto").lower()
        if mode not in RELAY_MODES:
            raise UsageError(f"relay is '{self.relay.value}' ({self.relay.source}): use on, off or auto")
        return mode

    @property
    def via_way(self) -> str:
        """How this machine reaches the workers: auto (the default: IAP for those without an external address),
        iap, direct, or a ProxyCommand (a command with %h, run as OpenSSH runs one)."""
        value = (self.via.value or "auto").strip()
        if value.lower() in VIA_WAYS:
            return value.lower()
        if "%h" not in value:
            raise UsageError(
                f"via is '{value}' ({self.via.source}): use auto, iap, direct, or a ProxyCommand naming the worker's "
                "host as %h, e.g. 'ssh -W %h:%p jumphost'"
            )
        return value

    def require_location(self, *, zone: bool = True) -> tuple[str, str]:
        """Project and zone (ZONE False: the project only, the zone may be unset), or one error naming every
        place they could come from."""
        missing = [s.key for s in (self.project, self.zone) if not s.value and (zone or s is self.project)]
        if missing:
            names = " and ".join(missing)
            places = "; ".join(
                [
                    " / ".join(f"--{k}" for k in missing),
                    " / ".join(ENV[k] for k in missing),
                    f"{PROJECT_FILE} in this directory or a parent",
                    str(user_config_path()),
                    "the active gcloud configuration (gcloud config set project|compute/zone)",
                ]
            )
            raise UsageError(f"no {names} configured: set it with one of: {places}")
        assert self.project.value
        return self.project.value, self.zone.value or ""

    @property
    def endpoint(self) -> str:
        return self.api_endpoint.value or DEFAULT_ENDPOINT

    @property
    def home_path(self) -> Path:
        assert self.home.value
        return Path(self.home.value)

    def naming(self, tpu: str | None, *, project: str = "", zone: str = "", source: str) -> Settings:
        """These settings for the TPU named TPU (None: no TPU, this machine) in PROJECT and ZONE where given
        (else as resolved), each from SOURCE (e.g. a job's record): the home and endpoint stay as resolved."""
        return replace(
            self,
            tpu=Setting("tpu", tpu, source),
            project=Setting("project", project, source) if project else self.project,
            zone=Setting("zone", zone, source) if zone else self.zone,
        )

    def with_tpu(self, name: str, source: str) -> Settings:
        """These settings for the TPU NAME, named on the command line as SOURCE says (`tpurun ssh NAME`)."""
        return replace(self, tpu=Setting("tpu", name, source, Layer.FLAG))

    def in_zone(self, zone: str, source: str) -> Settings:
        """These settings with ZONE instead, from SOURCE (a record of where a TPU is)."""
        return replace(self, zone=Setting("zone", zone, source))


def xdg_config_home(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CONFIG_HOME")
    return Path(base) if base else Path(env.get("HOME", str(Path.home()))) / ".config"


def user_config_path(env: Mapping[str, str] | None = None) -> Path:
    return xdg_config_home(os.environ if env is None else env) / "tpurun" / "config.toml"


def find_project_file(start: Path) -> Path | None:
    for directory in [start, *start.parents]:
        candidate = directory / PROJECT_FILE
        if candidate.is_file():
            return candidate
    return None


def read_toml(path: Path) -> dict[str, str]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}; fix or delete it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    out: dict[str, str] = {}
    for key, value in data.items():
        if key not in KEYS:
            continue  # other sections belong to other commands (e.g. [train])
        if not isinstance(value, str):
            raise UsageError(f"{path}: '{key}' must be a string, got {type(value).__name__}")
        out[key] = value
    return out


def gcloud_config(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """project, zone and account of the active gcloud configuration, and the file they came from."""
    root = Path(env["CLOUDSDK_CONFIG"]) if env.get("CLOUDSDK_CONFIG") else xdg_config_home(env) / "gcloud"
    name = env.get("CLOUDSDK_ACTIVE_CONFIG_NAME")
    if not name:
        try:
            name = (root / "active_config").read_text(encoding="utf-8").strip()
        except OSError:
            name = "default"
    path = root / "configurations" / f"config_{name}"
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(path.read_text(encoding="utf-8"))
    except (OSError, configparser.Error, UnicodeDecodeError):
        return {}, None
    out = {}
    if parser.has_option("core", "project"):
        out["project"] = parser.get("core", "project").strip()
    if parser.has_option("compute", "zone"):
        out["zone"] = parser.get("compute", "zone").strip()
    if parser.has_option("core", "account"):
        out["account"] = parser.get("core", "account").strip()
    return {k: v for k, v in out.items() if v}, str(path)


def resolve(
    flags: Mapping[str, str | None] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Settings:
    env = dict(os.environ if env is None else env)
    cwd = cwd or Path.cwd()
    flags = flags or {}

    layers: list[tuple[str, dict[str, str]]] = []
    layers.append(("flag", {k: v for k, v in flags.items() if v}))
    layers.append(("env", {k: config.SETTINGS[k].raw(env) for k in KEYS if config.SETTINGS[k].raw(env)}))
    searched = [f"flags --{'/--'.join(k.replace('_', '-') for k in KEYS)}", "env " + ", ".join(ENV.values())]

    project_file = find_project_file(cwd)
    searched.append(f"{PROJECT_FILE} in {cwd} and parents")
    if project_file:
        layers.append((str(project_file), read_toml(project_file)))
    user_file = user_config_path(env)
    searched.append(str(user_file))
    if user_file.is_file():
        layers.append((str(user_file), read_toml(user_file)))
    gcloud, gcloud_path = gcloud_config(env)
    searched.append("active gcloud configuration")
    if gcloud_path:
        layers.append((f"gcloud {gcloud_path}", gcloud))

    def pick(key: str) -> Setting:
        for source, values in layers:
            if values.get(key):
                label = source
                if source == "flag":
                    label = f"flag --{key.replace('_', '-')}"
                elif source == "env":
                    label = f"env {ENV[key]}"
                layer = Layer.FLAG if source == "flag" else Layer.ENV if source == "env" else Layer.FILE
                return Setting(key, values[key], label, layer)
        return Setting(key, None, "not set", Layer.UNSET)

    home_env = config.HOME.raw(env)
    home = (
        Setting("home", home_env, f"env {config.HOME.name}", Layer.ENV)
        if home_env
        else Setting("home", str(xdg_config_home(env) / "tpurun"), "default", Layer.UNSET)
    )
    return Settings(
        project=pick("project"),
        zone=pick("zone"),
        tpu=pick("tpu"),
        api_endpoint=pick("api_endpoint"),
        home=home,
        searched=tuple(searched),
        relay=pick("relay"),
        account=pick("account"),
        via=pick("via"),
    )


def write_project_setting(key: str, value: str, directory: Path | None = None) -> Path:
    """Set KEY in the nearest tpurun.toml (or create one in DIRECTORY), keeping other lines. One this makes in a
    git repository is left out of git (a line in the repository's info/exclude): `create` and `attach` add
    nothing to `git status`; sync never sends it to the workers (tpurun.ignore)."""
    directory = directory or Path.cwd()
    path = find_project_file(directory) or directory / PROJECT_FILE
    existed = path.exists()
    lines = path.read_text(encoding="utf-8").splitlines() if existed else []
    if existed:
        read_toml(path)  # refuse to rewrite a malformed file
    new_line = f"{key} = {json.dumps(value)}"
    for i, line in enumerate(lines):
        if line.split("=", 1)[0].strip() == key and not line.lstrip().startswith("#"):
            lines[i] = new_line
            break
    else:
        # top-level keys must come before the first [table]
        insert_at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("[")), len(lines))
        lines.insert(insert_at, new_line)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if not existed:
        from tpurun import ignore  # (imported here: pathspec only when a settings file is made)

        ignore.keep_out_of_git(path)
    return path


def clear_project_setting(key: str, value: str, directory: Path | None = None) -> Path | None:
    """Remove KEY from the nearest tpurun.toml if it is set to VALUE there; the file, if it was."""
    path = find_project_file(directory or Path.cwd())
    if path is None or read_toml(path).get(key) != value:
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [ln for ln in lines if ln.lstrip().startswith("#") or ln.split("=", 1)[0].strip() != key]
    if any(ln.strip() for ln in kept):
        path.write_text("\n".join(kept) + "\n", encoding="utf-8")
    else:
        path.unlink()  # nothing else was in it: leave the directory as it was before
    return path
