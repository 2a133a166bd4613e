"""What decides a TPU job on a worker: its Python and the installed versions of the packages that must be
the same on every worker of a pod (a jax, jaxlib, libtpu, torch or torch_xla that differs on one host
hangs or fails the job at its first collective).

Part of the agent bundle (stdlib only, Python >= 3.8): the agent's `preflight` command answers with it.
Versions are read from the names of the `.dist-info` / `.egg-info` directories on sys.path, the first
one winning as it would for an import: no package is imported, nor importlib.metadata (a few
milliseconds on a worker that starts a job).
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
    for entry in sys.path:
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


def python():
    """This interpreter's version, e.g. 3.11.7."""
    return ".".join(str(n) for n in sys.version_info[:3])
