#!/usr/bin/env python3
"""The container's health check: GET a path of the proxy on the address it listens on.

    proxy-healthcheck [PATH]        (default /healthz; compose uses /readyz)

The address is PROXY_LISTEN (HOST:PORT, read now, so a changed listen address is
followed); a wildcard host (0.0.0.0, ::, empty) is checked on the loopback address.
Where the connection gets no HTTP answer (a listener with ``server.tls_cert`` hangs up
on plain HTTP), the same URL is asked in HTTPS. Exit 0 when the answer is 200, else 1
with the reason on stderr. Standard library only.
"""

from __future__ import annotations

import http.client
import os
import ssl
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 2.5


def url_for(listen: str, path: str) -> str:
    host, _, port = listen.strip().rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::", "*"):
        host = "127.0.0.1"  # a "::" socket is dual-stack: it answers on 127.0.0.1 too
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port or '8080'}{path}"


def status_of(url: str) -> int:
    """The answer's status; ``OSError`` (or ``http.client.HTTPException``) if none."""
    # An HTTPS listener (server.tls_cert) is this process's own: its certificate names
    # the public host, not the loopback address asked, so it is not verified here.
    context = None
    if url.startswith("https:"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "/healthz"
    url = url_for(os.environ.get("PROXY_LISTEN") or "127.0.0.1:8080", path)
    try:
        try:
            status = status_of(url)
        except (ConnectionResetError, http.client.HTTPException):
            # Connected, but no HTTP answer: a TLS listener hangs up on plain HTTP. This
            # check reads no config, so it asks again in HTTPS.
            url = "https" + url.removeprefix("http")
            status = status_of(url)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"{url}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
