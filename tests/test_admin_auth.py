"""Who may use /ui/ and /api/ (proxy/admin/auth.py): users by password or token, 403
naming the setting without users (read-only on loopback with the embedded defaults),
throttled and logged wrong passwords, and writes refused across origins or without the
console's CSRF token."""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

import httpx
import pytest

from proxy.config.load import load
from proxy.exceptions import ConfigError
from proxy.runtime.throttle import FailureThrottle
from tests.admin_support import AUTH, PASSWORD, TOKEN, admin_config
from tests.conftest import ProxyFactory, write_config
from tests.upstream import FakeUpstream


def test_no_admin_user_means_403_naming_the_setting(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url, admin=""), {}))
    for path in ("/ui/", "/api/v1/stats", "/ui/browse"):
        refused = httpx.get(proxy.url + path, auth=AUTH)
        assert refused.status_code == 403
        assert "admin.users" in refused.text
    assert httpx.delete(proxy.url + "/api/v1/packages/pypi/x").status_code == 403
    # The package routes are not affected.
    assert httpx.get(proxy.url + "/pypi/simple/").status_code in (200, 404)


def test_anonymous_read_opens_reads_only(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    admin = f'[admin]\nanonymous = "read"\n[admin.users.ops]\npassword = "{PASSWORD}"\n'
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url, admin=admin), {}))
    page = httpx.get(proxy.url + "/ui/")
    assert page.status_code == 200 and "read-only (anonymous)" in page.text
    assert httpx.get(proxy.url + "/api/v1/stats").status_code == 200
    write = httpx.post(proxy.url + "/api/v1/mirror-runs", json={"purls": ["pkg:pypi/a"]})
    assert write.status_code == 401 and write.headers["www-authenticate"].startswith("Basic")
    assert httpx.delete(proxy.url + "/api/v1/packages/pypi/x").status_code == 401


def test_embedded_defaults_on_loopback_open_the_console_read_only(
    start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    settings = load(None, {"PROXY_STORAGE_PATH": str(tmp_path / "data")})
    assert settings.source == "embedded defaults" and settings.host == "127.0.0.1"
    proxy = start_proxy(settings)
    assert httpx.get(proxy.url + "/ui/").status_code == 200
    refused = httpx.delete(proxy.url + "/api/v1/packages/pypi/x")
    assert refused.status_code == 403 and "admin.users" in refused.text
    # A reverse proxy on the same machine (nginx on 0.0.0.0:80 in front of 127.0.0.1)
    # makes every client look local: what it forwards is no look on one's own machine.
    for forwarded in (
        {"x-forwarded-for": "203.0.113.9"},
        {"forwarded": "for=203.0.113.9"},
        {"x-real-ip": "203.0.113.9"},
    ):
        behind = httpx.get(proxy.url + "/ui/", headers=forwarded)
        assert behind.status_code == 403 and "admin.users" in behind.text, forwarded
        assert httpx.get(proxy.url + "/api/v1/stats", headers=forwarded).status_code == 403


def test_embedded_defaults_open_reads_only_to_a_loopback_host_name(
    start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """DNS rebinding: a page of evil.example whose name the attacker then points at
    127.0.0.1 makes the browser of this machine ask the console from a loopback
    client, same-origin for that page, with Host: evil.example. Only a request that
    names this machine (localhost, a loopback address) is a look on one's own machine."""
    settings = load(None, {"PROXY_STORAGE_PATH": str(tmp_path / "data")})
    proxy = start_proxy(settings)
    port = proxy.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", "LOCALHOST"):
        page = httpx.get(proxy.url + "/ui/", headers={"host": host})
        assert page.status_code == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"10.0.0.1:{port}", ""):
        for path in ("/ui/", "/api/v1/stats", "/api/v1/entries?repository=pypi"):
            refused = httpx.get(proxy.url + path, headers={"host": host})
            assert refused.status_code == 403 and "admin.users" in refused.text, (host, path)


def test_users_by_password_hash_and_token(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    digest = hashlib.sha256(b"hashed-one").hexdigest()
    admin = f'[admin]\n[admin.users.ops]\npassword_sha256 = "{digest}"\ntoken = "{TOKEN}"\n'
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url, admin=admin), {}))
    assert httpx.get(proxy.url + "/api/v1/stats", auth=("ops", "hashed-one")).status_code == 200
    bearer = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(proxy.url + "/api/v1/stats", headers=bearer).status_code == 200
    assert httpx.get(proxy.url + "/api/v1/stats").status_code == 401
    wrong = httpx.get(proxy.url + "/api/v1/stats", headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert (
        httpx.get(proxy.url + "/api/v1/stats", headers={"authorization": "Basic !!"}).status_code
        == 400
    )
    assert (
        httpx.get(proxy.url + "/api/v1/stats", headers={"authorization": "Digest x"}).status_code
        == 401
    )


def test_wrong_passwords_are_throttled_and_logged(
    tmp_path: Path,
    upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url), {}))
    with caplog.at_level(logging.WARNING, logger="proxy.admin"):
        statuses = [
            httpx.get(proxy.url + "/api/v1/stats", auth=("ops", f"guess-{i}")).status_code
            for i in range(6)
        ]
    assert statuses[:5] == [401] * 5 and statuses[5] == 429
    locked = httpx.get(proxy.url + "/api/v1/stats", auth=AUTH)  # even the right one, for now
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) > 0
    failures = [r for r in caplog.records if "admin login failed" in r.getMessage()]
    assert len(failures) == 5 and "user=ops" in failures[0].getMessage()
    assert not any("guess-" in r.getMessage() for r in caplog.records)


