"""The names the emulated OS Login gives (Google's rules), and how a worker decides who may log in (the guest's)."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest

from tpurun.emulator import guest_login, oslogin
from tpurun.emulator.model import ApiError

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKzvfE+qS09w+okgrO0gY7jryF0lSCxdEO/O0UaUhuZe"


@pytest.mark.parametrize(
    ("email", "username"),
    [
        ("name@example.com", "name_example_com"),  # Google's own example: cloudysanfrancisco_gmail_com
        ("cloudysanfrancisco@gmail.com", "cloudysanfrancisco_gmail_com"),
        ("First.Last-Jr+ml@Example.COM", "first_last_jr_ml_example_com"),
        ("a.very.long.name.indeed@subsidiary.example.com", "a_very_long_name_indeed_subsidia"),
    ],
)
def test_a_users_posix_name_is_its_email_in_underscores(email: str, username: str) -> None:
    assert oslogin.posix_username(email) == username
    assert len(username) <= 32


def test_a_service_accounts_posix_name_is_sa_and_its_unique_id() -> None:
    sa = "runner@my-project.iam.gserviceaccount.com"
    name = oslogin.posix_username(sa)
    assert re.fullmatch(r"sa_1\d{20}", name)
    assert name == "sa_" + oslogin.unique_id(sa) == oslogin.posix_username(sa.upper())  # stable, case-blind
    assert oslogin.posix_username("other@my-project.iam.gserviceaccount.com") != name


def test_uids_are_large_stable_and_per_account() -> None:
    uid = oslogin.posix_uid("name@example.com")
    assert 65535 < uid < 2**31 and uid == oslogin.posix_uid("Name@Example.com")
    assert uid != oslogin.posix_uid("other@example.com")


def test_a_fingerprint_is_the_sha256_of_the_key_blob_in_hex() -> None:
    blob = base64.b64decode(ED25519.split()[1])
    assert oslogin.fingerprint(ED25519) == hashlib.sha256(blob).hexdigest()
    assert oslogin.fingerprint(ED25519 + " a comment") == oslogin.fingerprint(ED25519)


@pytest.mark.parametrize(
    "text",
    ["", "ssh-ed25519", "ssh-ed25519 !!!", "ssh-rsa " + ED25519.split()[1], "ssh-foo " + ED25519.split()[1]],
)
def test_what_is_no_key_is_refused(text: str) -> None:
    with pytest.raises(ApiError) as e:
        oslogin.fingerprint(text)
    assert e.value.http == 400


@pytest.mark.parametrize(
    ("instance", "project", "on"),
    [
        ({}, {}, False),
        ({}, {"enable-oslogin": "TRUE"}, True),
        ({"enable-oslogin": "FALSE"}, {"enable-oslogin": "TRUE"}, False),  # the instance's first
        ({"enable-oslogin": "true"}, {}, True),
        ({"enable-oslogin": "1"}, {}, True),
        ({"enable-oslogin": "yes"}, {"enable-oslogin": "TRUE"}, True),  # not a boolean to the guest: the project's
        ({"enable-oslogin": "tRuE"}, {}, False),  # Go's ParseBool knows no mixed case
    ],
)
def test_os_login_is_the_instances_then_the_projects(instance: dict, project: dict, on: bool) -> None:
    assert guest_login.decide(instance, project).oslogin is on


def test_under_os_login_no_metadata_key_is_taken() -> None:
    md = {"ssh-keys": f"alice:{ED25519}"}
    assert guest_login.decide(md, {}).keys == {"alice": [f"{ED25519} alice"]}
    assert guest_login.decide({**md, "enable-oslogin": "TRUE"}, {}).keys == {}


def test_project_keys_join_unless_blocked() -> None:
    project = {"ssh-keys": f"bob:{ED25519}"}
    assert set(guest_login.decide({"ssh-keys": f"alice:{ED25519}"}, project).keys) == {"alice", "bob"}
    assert set(guest_login.decide({"block-project-ssh-keys": "TRUE"}, project).keys) == set()


def test_two_factor_asks_humans_for_a_second_step_and_service_accounts_not() -> None:
    logins = guest_login.decide({"enable-oslogin-2fa": "TRUE"}, {"enable-oslogin": "TRUE"})
    lines = guest_login.sshd_lines(logins, "/usr/bin/python3", "/run/w")
    assert lines[0] == "AuthorizedKeysCommand /usr/bin/python3 -I -S /run/w/oslogin_keys.py %u"
    assert lines[1:] == (
        "AuthorizedKeysCommandUser root",
        "AuthenticationMethods publickey,keyboard-interactive",
        "Match User sa_*",
        "AuthenticationMethods publickey",
    )
    assert guest_login.sshd_lines(guest_login.decide({}, {}), "/usr/bin/python3", "/run/w") == ()
