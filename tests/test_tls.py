"""HTTPS without a load balancer: ``server.tls_cert`` / ``server.tls_key``, checked at
load, served to real clients (curl, pip) with a self-signed certificate made here."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from proxy.config.load import load
from proxy.exceptions import ConfigError
from tests.conftest import pypi_config, write_config
from tests.processes import ProxyProcess
from tests.upstream import FakeUpstream, ProjectFile, make_wheel


def make_certificate(
    folder: Path, name: str = "proxy", passphrase: str | None = None
) -> tuple[Path, Path, Path]:
    """A certificate authority of the test's own and a server certificate for 127.0.0.1
    it signed: (server certificate, its key, the authority's certificate)."""
    ca_cert, ca_key = folder / f"{name}-ca.crt", folder / f"{name}-ca.key"
    cert, key, request = folder / f"{name}.crt", folder / f"{name}.key", folder / f"{name}.csr"
    openssl = ["openssl"]

    def run(*args: str) -> None:
        subprocess.run([*openssl, *args], check=True, capture_output=True, timeout=60)

    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name} test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
        "-keyout", str(ca_key), "-out", str(ca_cert),
    )  # fmt: skip
    key_args = ["-passout", f"pass:{passphrase}"] if passphrase else ["-nodes"]
    run(
        "req", "-newkey", "rsa:2048", *key_args, "-subj", "/CN=127.0.0.1",
        "-keyout", str(key), "-out", str(request),
    )  # fmt: skip
    extensions = folder / f"{name}.ext"
    extensions.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    run(
        "x509", "-req", "-in", str(request), "-CA", str(ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-extfile", str(extensions), "-out", str(cert),
    )  # fmt: skip
    return cert, key, ca_cert


def tls_config(tmp_path: Path, upstream_url: str, cert: Path, key: Path) -> Path:
    extra = f'[server]\ntls_cert = "{cert}"\ntls_key = "{key}"'
    return write_config(tmp_path, pypi_config(tmp_path / "data", upstream_url, extra=extra))


def test_settings_are_checked_at_load(tmp_path: Path) -> None:
    cert, key, _ca = make_certificate(tmp_path)
    other_cert, _other_key, _other_ca = make_certificate(tmp_path, "other")
    encrypted_cert, encrypted_key, _ = make_certificate(tmp_path, "locked", passphrase="pw")
    cases = {
        f'tls_cert = "{cert}"': "server.tls_key: is required when server.tls_cert is set",
        f'tls_key = "{key}"': "server.tls_cert: is required when server.tls_key is set",
        f'tls_cert = "{tmp_path}/nope.crt"\ntls_key = "{key}"': "server.tls_cert: ",
        f'tls_cert = "{tmp_path}"\ntls_key = "{key}"': "is a folder, not a PEM file",
        f'tls_cert = "{other_cert}"\ntls_key = "{key}"': "cannot be loaded",
        f'tls_cert = "{encrypted_cert}"\ntls_key = "{encrypted_key}"': "cannot be loaded",
        f'tls_cert = "{tmp_path}/proxy.key"\ntls_key = "{cert}"': "cannot be loaded",
    }
    for body, message in cases.items():
        path = write_config(tmp_path, f"[server]\n{body}\n", "bad.toml")
        with pytest.raises(ConfigError) as caught:
            load(path, {})
        assert any(message in error for error in caught.value.errors), (body, caught.value.errors)
    relative = write_config(
        tmp_path, '[server]\ntls_cert = "proxy.crt"\ntls_key = "proxy.key"\n', "rel.toml"
    )
    settings = load(relative, {})
    assert settings.tls is not None and settings.tls.cert == cert
    assert settings.base_url.startswith("https://")


def start_https(config: Path, tmp_path: Path, cert: Path) -> ProxyProcess:
    proxy = ProxyProcess(config, tmp_path, "tls").start()
    proxy.url = f"https://127.0.0.1:{proxy.port}"
    context = ssl.create_default_context(cafile=str(cert))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proxy.process is not None and proxy.process.poll() is None, proxy.log()
        try:
            if httpx.get(proxy.url + "/readyz", verify=context, timeout=1).status_code == 200:
                return proxy
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(proxy.log())


@pytest.mark.slow
def test_curl_and_pip_over_https(
    tmp_path: Path, upstream: FakeUpstream, clean_env: dict[str, str]
) -> None:
    wheel_name, wheel, _metadata = make_wheel("tlsdemo", "1.0")
    upstream.add_project("tlsdemo", [ProjectFile(wheel_name, wheel)])
    cert, key, ca = make_certificate(tmp_path)
    proxy = start_https(tls_config(tmp_path, upstream.base_url, cert, key), tmp_path, ca)
    try:
        page = subprocess.run(
            ["curl", "-sS", "--fail", "--cacert", str(ca), proxy.url + "/pypi/simple/tlsdemo/"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert page.returncode == 0, page.stderr
        assert wheel_name in page.stdout
        # Without the certificate, a client refuses the self-signed server.
        refused = subprocess.run(
            ["curl", "-sS", proxy.url + "/readyz"], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode != 0
        # Plain HTTP on the TLS port gets no answer a client could mistake for one.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{proxy.port}/readyz", timeout=5)
        target = tmp_path / "site"
        install = subprocess.run(
            [
                sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                "--index-url", proxy.url + "/pypi/simple/", "--cert", str(ca), "tlsdemo==1.0",
            ],
            capture_output=True, text=True, timeout=180,
            # pip checks servers with the system's store (truststore): point it at ours.
            env={**clean_env, "PIP_CONFIG_FILE": "/dev/null", "SSL_CERT_FILE": str(ca)},
        )  # fmt: skip
        assert install.returncode == 0, install.stdout + install.stderr
        assert list(target.glob("tlsdemo*"))
    finally:
        proxy.stop()
    assert f"listening on https://127.0.0.1:{proxy.port}" in proxy.log()


def test_the_images_health_check_follows_an_https_listener(
    tmp_path: Path, upstream: FakeUpstream, clean_env: dict[str, str]
) -> None:
    """The image's HEALTHCHECK (deploy/healthcheck.py) asked the TLS port in plain HTTP:
    a container serving HTTPS itself was unhealthy for ever. It reads no config (the
    standard library only), so it tries HTTPS where plain HTTP got no answer."""
    cert, key, ca = make_certificate(tmp_path)
    proxy = start_https(tls_config(tmp_path, upstream.base_url, cert, key), tmp_path, ca)
    check = Path(__file__).resolve().parent.parent / "deploy" / "healthcheck.py"
    try:
        for path in ("/healthz", "/readyz?scope=local"):
            done = subprocess.run(
                [sys.executable, str(check), path],
                env={**clean_env, "PROXY_LISTEN": f"0.0.0.0:{proxy.port}"},
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
        missing = subprocess.run(
            [sys.executable, str(check), "/nothing-here"],
            env={**clean_env, "PROXY_LISTEN": f"127.0.0.1:{proxy.port}"},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert missing.returncode == 1 and "https://127.0.0.1" in missing.stderr, missing.stderr
    finally:
        proxy.stop()
