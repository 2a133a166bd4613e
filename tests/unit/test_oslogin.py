"""OS Login as the guest decides it (the TPU's own metadata first, then the project's), and the account tpurun
acts as (the setting, gcloud's active configuration, what Google's credential objects say of themselves)."""

from __future__ import annotations

from google.oauth2 import credentials as user_credentials

from tpurun import settings
from tpurun.cloud.login_policy import Policy
from tpurun.cloud.oslogin import acting_account, is_service_account


def test_the_tpus_own_metadata_decides_before_the_projects():
    on = {"enable-oslogin": "TRUE"}
    off = {"enable-oslogin": "false"}
    assert Policy.of({}, on).oslogin and not Policy.of({}, off).oslogin and not Policy.of({}, {}).oslogin
    assert not Policy.of(off, on).oslogin  # the node's FALSE overrides a project's TRUE, as on the VM
    assert Policy.of(on, off).oslogin
    assert Policy.of({"enable-oslogin": "True"}, {}).oslogin  # any case
    assert not Policy.of({"enable-oslogin": "yes"}, {}).oslogin  # only "true" is on
    both = Policy.of({}, {"enable-oslogin": "TRUE", "enable-oslogin-2fa": "TRUE"})
    assert both.oslogin and both.two_factor and not both.certificates
    assert not Policy.of({}, {"enable-oslogin-2fa": "TRUE"}).two_factor  # 2fa is a part of OS Login


def test_a_policy_survives_the_record():
    p = Policy(True, True, False)
    assert Policy.from_json(p.to_json()) == p and Policy.from_json(None) == Policy()


def test_the_account_comes_from_the_setting_gcloud_or_the_credentials(tmp_path):
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / ".config")}
    s = settings.resolve({}, env=env, cwd=tmp_path)
    assert acting_account(s, None) == ("", "not set")
    creds = user_credentials.Credentials("token", account="ada@example.com")  # as gcloud's ADC file makes them
    assert acting_account(s, creds) == ("ada@example.com", "the credentials")
    assert acting_account(s, user_credentials.Credentials("token"))[0] == ""
    gcloud = tmp_path / ".config" / "gcloud"
    (gcloud / "configurations").mkdir(parents=True)
    (gcloud / "active_config").write_text("work\n")
    (gcloud / "configurations" / "config_work").write_text("[core]\naccount = bob@example.com\nproject = p\n")
    s = settings.resolve({}, env=env, cwd=tmp_path)
    assert acting_account(s, creds)[0] == "bob@example.com" and "gcloud" in s.account.source
    s = settings.resolve({}, env={**env, "TPURUN_ACCOUNT": "sa@p.iam.gserviceaccount.com"}, cwd=tmp_path)
    assert acting_account(s, creds) == ("sa@p.iam.gserviceaccount.com", "env TPURUN_ACCOUNT")
    assert is_service_account(s.account.value or "") and not is_service_account("ada@example.com")
