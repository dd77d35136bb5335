"""The console's pages over HTTP (proxy/admin/console.py): every page renders, values
from anyone (keys, purls) are escaped, forms act and redirect, bad input is a page
saying what is wrong, and the install guide fits the proxy's own address."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.admin.install import client_guides
from proxy.config.load import load
from tests.admin_support import AUTH, admin_config, wait_until
from tests.conftest import ProxyFactory
from tests.upstream import FakeUpstream, ProjectFile

RAW = """
[[repositories]]
name = "tools"
format = "raw"
upstream = "UPSTREAM/raw/"
"""


@pytest.fixture
def console(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> Iterator[httpx.Client]:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    config = admin_config(
        tmp_path, upstream.base_url, extra=RAW.replace("UPSTREAM", upstream.base_url)
    )
    proxy = start_proxy(load(config, {}))
    with httpx.Client(base_url=proxy.url, auth=AUTH, timeout=30) as client:
        yield client


def csrf(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page)
    assert found is not None
    return found.group(1)


def test_every_page_renders(console: httpx.Client) -> None:
    assert console.get("/pypi/files/alpha/alpha-1.0.tar.gz").status_code == 200
    for path in ("/ui/", "/ui/in-flight", "/ui/jobs", "/ui/browse", "/ui/browse?repository=pypi&view=entries",
                 "/ui/browse?repository=tools", "/ui/browse?repository=pypi&q=al",
                 "/ui/packages/pypi/alpha", "/ui/entries/pypi/files/alpha/alpha-1.0.tar.gz", "/ui/install"):  # fmt: skip
        page = console.get(path)
        assert page.status_code == 200, (path, page.text)
        assert page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert "<script" not in page.text  # usable without JavaScript: there is none
    assert console.get("/ui", follow_redirects=False).headers["location"] == "/ui/"


def test_bad_input_is_a_page_saying_what_is_wrong(console: httpx.Client) -> None:
    for path, status, message in (
        ("/ui/nothing", 404, "no console page"),
        ("/ui/browse?repository=nope", 404, "no repository named"),
        ("/ui/browse?repository=pypi&after=%21%21", 400, "not a cursor"),
        ("/ui/packages/pypi/none", 404, "nothing of package"),
        ("/ui/entries/pypi/none", 404, "no entry"),
        ("/ui/mirror-runs/x", 404, "not a mirror run id"),
        ("/ui/mirror-runs/42", 404, "no mirror run 42"),
    ):
        page = console.get(path)
        assert page.status_code == status and message in page.text, (path, page.text)
    token = csrf(console.get("/ui/jobs").text)
    refused = console.post("/ui/mirror-runs", data={"csrf_token": token, "purls": "pkg:npm/x@1"})
    assert refused.status_code == 400 and "supported: pypi, maven" in refused.text


def test_keys_from_anyone_are_escaped(console: httpx.Client, upstream: FakeUpstream) -> None:
    hostile = "x<b>onmouseover=alert(1)</b>.tar.gz"
    assert (
        console.get(f"/tools/{hostile.replace('<', '%3C').replace('>', '%3E')}").status_code == 404
    )
    page = console.get("/ui/browse?repository=tools").text
    assert "x&lt;b&gt;onmouseover=alert(1)&lt;/b&gt;.tar.gz" in page
    assert "<b>onmouseover" not in page


def test_a_notice_is_shown_only_if_the_console_wrote_it(console: httpx.Client) -> None:
    """The notice after a form (post/redirect/get) travels in the URL: anyone's link
    could put words in the console's mouth ("your password expired, go to ...")."""
    phish = "Your session expired: sign in again at https://evil.example/login"
    for path in ("/ui/", "/ui/jobs", "/ui/browse?repository=pypi"):
        page = console.get(path, params={"notice": phish}).text
        assert "evil.example" not in page, path
    forged = console.get("/ui/", params={"notice": phish, "notice_sig": "0" * 64}).text
    assert "evil.example" not in forged
    token = csrf(console.get("/ui/jobs").text)
    done = console.post(
        "/ui/purge-package", data={"csrf_token": token, "repository": "pypi", "package": "x"},
        follow_redirects=False,
    )  # fmt: skip
    assert done.status_code == 303
    shown = console.get(done.headers["location"]).text
    assert 'class="notice"' in shown and "purged x: 0 entries" in shown
    # Another user's browser does not show it either: the notice is the writer's.
    other = httpx.get(
        str(console.base_url) + done.headers["location"], auth=("viewer", "viewer-password")
    )
    assert other.status_code == 200 and "purged x" not in other.text


