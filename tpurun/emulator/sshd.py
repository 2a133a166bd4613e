"""A worker's sshd: its host key (made once, kept across reboots), its configuration, who may connect to it, and how
the files it reads are written."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tpurun.emulator.model import IAP_STAND_IN, INTERNAL_NETWORK


def write_atomic(path: Path, data: str, mode: int = 0o644) -> None:
    """Replace PATH atomically (for files that are not bind-mounted into a worker)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_in_place(path: Path, data: str, mode: int = 0o644) -> None:
    """Rewrite a file without changing its inode: a running worker has it bind-mounted."""
    if not path.exists():
        write_atomic(path, data, mode)
        return
    raw = data.encode()
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, raw, 0)
        os.ftruncate(fd, len(raw))
    finally:
        os.close(fd)


def admit(d: Path, private: bool) -> None:
    """Who may connect to the sshd of the worker whose directory is D: a private VM's (no external address) only its
    network and IAP (the networks `ssh-from` lists), a public one's anyone (no file); its init reads the file at
    each connection (_worker_init.c)."""
    if private:
        write_atomic(d / "ssh-from", f"{INTERNAL_NETWORK} {IAP_STAND_IN}\n")
    else:
        (d / "ssh-from").unlink(missing_ok=True)


def host_key(d: Path) -> str:
    """The worker's ed25519 host key: generated once, kept across stop/start."""
    priv, pub = d / "ssh_host_ed25519_key", d / "ssh_host_ed25519_key.pub"
    if not (priv.exists() and pub.exists()):
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ).decode()
        line = (
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
        )
        write_atomic(priv, pem, 0o600)  # sshd refuses host keys readable by others
        write_atomic(pub, line + "\n")
    return " ".join(pub.read_text().split()[:2])


def sshd_config(
    address: str, port: int, view: str, *, kbd_interactive: bool = False, extra: tuple[str, ...] = ()
) -> str:
    """The sshd_config of a worker listening on ADDRESS:PORT whose directory it sees at VIEW; EXTRA at its end (how
    the worker's logins are checked: guest_login), KBD_INTERACTIVE for a second step after the key (asked through
    PAM, the only way OpenSSH asks one on Linux)."""
    return "\n".join(
        [
            f"ListenAddress {address}:{port}",
            f"HostKey {view}/ssh_host_ed25519_key",
            "PidFile none",
            f"AuthorizedKeysFile {view}/authorized_keys/%u",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            f"KbdInteractiveAuthentication {'yes' if kbd_interactive else 'no'}",
            f"UsePAM {'yes' if kbd_interactive else 'no'}",
            # every login is a root alias, and prohibit-password would refuse root a last step that is not a key;
            # a key is asked first all the same (AuthenticationMethods), and passwords never
            f"PermitRootLogin {'yes' if kbd_interactive else 'prohibit-password'}",
            # Key files live in the emulator's state dir, whose parents we do not control.
            "StrictModes no",
            "MaxStartups 1000",
            "MaxSessions 100",
            "LoginGraceTime 120",  # OpenSSH's default: a loaded machine with a thousand workers is slow to log in
            "Subsystem sftp internal-sftp",
            # No AcceptEnv line: sshd then accepts no client environment variables.
            "LogLevel ERROR",
            "ClientAliveInterval 30",
            "ClientAliveCountMax 4",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "AllowTcpForwarding yes",
            *extra,  # last: it may end in Match blocks, which run to the end of the file
            "",
        ]
    )
