"""Who may log in to a worker, decided from metadata as Google's guest environment decides it, and the files its
sshd reads for that.

Metadata `enable-oslogin` (and `enable-oslogin-2fa`): the instance's (a Compute Engine VM's, a Cloud TPU node's)
when it parses as a boolean the way the guest agent parses it (Go's strconv.ParseBool), else the project's, else
off. Off: the keys of `ssh-keys` (the instance's, and the project's unless `block-project-ssh-keys`), one
authorized_keys file per user, each user a root alias. On: no authorized_keys file at all, and sshd asks
`AuthorizedKeysCommand` (KEYS_COMMAND, the emulator's stand-in for guest-oslogin's google_authorized_keys, run as
root with the image's Python) for the keys of a login name; the project's OS Login POSIX accounts are its users (in
place of Google's NSS module): an account with the `adminLogin` grant a root alias (the guest gives it
passwordless sudo), any other a user of its own without sudo (oslogin.py's roles). With 2FA a human's login needs `keyboard-interactive` after its
key, and a service account's (`sa_*`) its key alone: the worker's sshd then uses PAM, whose sshd service (the
worker's own file, bound over /etc/pam.d/sshd) runs the emulator's PAM module (`_pam_conv.c`) with
TWO_FACTOR_SCRIPT, which asks the second factor as guest-oslogin's pam_oslogin_login does: a session started
with the metadata server, the method chosen where there are several, its code asked and sent back.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tpurun.emulator._metadata import parse_ssh_keys
from tpurun.emulator.sshd import write_atomic, write_in_place

_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}
KEYS_SCRIPT = "oslogin_keys.py"  # in each worker's directory
TWO_FACTOR_SCRIPT = "oslogin_2fa.py"  # likewise, the second step's
PAM_MODULE = "pam_conv.so"  # likewise, a link to the emulator's build
PAM_SSHD = "etc/pam-sshd"  # the worker's /etc/pam.d/sshd (bound there at its boot)


def flag(value: str | None) -> bool | None:
    """A metadata boolean as the guest agent reads it (Go's strconv.ParseBool); None when it is not one."""
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


def _first(key: str, instance: dict[str, str], project: dict[str, str]) -> bool:
    for md in (instance, project):
        found = flag(md.get(key))
        if found is not None:
            return found
    return False


@dataclass(frozen=True)
class Logins:
    """How one worker lets people in."""

    oslogin: bool = False
    two_factor: bool = False
    keys: dict[str, list[str]] = field(default_factory=dict)  # authorized_keys lines per user (none under OS Login)


def decide(instance: dict[str, str], project: dict[str, str]) -> Logins:
    """A worker's logins from its INSTANCE metadata (a node's, a VM's) and its PROJECT's common metadata."""
    if _first("enable-oslogin", instance, project):
        return Logins(oslogin=True, two_factor=_first("enable-oslogin-2fa", instance, project))
    text = instance.get("ssh-keys", "")
    if not flag(instance.get("block-project-ssh-keys")):
        text += "\n" + project.get("ssh-keys", "")
    return Logins(keys=parse_ssh_keys(text))


def sshd_lines(logins: Logins, python: str, view: str) -> tuple[str, ...]:
    """What a worker's sshd_config adds for LOGINS (its directory seen at VIEW, the image's PYTHON): under OS Login
    the keys command, and with 2FA the second step, as Google's guest writes them."""
    if not logins.oslogin:
        return ()
    lines: tuple[str, ...] = (
        f"AuthorizedKeysCommand {python} -I -S {view}/{KEYS_SCRIPT} %u",
        "AuthorizedKeysCommandUser root",
    )
    if logins.two_factor:
        lines += (
            "AuthenticationMethods publickey,keyboard-interactive",
            "Match User sa_*",
            "AuthenticationMethods publickey",
        )
    return lines


def split(accounts: list[tuple[str, int, bool]], taken: set[str]) -> tuple[set[str], list[tuple[str, int]]]:
    """OS Login's ACCOUNTS (username, uid, admin role) but those whose names are TAKEN, as a worker has them: the
    names of those with the admin role (root aliases: the guest gives them passwordless sudo), and the others
    with their uids (users of their own, without sudo)."""
    fresh = [a for a in accounts if a[0] not in taken]
    return {u for u, _, admin in fresh if admin}, [(u, uid) for u, uid, admin in fresh if not admin]


def write_logins(
    d: Path, logins: Logins, aliases: list[str], base: dict[str, str], sshd_config: str, users: list[tuple[str, int]]
) -> None:
    """Write the login files of the worker whose directory is D: its authorized_keys (one file per user, none under
    OS Login: the guest deletes them), passwd, shadow and group (BASE's, the host's, with every ALIASES user a root
    alias: uid 0, home /root; and each of USERS, an OS Login account without sudo, a user of its own: its uid as
    its gid, home /home/USER, made in D's homes/ where missing, as the guest's pam_mkhomedir makes it) and its
    sshd_config."""
    kdir = d / "authorized_keys"
    for user, lines in logins.keys.items():
        write_atomic(kdir / user, "\n".join(lines) + "\n", 0o600)
    for old in kdir.iterdir():
        if old.name not in logins.keys and not old.name.endswith(".tmp"):
            old.unlink(missing_ok=True)
    passwd = base["passwd"].rstrip("\n").splitlines()
    passwd += [f"{u}:x:0:0:{u} (tpurun emulator alias of root):/root:/bin/bash" for u in aliases]
    passwd += [f"{u}:x:{uid}:{uid}::/home/{u}:/bin/bash" for u, uid in users]
    # A locked root ("!" in shadow) would make sshd refuse even key logins: use "*".
    shadow = [re.sub(r"^root:!?[^:]*:", "root:*:", ln) for ln in base["shadow"].splitlines()]
    shadow += [f"{u}:*:19000:0:99999:7:::" for u in [*aliases, *(u for u, _ in users)]]
    group = base["group"].rstrip("\n").splitlines() + [f"{u}:x:{uid}:" for u, uid in users]
    for u, uid in users:
        home = d / "homes" / u
        if not home.exists():
            shutil.copytree("/etc/skel", home, dirs_exist_ok=True)
            for path in [home, *home.rglob("*")]:
                os.lchown(path, uid, uid)
            os.chmod(home, 0o750)
    etc = d / "etc"
    write_in_place(etc / "passwd", "\n".join(passwd) + "\n")
    write_in_place(etc / "shadow", "\n".join(shadow) + "\n", 0o600)
    write_in_place(etc / "group", "\n".join(group) + "\n")
    write_atomic(d / "sshd_config", sshd_config)


def write_keys_command(d: Path, metadata_host: str) -> None:
    """The keys command of the worker whose directory is D, asking its metadata server at METADATA_HOST."""
    write_atomic(d / KEYS_SCRIPT, KEYS_COMMAND.replace("METADATA_HOST", metadata_host), 0o644)


def write_second_step(d: Path, metadata_host: str, module: Path, python: str, view: str) -> None:
    """What the sshd of the worker whose directory is D (seen at VIEW) asks a human's second factor with, under
    2FA: its PAM service (MODULE, the emulator's build, linked into D, running TWO_FACTOR_SCRIPT with the image's
    PYTHON), and the script, asking the metadata server at METADATA_HOST. Read only while its sshd uses PAM."""
    link = d / PAM_MODULE
    if not (link.exists() and link.samefile(module)):
        tmp = d / (PAM_MODULE + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(module, tmp)
        except OSError:  # another filesystem: a copy
            shutil.copyfile(module, tmp)
        os.replace(tmp, link)
    write_atomic(d / TWO_FACTOR_SCRIPT, TWO_FACTOR_COMMAND.replace("METADATA_HOST", metadata_host), 0o644)
    pam = [
        "# sshd's PAM service on this emulated worker: OS Login's second step (tpurun emulator, guest_login.py)",
        f"auth     required  {view}/{PAM_MODULE} {python} -I -S {view}/{TWO_FACTOR_SCRIPT}",
        "account  required  pam_permit.so",
        "session  required  pam_permit.so",
        "password required  pam_deny.so",
    ]
    write_in_place(d / PAM_SSHD, "\n".join(pam) + "\n")


# sshd's AuthorizedKeysCommand under OS Login: what guest-oslogin's google_authorized_keys does (AuthorizeUser,
# ParseJsonToSshKeys in its src/oslogin_utils.cc), in the standard library alone (it runs with -I -S).
KEYS_COMMAND = '''\
"""Prints the keys OS Login lets a login name in with: its profile from the metadata server, if the server
authorizes its account to log in here, and of its keys those not expired."""
import http.client
import json
import re
import sys
import time
from urllib.parse import quote


def ask(path):
    conn = http.client.HTTPConnection("METADATA_HOST", timeout=5)
    conn.request("GET", "/computeMetadata/v1/oslogin/" + path, headers={"Metadata-Flavor": "Google"})
    answer = conn.getresponse()
    return answer.status, answer.read()


def main(user):
    if not re.fullmatch(r"[a-zA-Z0-9._][a-zA-Z0-9._-]{0,31}", user):
        return
    status, body = ask("users?username=" + quote(user, safe=""))
    if status != 200:
        return
    profile = json.loads(body)["loginProfiles"][0]
    status, body = ask("authorize?email=" + quote(profile.get("name", ""), safe="") + "&policy=login")
    if status != 200 or json.loads(body).get("success") is not True:
        return
    now = time.time() * 1_000_000
    for key in profile.get("sshPublicKeys", {}).values():
        try:
            expired = "expirationTimeUsec" in key and now > int(key["expirationTimeUsec"])
        except ValueError:
            expired = True
        if key.get("key") and not expired:
            print(key["key"])


main(sys.argv[1])
'''


# The second step under 2FA, run by the worker's PAM module (_pam_conv.c) with the login name: what guest-oslogin's
# pam_oslogin_login does (its pam_sm_authenticate: the prompts are its own words), in the standard library alone.
# A message to the module is its PAM style digit, its text and a NUL; an answer comes back as a line.
TWO_FACTOR_COMMAND = '''\
"""Asks OS Login's second factor of a login name: a service account (sa_) goes through; anyone else answers the
challenge the metadata server's session gives (exit 0: let in)."""
import http.client
import json
import re
import sys

PROMPTS = {
    "AUTHZEN": "Google phone prompt",
    "TOTP": "Security code from Google Authenticator application",
    "INTERNAL_TWO_FACTOR": "Security code from security key",
    "IDV_PREREGISTERED_PHONE": "Voice or text message verification code",
    "SECURITY_KEY_OTP": "Security code from a security key",
}
ASK = {
    "INTERNAL_TWO_FACTOR": "Enter your security code: ",
    "SECURITY_KEY_OTP": "Enter your security code by visiting https://g.co/sc: ",
    "TOTP": "Enter your one-time password: ",
    "AUTHZEN": "A login prompt has been sent to your enrolled device. Press enter to continue",
    "IDV_PREREGISTERED_PHONE": "A security code has been sent to your phone. Enter code to continue: ",
}


def call(method, path, body=None):
    conn = http.client.HTTPConnection("METADATA_HOST", timeout=10)
    data = None if body is None else json.dumps(body)
    conn.request(method, "/computeMetadata/v1/oslogin/" + path, body=data, headers={"Metadata-Flavor": "Google"})
    answer = conn.getresponse()
    text = answer.read()
    return json.loads(text) if answer.status == 200 and text else None


def say(style, text):
    sys.stdout.write(str(style) + text + "\\0")
    sys.stdout.flush()


def ask(text):
    say(2, text)
    return sys.stdin.readline().rstrip("\\n")


def main(user):
    if not re.fullmatch(r"[a-zA-Z0-9._][a-zA-Z0-9._-]{0,31}", user):
        return 1
    found = call("GET", "users?username=" + user)
    if not found:
        return 1
    if user.startswith("sa_"):
        return 0
    email = found["loginProfiles"][0].get("name", "")
    types = ["INTERNAL_TWO_FACTOR", "SECURITY_KEY_OTP", "AUTHZEN", "TOTP", "IDV_PREREGISTERED_PHONE"]
    session = call("POST", "authenticate/sessions/start", {"email": email, "supportedChallengeTypes": types})
    if not session or session.get("status") == "NO_AVAILABLE_CHALLENGES" or not session.get("challenges"):
        return 1
    challenges = session["challenges"]
    challenge = challenges[0]
    if len(challenges) > 1:
        menu = "Please choose from the available authentication methods: "
        for i, c in enumerate(challenges):
            menu += "\\n%d: %s" % (i + 1, PROMPTS.get(c["challengeType"], ""))
        choice = ask(menu + "\\n\\nEnter the number for the authentication method to use: ")
        try:
            challenge = challenges[int(choice.split()[0]) - 1]
        except (ValueError, IndexError):
            say(3, "Invalid option")
            return 1
    sid = session["sessionId"]
    if challenge["status"] != "READY":
        body = {"email": email, "challengeId": challenge["challengeId"], "action": "START_ALTERNATE"}
        if call("POST", "authenticate/sessions/%s/continue" % sid, body) is None:
            return 1
    kind = challenge["challengeType"]
    if kind not in ASK:
        return 1
    token = ask(ASK[kind])
    body = {"email": email, "challengeId": challenge["challengeId"], "action": "RESPOND"}
    if kind != "AUTHZEN":
        body["proposalResponse"] = {"credential": token}
    answer = call("POST", "authenticate/sessions/%s/continue" % sid, body)
    if answer and answer.get("status") == "AUTHENTICATED":
        return 0
    if answer and answer.get("rejectionReason"):
        say(3, answer["rejectionReason"])
    return 1


sys.exit(main(sys.argv[1]))
'''
