"""What decides a TPU job on a worker: its Python and the installed versions of the packages that must be
the same on every worker of a pod (a jax, jaxlib, libtpu, torch or torch_xla that differs on one host
hangs or fails the job at its first collective).

Part of the agent bundle (stdlib only, Python >= 3.8): the agent's `preflight` command answers with it.
Versions are read from the names of the `.dist-info` / `.egg-info` directories on the import path, the first
one winning as it would for an import: no package is imported, nor importlib.metadata (a few
milliseconds on a worker that starts a job). A program run without `site` (`python -S`, as the watchdog is) finds
the directories site would have put on the path as site finds them.
"""

import os
import re
import sys

# the packages compared on every `train`, besides those the script's requirements.txt names
DECISIVE = ("jax", "jaxlib", "libtpu", "libtpu-nightly", "torch", "torch_xla", "torch_tpu")


def canonical(name):
    """A distribution's name as pip compares them (PEP 503): case and runs of -_. do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(names):
    """{name: version, or None where not installed} for NAMES, as this interpreter would import them."""
    wanted = {canonical(n) for n in names}
    found = {}
    for entry in search_path():
        try:
            listing = os.listdir(entry or ".")
        except OSError:
            continue
        for item in listing:
            stem, dot, kind = item.rpartition(".")
            if not dot or kind not in ("dist-info", "egg-info"):
                continue
            name, _, version = stem.partition("-")  # name-version[-pyX.Y for an egg]
            key = canonical(name)
            if key in wanted and key not in found:
                found[key] = version.split("-")[0] or None
    return {n: found.get(canonical(n)) for n in names}


def search_path():
    """sys.path as the job's Python has it at its start: where this process runs without site (-S), with the
    directories site adds, in its order: a virtual environment's site-packages, then where site enables it the
    user's, then the site-packages of the Python the environment was made from where its pyvenv.cfg says
    include-system-site-packages (of this Python, outside one), each followed by the directories its .pth files
    name (their `import` lines are not run: they install import hooks, not directories of distributions)."""
    path = list(sys.path)
    if not sys.flags.no_site:
        return path
    import site  # under -S, importing it adds nothing to the path

    venv, system_site = _venv()
    # a virtual environment's own, as site's venv() adds it (Debian's site.getsitepackages would say dist-packages)
    here = "python{}.{}".format(*sys.version_info[:2])
    libdirs = dict.fromkeys([getattr(sys, "platlibdir", "lib"), "lib"])
    dirs = [os.path.join(venv, d, here, "site-packages") for d in libdirs] if venv else []
    if (not venv or system_site) and not sys.flags.no_user_site and site.check_enableusersite():
        dirs.append(site.getusersitepackages())
    if not venv:
        dirs += site.getsitepackages()
    elif system_site:
        dirs += site.getsitepackages([sys.base_prefix])
    for d in dirs:
        if d not in path and os.path.isdir(d):
            path.append(d)
            path += [e for e in _pth_dirs(d) if e not in path]
    return path


def _venv():
    """(the virtual environment this Python runs in, or "", whether it includes the system site-packages), found
    as site finds it: a pyvenv.cfg beside the executable or one directory up."""
    here = os.path.dirname(sys.executable)
    for cfg in (os.path.join(here, "pyvenv.cfg"), os.path.join(os.path.dirname(here), "pyvenv.cfg")):
        try:
            with open(cfg, encoding="utf-8") as f:
                keys = {k.strip().lower(): v.strip().lower() for k, _, v in (ln.partition("=") for ln in f)}
        except (OSError, UnicodeDecodeError):
            continue
        return os.path.dirname(cfg), keys.get("include-system-site-packages") == "true"
    return "", False


def _pth_dirs(site_dir):
    """The existing directories SITE_DIR's .pth files name, in site's order (the files sorted by name)."""
    out = []
    for pth in sorted(n for n in os.listdir(site_dir) if n.endswith(".pth") and not n.startswith(".")):
        try:
            with open(os.path.join(site_dir, pth), encoding="utf-8") as f:
                lines = [line.rstrip() for line in f]
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            if line and not line.startswith(("#", "import ", "import\t")):
                entry = os.path.abspath(os.path.join(site_dir, line))
                if entry not in out and os.path.exists(entry):
                    out.append(entry)
    return out


def python():
    """This interpreter's version, e.g. 3.11.7."""
    return ".".join(str(n) for n in sys.version_info[:3])