def test_throttle_locks_out_longer_each_time_and_forgets() -> None:
    now = [0.0]
    throttle = FailureThrottle(
        max_failures=3, window_s=10, lockout_s=5, max_lockout_s=12, max_keys=4, clock=lambda: now[0]
    )
    for _ in range(3):
        throttle.failed("client:a")
    assert throttle.retry_after("client:a") == 5
    now[0] = 6
    assert throttle.retry_after("client:a") is None
    for _ in range(3):
        throttle.failed("client:a")
    assert throttle.retry_after("client:a") == 10  # doubled
    now[0] = 20
    for _ in range(3):
        throttle.failed("client:a")
    assert throttle.retry_after("client:a") == 12  # capped
    throttle.succeeded("client:a")
    assert throttle.retry_after("client:a") is None
    for i in range(10):  # bounded memory
        throttle.failed(f"client:{i}")
    assert len(throttle._records) <= 4


def test_cross_site_writes_are_refused(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url), {}))
    delete = f"{proxy.url}/api/v1/packages/pypi/alpha"
    for headers in (
        {"origin": "https://evil.example"},
        {"referer": "https://evil.example/page"},
        {"sec-fetch-site": "cross-site"},
        {"origin": "null"},
    ):
        refused = httpx.delete(delete, auth=AUTH, headers=headers)
        assert refused.status_code == 403, headers
        assert "may not change anything" in refused.json()["error"]
    same_origin = {"origin": proxy.url}
    assert httpx.delete(delete, auth=AUTH, headers=same_origin).status_code == 200
    # Console forms need the user's CSRF token as well.
    form = {"repository": "pypi", "package": "alpha"}
    no_token = httpx.post(f"{proxy.url}/ui/purge-package", auth=AUTH, data=form)
    assert no_token.status_code == 403 and "CSRF" in no_token.text
    page = httpx.get(f"{proxy.url}/ui/jobs", auth=AUTH).text
    token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page)
    assert token is not None
    done = httpx.post(
        f"{proxy.url}/ui/purge-package", auth=AUTH, data={**form, "csrf_token": token.group(1)}
    )
    assert done.status_code == 303 and "/ui/browse" in done.headers["location"]
    # Another user's token is not ours.
    other = httpx.post(
        f"{proxy.url}/ui/purge-package", auth=("viewer", "viewer-password"),
        data={**form, "csrf_token": token.group(1)},
    )  # fmt: skip
    assert other.status_code == 403


def test_admin_settings_are_validated(tmp_path: Path) -> None:
    cases = {
        '[admin]\nanonymous = "write"': "admin.anonymous",
        "[admin]\n[admin.users.ops]\n": "admin.users.ops.password: is required",
        '[admin]\n[admin.users.ops]\npassword = "a"\npassword_sha256 = "'
        + "0" * 64
        + '"': "not both",
        '[admin]\n[admin.users.ops]\npassword_sha256 = "abc"': "64 hex digits",
        '[admin]\n[admin.users.ops]\npassword = ""': "must not be empty",
        '[admin]\n[admin.users.ops]\npasword = "x"': "admin.users.ops.pasword: unknown key",
        '[admin]\nusers = "x"': "admin.users: must be a table",
        '[admin]\n[admin.users.ops]\npassword = "${UNSET_ADMIN_PASSWORD}"': "UNSET_ADMIN_PASSWORD is not set",
    }
    for body, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            load(write_config(tmp_path, body), {})
        assert any(message in e for e in caught.value.errors), (body, caught.value.errors)
        keys = [e.split(":")[0] for e in caught.value.errors]
        assert len(keys) == len(set(keys)), caught.value.errors  # each key reported once
    described = load(admin_config(tmp_path, "http://127.0.0.1:9"), {}).describe()
    assert 'users.ops = { password = "***", token = "***" }' in described
    assert PASSWORD not in described and TOKEN not in described


def test_behind_a_load_balancer_the_public_address_is_our_origin(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """With ``server.public_url``, a browser on the public address sends that Origin
    while the Host the replica sees is whatever the balancer passes (the replica's own
    name, or a Host without the port): its forms must work, and the install guide must
    name the address clients use, not the replica's."""
    public = "https://artifacts.example.com"
    extra = f'[server]\npublic_url = "{public}"\n'
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url, extra=extra), {}))
    balanced = {"host": "replica-1.internal:8080"}
    page = httpx.get(f"{proxy.url}/ui/jobs", auth=AUTH, headers=balanced).text
    token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page)
    assert token is not None
    form = {"repository": "pypi", "package": "alpha", "csrf_token": token.group(1)}
    done = httpx.post(
        f"{proxy.url}/ui/purge-package", auth=AUTH, data=form,
        headers={**balanced, "origin": public},
    )  # fmt: skip
    assert done.status_code == 303, done.text
    api = httpx.delete(
        f"{proxy.url}/api/v1/packages/pypi/alpha", auth=AUTH,
        headers={**balanced, "origin": public},
    )  # fmt: skip
    assert api.status_code == 200, api.text
    elsewhere = httpx.delete(
        f"{proxy.url}/api/v1/packages/pypi/alpha", auth=AUTH,
        headers={**balanced, "origin": "https://artifacts.example.com.evil.example"},
    )  # fmt: skip
    assert elsewhere.status_code == 403
    guide = httpx.get(f"{proxy.url}/ui/install", auth=AUTH, headers=balanced).text
    assert f"{public}/pypi/simple/" in guide and "replica-1.internal" not in guide
    assert "allowInsecureProtocol" not in guide  # the clients' address is HTTPS
