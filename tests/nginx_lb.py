"""deploy/nginx.conf run by Debian's nginx in front of proxies on this machine, for the
tests (tests/test_lb_nginx.py) and the benchmarks (bench/hits.py).

The config is used as shipped, with only what ties it to Docker replaced: the DNS
resolver and the replicas' name become this machine's proxy, the listen port a free
one, the paths a folder of the caller's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def balancer_config(
    folder: Path, listen_port: int, replica_port: int, source: Path = DEPLOY / "nginx.conf"
) -> Path:
    """``source`` (deploy/nginx.conf, or another checkout's) made to run here."""
    text = source.read_text()
    replacements = {
        "resolver 127.0.0.11 valid=5s ipv6=off;": "",
        "set $replicas proxy-replicas;": "set $replicas 127.0.0.1;",
        "http://$replicas:8080": f"http://$replicas:{replica_port}",
        "listen 8080;": f"listen 127.0.0.1:{listen_port};",
        "/var/cache/nginx/artifacts": str(folder / "cache"),
        "access_log /dev/stdout lb": f"access_log {folder / 'access.log'} lb",
    }
    for old, new in replacements.items():
        assert old in text, f"{source} no longer has {old!r}: update tests/nginx_lb.py"
        text = text.replace(old, new)
    # As root, nginx's workers would run as nobody, who may not enter the caller's folder.
    user = "user root;\n" if os.geteuid() == 0 else ""
    path = folder / "nginx.conf"
    path.write_text(f"{user}pid {folder / 'nginx.pid'};\nerror_log {folder / 'error.log'};\n{text}")
    return path


@contextmanager
def running_balancer(
    folder: Path, listen_port: int, replica_port: int, source: Path = DEPLOY / "nginx.conf"
) -> Iterator[str]:
    """nginx with deploy/nginx.conf (or ``source``) in front of the proxy on
    ``replica_port``; its URL."""
    if not Path(NGINX).exists():
        raise RuntimeError("Debian's nginx is needed (.ci/run installs it)")
    folder.mkdir(parents=True, exist_ok=True)
    config = balancer_config(folder, listen_port, replica_port, source)
    nginx = subprocess.Popen(
        [NGINX, "-p", str(folder), "-c", str(config), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # it logs to error.log
    )
    url = f"http://127.0.0.1:{listen_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if nginx.poll() is not None:
                raise RuntimeError((folder / "error.log").read_text())
            try:
                if httpx.get(f"{url}/lb-healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("nginx did not listen within 30 s")
            time.sleep(0.05)
        yield url
    finally:
        nginx.terminate()
        nginx.wait(timeout=30)