def test_forms_act_and_redirect(console: httpx.Client, upstream: FakeUpstream) -> None:
    assert console.get("/pypi/files/alpha/alpha-1.0.tar.gz").status_code == 200
    entry_page = console.get("/ui/entries/pypi/files/alpha/alpha-1.0.tar.gz").text
    done = console.post(
        "/ui/purge-entry",
        data={"csrf_token": csrf(entry_page), "repository": "pypi", "key": "files/alpha/alpha-1.0.tar.gz"},
        follow_redirects=False,
    )  # fmt: skip
    assert done.status_code == 303
    shown = console.get(done.headers["location"]).text
    assert "purged files/alpha/alpha-1.0.tar.gz" in shown
    assert console.get("/ui/entries/pypi/files/alpha/alpha-1.0.tar.gz").status_code == 404
    started = console.post(
        "/ui/mirror-runs", data={"csrf_token": csrf(entry_page), "purls": "pkg:pypi/alpha@1.0"},
        follow_redirects=False,
    )  # fmt: skip
    assert started.status_code == 303 and "/ui/mirror-runs/" in started.headers["location"]
    run_page = wait_until(
        "the run to end",
        lambda: (p := console.get(started.headers["location"]).text) and "running" not in p and p,
    )
    assert 'id="run-state" class="ok">ok' in run_page and "1 fetched" in run_page
    assert upstream.count("/packages/alpha-1.0.tar.gz") == 2  # purged, so fetched again


def test_a_running_run_reloads_itself(console: httpx.Client, upstream: FakeUpstream) -> None:
    upstream.fault("/simple/alpha/", hang=True)
    token = csrf(console.get("/ui/jobs").text)
    started = console.post("/ui/mirror-runs", data={"csrf_token": token, "purls": "pkg:pypi/alpha"},
                           follow_redirects=False)  # fmt: skip
    page = console.get(started.headers["location"]).text
    assert '<meta http-equiv="refresh" content="2">' in page and "Cancel the run" in page
    cancel = re.search(r'action="(/ui/mirror-runs/\d+/cancel)"', page)
    assert cancel is not None
    assert console.post(cancel.group(1), data={"csrf_token": token}).status_code == 303
    wait_until(
        "the cancellation",
        lambda: "cancelled on request" in console.get(started.headers["location"]).text,
    )
    upstream.clear_faults()


def test_install_guide_fits_the_address(tmp_path: Path) -> None:
    settings = load(admin_config(tmp_path, "http://127.0.0.1:9"), {})
    plain = {g.repository: g for g in client_guides(settings, "http://proxy.internal:8080")}
    pypi = "\n".join(s.text for s in plain["pypi"].snippets)
    assert (
        "--index-url http://proxy.internal:8080/pypi/simple/ --trusted-host proxy.internal" in pypi
    )
    assert "default = true" in pypi
    maven = "\n".join(s.text for s in plain["maven"].snippets)
    assert "<url>http://proxy.internal:8080/maven/</url>" in maven
    assert "allowInsecureProtocol = true" in maven and "isAllowInsecureProtocol = true" in maven
    assert "allowInsecureProtocol = true" in plain["cache"].snippets[0].text
    secure = {g.repository: g for g in client_guides(settings, "https://proxy.internal")}
    every = "\n".join(s.text for g in secure.values() for s in g.snippets)
    assert "allowInsecureProtocol" not in every and "trusted-host" not in every
    assert "https://proxy.internal/pypi/simple/" in every


def test_behind_a_path_prefix_every_link_form_and_redirect_keeps_it(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """server.public_url with a path (config.example.toml: "behind a load balancer or a
    path prefix"): the balancer strips /artifacts, the browser sees it. Links, forms and
    redirects named /ui/... from the root: every click left the console."""
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    extra = '[server]\npublic_url = "https://lb.example/artifacts"\n'
    config = admin_config(tmp_path, upstream.base_url, extra=extra)
    proxy = start_proxy(load(config, {}))
    with httpx.Client(base_url=proxy.url, auth=AUTH, timeout=30) as client:
        assert client.get("/pypi/files/alpha/alpha-1.0.tar.gz").status_code == 200
        for path in ("/ui/", "/ui/jobs", "/ui/browse?repository=pypi", "/ui/packages/pypi/alpha",
                     "/ui/entries/pypi/files/alpha/alpha-1.0.tar.gz", "/ui/nothing"):  # fmt: skip
            page = client.get(path).text
            targets = re.findall(r'(?:href|action)="(/[^"]*)"', page)
            assert targets, path
            assert all(t.startswith("/artifacts/ui/") for t in targets), (path, targets)
        assert client.get("/ui", follow_redirects=False).headers["location"] == "/artifacts/ui/"
        token = csrf(client.get("/ui/jobs").text)
        started = client.post(
            "/ui/mirror-runs", data={"csrf_token": token, "purls": "pkg:pypi/alpha"},
            follow_redirects=False,
        )  # fmt: skip
        assert started.status_code == 303
        assert started.headers["location"].startswith("/artifacts/ui/mirror-runs/")
        api = client.post("/api/v1/mirror-runs", json={"purls": ["pkg:pypi/alpha"]})
        assert api.status_code == 202
        assert api.headers["location"].startswith("/artifacts/api/v1/mirror-runs/")
        assert api.json()["url"] == api.headers["location"]
