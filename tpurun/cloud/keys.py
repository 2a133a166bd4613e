"""tpurun's own SSH identity and the host keys it has pinned.

The ed25519 key is created once under $TPURUN_HOME/ssh (0600, directory 0700). Host keys are never
learned on first contact: they are pinned from the guest attributes the TPU guest agent publishes
(namespace `hostkeys`), and stored in $TPURUN_HOME/ssh/known_hosts in OpenSSH format so that both
paramiko and the system `ssh` can check them. They are pinned under the worker's identity, not its
address: `tpu.<node id>-<worker>`, the name gcloud gives them (OpenSSH's HostKeyAlias). A VM that answers
at a worker's address proves it is that worker of that TPU by holding its key; any other VM there, even
one whose key tpurun pinned for another TPU, is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import os
from collections.abc import Iterator
from pathlib import Path

from tpurun import config

KEY_COMMENT = "tpurun"
# the host key types Google's guest agent publishes, in the order tpurun pins them
HOST_KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa")


def published_host_key(attributes: dict[tuple[str, str], str]) -> str | None:
    """A worker's host key as an OpenSSH line ("ssh-ed25519 AAAA..."), from the guest attributes its guest agent
    published: one `hostkeys/<type>` per key, whose value is the base64 key (anything after it dropped, as gcloud
    does); the first type of HOST_KEY_TYPES present, or None while none is."""
    for kind in HOST_KEY_TYPES:
        value = attributes.get(("hostkeys", kind), "").split()
        if value:
            return f"{kind} {value[0]}"
    return None


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def ssh_dir(home: Path) -> Path:
    _private_dir(home)
    return _private_dir(home / "ssh")


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """Held while the key is made or known_hosts rewritten: commands started at once lose nothing to each other."""
    with open(ssh_dir(home) / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def key_path(home: Path) -> Path:
    return home / "ssh" / "id_ed25519"


def known_hosts_path(home: Path) -> Path:
    return home / "ssh" / "known_hosts"


def ensure_key(home: Path) -> tuple[Path, str]:
    """Path of tpurun's private key (created on first use) and its public key line.

    Safe when several tpurun commands start at once on a new home: one makes the key under a lock, and the private
    key appears (whole, 0600) only after its public half, so a command that sees one sees both."""
    path = key_path(home)
    pub = path.with_suffix(".pub")
    if not path.exists():
        with _locked(home):
            if not path.exists():
                _make_key(path, pub)
    os.chmod(path, 0o600)
    return path, pub.read_text().strip()


def _make_key(path: Path, pub: Path) -> None:
    # imported here: only the very first command makes a key (20 ms less for every other one)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    pub.write_text(f"{public.decode()} {KEY_COMMENT}\n")
    # created 0600 from the start (the key is never readable by others, not even briefly), then moved into place
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # never an empty key after a crash, which a later command would take as made
    os.replace(partial, path)


def ssh_user() -> str:
    """The user tpurun logs in as: $TPURUN_SSH_USER, else the local user name (as gcloud does)."""
    return config.SSH_USER.raw() or getpass.getuser()


def ssh_keys_entry(user: str, public_line: str) -> str:
    """One `ssh-keys` metadata line: USER:KEYTYPE KEYDATA COMMENT."""
    return f"{user}:{public_line}"


def merge_ssh_keys(existing: str, entry: str) -> tuple[str, bool]:
    """EXISTING ssh-keys value with ENTRY added unless its key is already there; never drops a line."""
    lines = [line for line in existing.splitlines() if line.strip()]
    user, _, key = entry.partition(":")
    key_body = key.split()[:2]
    for line in lines:
        u, _, k = line.partition(":")
        if u == user and k.split()[:2] == key_body:
            return existing, False
    lines.append(entry)
    return "\n".join(lines) + "\n", True


def host_key_alias(node_id: str, host: int) -> str:
    """The name worker HOST of the node with unique id NODE_ID has its host key pinned under."""
    return f"tpu.{node_id}-{host}"


def instance_key_alias(instance_id: str) -> str:
    """The name a Compute Engine VM with unique id INSTANCE_ID has its host key pinned under (gcloud's)."""
    return f"compute.{instance_id}"


def pin_host_keys(home: Path, hosts: dict[str, str]) -> None:
    """Record HOSTS ({alias: "ssh-ed25519 AAAA..."}) as the only trusted keys for them.

    A host's earlier entries are replaced: the guest attributes are the authority. The file is rewritten
    atomically, under the lock that keeps two commands pinning at once from dropping each other's keys.
    """
    path = known_hosts_path(home)
    with _locked(home):
        kept = []
        if path.exists():
            for line in path.read_text().splitlines():
                fields = line.split()
                if fields and fields[0] in hosts:
                    continue
                kept.append(line)
        for host, key in sorted(hosts.items()):
            key_type, key_data = key.split()[:2]
            kept.append(f"{host} {key_type} {key_data}")
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(kept) + "\n")
        os.replace(tmp, path)


def pinned_keys(home: Path) -> dict[str, str]:
    """{alias: "ssh-ed25519 AAAA..."}: every key pinned, read once."""
    return read_pinned(known_hosts_path(home))


def read_pinned(path: Path) -> dict[str, str]:
    """{alias: "ssh-ed25519 AAAA..."} of the known_hosts at PATH ({} where there is none): each name of a line
    (`a,b`) under its first key; markers such as `@cert-authority` name no host."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and not fields[0].startswith(("@", "#")):
            for name in fields[0].split(","):
                found.setdefault(name, f"{fields[1]} {fields[2]}")
    return found


def pinned_key(home: Path, host: str) -> str | None:
    """The key pinned for HOST (an alias), or None."""
    return pinned_keys(home).get(host)
