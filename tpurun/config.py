"""Every TPURUN_* environment variable tpurun reads on this machine, with its default and meaning.

This module is the one place that reads them. The five settings (project, zone, tpu, api_endpoint,
home) are resolved with their precedence in settings.py from `SETTINGS`; the rest are tunables,
read when used (tests change them per process). Variables tpurun *sets* for the processes it starts
(TPURUN_JOB_ID, TPURUN_WORKER_ID, ...) belong to the env contract (job/env_contract.py), and the
programs shipped to workers read their own (they run without this package).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Tunable:
    name: str
    default: str
    meaning: str

    def raw(self, env: Mapping[str, str] | None = None) -> str:
        """The value set in ENV (default: this process's environment), or the default; '' counts as unset."""
        return (os.environ if env is None else env).get(self.name) or self.default

    def number(self) -> float:
        return float(self.raw())

    def integer(self) -> int:
        return int(self.raw())

    def on(self) -> bool:
        return self.raw() == "1"


# settings (their precedence: settings.py, docs/configuration.md)
SETTINGS = {
    key: Tunable(f"TPURUN_{key.upper()}", "", meaning)
    for key, meaning in (
        ("project", "the Google Cloud project"),
        ("zone", "the zone of the TPUs"),
        ("tpu", "the default TPU name"),
        ("api_endpoint", "the Cloud TPU API endpoint (the emulator's, for example)"),
        ("relay", "reach the workers through relays inside the slice: on, off, or auto (above TPURUN_RELAY_ABOVE)"),
        ("account", "the Google account tpurun acts as, where credentials do not say (OS Login logs in as its user)"),
        ("via", "how this machine reaches the workers: auto, iap (IAP's TCP forwarding), direct, or a ProxyCommand"),
    )
}
# the file of a project directory that holds its settings (settings.py reads and writes it; sync never sends it)
PROJECT_FILE = "tpurun.toml"
HOME = Tunable(
    "TPURUN_HOME", "", "tpurun's own state: ssh key, pinned host keys, job records (default ~/.config/tpurun)"
)

# the Cloud TPU API
POLL_INTERVAL = Tunable(
    "TPURUN_POLL_INTERVAL",
    "2.0",
    "seconds between two looks at a node; at most that between two looks at an operation (google-api-core "
    "draws each wait at random below it)",
)
RETRY_DELAY = Tunable(
    "TPURUN_RETRY_DELAY", "1.0", "seconds before the first retry of a failed API call (then doubling)"
)
RETRY_ATTEMPTS = Tunable("TPURUN_RETRY_ATTEMPTS", "6", "attempts of an API call that fails with a retryable error")
PREEMPT_CHECK = Tunable(
    "TPURUN_PREEMPT_CHECK", "20", "seconds train waits for the API to report a preemption after the workers vanished"
)
RECOVER_TIMEOUT = Tunable(
    "TPURUN_RECOVER_TIMEOUT",
    "7200",
    "seconds a restarting train waits for its TPU to be usable again after maintenance or a lost worker",
)
WATCHDOG_TICK = Tunable(
    "TPURUN_WATCHDOG_TICK",
    "30",
    "seconds between two looks of a TPU's watchdog (autostop, train --down), written into the setting at create "
    "or `tpurun autostop`; the shortest --autostop is two of them. Testing: 0.5 lets tests use --autostop 2s",
)
WATCHDOG_SILENT = Tunable(
    "TPURUN_WATCHDOG_SILENT",
    "300",
    "seconds a worker's watchdog may go without reporting before the deciding one asks the API (and the VM's "
    "address) whether its VM is still there; one found dead keeps the TPU busy no longer (docs/cost-safety.md). "
    "Written into the setting at create or `tpurun autostop`",
)
EMULATOR_SLOTS = Tunable(
    "TPURUN_EMULATOR_SLOTS",
    "",
    "FIRST-LAST: the address slots (127.77.SLOT.*) the nodes of an emulator `tpurun emulator start` makes may take "
    "(default: all). Testing: emulators running at once each get their own, so no two have a worker's address",
)
NODE_CACHE = Tunable("TPURUN_NODE_CACHE", "1", "0: ask the API for a node's workers every time instead of remembering")

# SSH
SSH_USER = Tunable("TPURUN_SSH_USER", "", "the user tpurun logs in as on the workers (default: the local user)")
SSH_RETRIES = Tunable("TPURUN_SSH_RETRIES", "10", "ssh logins refused while a new key propagates: how many retries")
SSH_RETRY_DELAY = Tunable("TPURUN_SSH_RETRY_DELAY", "2", "seconds between those retries")
KEEPALIVE_INTERVAL = Tunable("TPURUN_KEEPALIVE_INTERVAL", "5", "seconds between two liveness probes of a connection")
KEEPALIVE_TIMEOUT = Tunable("TPURUN_KEEPALIVE_TIMEOUT", "15", "seconds without an answer before a worker is lost")
CONNECT_WINDOW = Tunable(
    "TPURUN_CONNECT_WINDOW",
    "32",
    "how many workers tpurun connects to at once, at most (the others wait their turn; docs/benchmarks.md)",
)
RELAY_ABOVE = Tunable(
    "TPURUN_RELAY_ABOVE", "128", "with relay auto: a command on more workers than this goes through relays"
)
RELAY_ROOTS = Tunable("TPURUN_RELAY_ROOTS", "4", "relays: how many workers of each slice this machine reaches")
RELAY_FANOUT = Tunable("TPURUN_RELAY_FANOUT", "32", "relays: how many workers each relay reaches, at most")
RELAY_TIMEOUT = Tunable(
    "TPURUN_RELAY_TIMEOUT", "15",
    "relays: seconds of silence after which a relay is given up (its parent's: 4 times), and a relay's wait to reach a child",
)
ADDRESS_MAP = Tunable(
    "TPURUN_ADDRESS_MAP", "", 'testing: JSON {"worker ip": "other ip[:port]"} to reach workers through a proxy'
)

# sync
SYNC_WARN_MB = Tunable(
    "TPURUN_SYNC_WARN_MB",
    "100",
    "a sync (`tpurun sync`, and `train`'s before a job) that sends more than this many megabytes to a worker "
    "warns before it sends, naming the largest files and the line that leaves them out; 0: never",
)

# profiles (`tpurun profile`)
PROFILE_PORT = Tunable(
    "TPURUN_PROFILE_PORT",
    "9431",
    "the first port of a job's profiler servers: its host process serves on it, chip C's process on it + 1 + C "
    "(given to the job's processes at its start; `train --no-profile` starts none)",
)
PROFILE_HOSTS = Tunable(
    "TPURUN_PROFILE_HOSTS", "8", "`tpurun profile` without --worker: at most this many hosts, spread over the pod"
)
PROFILE_LEAD = Tunable(
    "TPURUN_PROFILE_LEAD",
    "2",
    "seconds between `tpurun profile`'s ask and the moment every worker starts its capture: time for the ask to "
    "reach them all (a worker it reaches later starts at once and says how late)",
)

# output
DEBUG = Tunable("TPURUN_DEBUG", "", "1: tracebacks and runtime chatter, as --debug")

# kill-stale and doctor (testing: point the scanner at planted files)
DEVICE_GLOBS = Tunable("TPURUN_DEVICE_GLOBS", "", "testing: the TPU device file patterns, separated by ':'")
LIBTPU_GLOB = Tunable("TPURUN_LIBTPU_GLOB", "", "testing: the libtpu file pattern")
LOCK_FILES = Tunable("TPURUN_LOCK_FILES", "", "testing: the libtpu lock file patterns, separated by ':'")

# the emulator
IMAGE_VENVS = Tunable(
    "TPURUN_EMULATOR_IMAGE_VENVS",
    "",
    "more Python environments every emulated worker carries at the same path, separated by ':' (one with TorchTPU)",
)

# the test suite
REQUIRE_EMULATOR = Tunable("TPURUN_REQUIRE_EMULATOR", "", "1: a machine that cannot run the emulator fails the tests")
TORCHTPU_PYTHON = Tunable(
    "TPURUN_TORCHTPU_PYTHON", "", "the Python of the TorchTPU environment (scripts/test makes it)"
)
TEST_PY_SPY = Tunable("TPURUN_TEST_PY_SPY", "", "py-spy for the test of `stacks` (scripts/test installs it off PATH)")

ALL = [
    *SETTINGS.values(),
    HOME,
    POLL_INTERVAL,
    RETRY_DELAY,
    RETRY_ATTEMPTS,
    PREEMPT_CHECK,
    RECOVER_TIMEOUT,
    NODE_CACHE,
    SSH_USER,
    SSH_RETRIES,
    SSH_RETRY_DELAY,
    KEEPALIVE_INTERVAL,
    KEEPALIVE_TIMEOUT,
    CONNECT_WINDOW,
    RELAY_ABOVE,
    RELAY_ROOTS,
    RELAY_FANOUT,
    RELAY_TIMEOUT,
    ADDRESS_MAP,
    SYNC_WARN_MB,
    PROFILE_PORT,
    PROFILE_HOSTS,
    PROFILE_LEAD,
    DEBUG,
    DEVICE_GLOBS,
    LIBTPU_GLOB,
    LOCK_FILES,
    IMAGE_VENVS,
    REQUIRE_EMULATOR,
    TORCHTPU_PYTHON,
    TEST_PY_SPY,
]
