"""The admin API (proxy/admin/api.py) over real HTTP: stats, jobs, keyset pages of
entries and packages, purges that send the next request upstream, mirror runs started,
followed and cancelled, the OpenAPI document, and clear errors for bad input."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from proxy.admin import api
from proxy.admin.openapi import openapi_document
from proxy.catalog import open_catalog
from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.mirror.runs import state_of
from tests.admin_support import AUTH, TOKEN, admin_config, client, wait_until
from tests.conftest import ProxyFactory
from tests.upstream import FakeUpstream, ProjectFile

PROJECTS = ["alpha", "beta", "betamax", "gamma", "delta"]


@pytest.fixture
def proxied(tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory) -> str:
    for name in PROJECTS:
        upstream.add_project(name, [ProjectFile(f"{name}-1.0.tar.gz", f"{name} 1.0".encode()),
                                    ProjectFile(f"{name}-2.0.tar.gz", f"{name} 2.0".encode())])  # fmt: skip
    return start_proxy(load(admin_config(tmp_path, upstream.base_url), {})).url


def fetch_all(url: str) -> None:
    for name in PROJECTS:
        assert httpx.get(f"{url}/pypi/simple/{name}/").status_code == 200
        for version in ("1.0", "2.0"):
            file = httpx.get(f"{url}/pypi/files/{name}/{name}-{version}.tar.gz")
            assert file.status_code == 200


def test_stats_count_entries_hits_and_misses(proxied: str) -> None:
    fetch_all(proxied)
    assert httpx.get(f"{proxied}/pypi/files/alpha/alpha-1.0.tar.gz").status_code == 200  # a hit
    with client(proxied) as api_client:
        stats = api_client.get("/api/v1/stats").json()
    [pypi] = [r for r in stats["repositories"] if r["name"] == "pypi"]
    assert pypi["entries"] == 15  # 5 pages and 10 files
    assert pypi["bytes"] > 0
    assert pypi["misses"] == 15 and pypi["hits"] == 1
    assert pypi["packages"] is True
    [replica] = stats["replicas"]
    assert replica["alive"] and replica["url"].startswith("http://127.0.0.1")
    assert stats["database"]["ok"] and stats["storage"]["writable"]
    [host] = stats["upstreams"]
    assert host["answers"] >= 15 and host["failures"] == 0 and host["ok"]


def test_entries_keyset_pages_search_and_entry_detail(proxied: str) -> None:
    fetch_all(proxied)
    with client(proxied) as api_client:
        seen: list[str] = []
        after = None
        pages = 0
        while True:
            params = {"repository": "pypi", "limit": "4", **({"after": after} if after else {})}
            page = api_client.get("/api/v1/entries", params=params).json()
            seen += [e["key"] for e in page["entries"]]
            pages += 1
            after = page["next"]
            if after is None:
                break
        assert pages == 4 and len(seen) == 15 and seen == sorted(seen)
        found = api_client.get("/api/v1/entries", params={"repository": "pypi", "q": "beta"}).json()
        assert {e["package"] for e in found["entries"]} == {"beta", "betamax"}
        assert {e["version"] for e in found["entries"] if e["key"].startswith("files/")} == {
            "1.0",
            "2.0",
        }
        packages = api_client.get(
            "/api/v1/packages", params={"repository": "pypi", "limit": "2"}
        ).json()
        assert [p["package"] for p in packages["packages"]] == ["alpha", "beta"]
        more = api_client.get(
            "/api/v1/packages", params={"repository": "pypi", "after": packages["next"]}
        ).json()
        assert [p["package"] for p in more["packages"]] == ["betamax", "delta", "gamma"]
        assert more["packages"][0]["versions"] == 2 and more["packages"][0]["entries"] == 3
        detail = api_client.get("/api/v1/entries/pypi/files/alpha/alpha-1.0.tar.gz").json()
        assert detail["digests"]["sha256"] == detail["sha256"]
        assert detail["upstream_url"].endswith("/packages/alpha-1.0.tar.gz")
        assert detail["package"] == "alpha" and detail["version"] == "1.0"
        assert detail["policy"] is None
        package = api_client.get("/api/v1/packages/pypi/alpha").json()
        assert [v["version"] for v in package["versions"]] == ["2.0", "1.0", None]


def test_purging_a_package_sends_the_next_request_upstream(
    proxied: str, upstream: FakeUpstream
) -> None:
    fetch_all(proxied)
    assert httpx.get(f"{proxied}/pypi/simple/ghost/").status_code == 404  # a negative entry
    assert httpx.get(f"{proxied}/pypi/simple/ghost/").status_code == 404
    assert upstream.count("/simple/ghost/") == 1
    with client(proxied) as api_client:
        purged = api_client.delete("/api/v1/packages/pypi/alpha").json()
        assert purged["deleted"] == 3 and purged["bytes"] > 0
        assert api_client.delete("/api/v1/packages/pypi/ghost").json()["deleted"] == 1
        left = api_client.get("/api/v1/entries", params={"repository": "pypi", "q": "alpha"}).json()
        assert left["entries"] == []
        # A build cache groups nothing by package: purge entries one by one.
        refused = api_client.delete("/api/v1/packages/cache/anything")
        assert refused.status_code == 400 and "one by one" in refused.json()["error"]
    # Served from the upstream again, not from anything remembered.
    file_path = "/packages/alpha-1.0.tar.gz"
    before = upstream.count(file_path)
    assert httpx.get(f"{proxied}/pypi/files/alpha/alpha-1.0.tar.gz").status_code == 200
    assert upstream.count(file_path) == before + 1
    assert httpx.get(f"{proxied}/pypi/simple/ghost/").status_code == 404
    assert upstream.count("/simple/ghost/") == 2


def test_pypi_package_names_are_found_and_purged_in_any_spelling(proxied: str) -> None:
    """PyPI names are equal in any case and run of -_. (PEP 503), and are stored
    normalized: `DELETE /api/v1/packages/pypi/Alpha` answered 200 "deleted 0" and
    purged nothing, a search for "Alpha" in the console found nothing."""
    fetch_all(proxied)
    with client(proxied) as api_client:
        found = api_client.get("/api/v1/packages/pypi/ALPHA")
        assert found.status_code == 200 and found.json()["entries"] == 3, found.text
        for path, q in (("/api/v1/packages", "Bet"), ("/api/v1/entries", "BETA")):
            page = api_client.get(path, params={"repository": "pypi", "q": q}).json()
            assert page["q"] == q.lower()
            rows = page.get("packages") or page["entries"]
            assert {row["package"] for row in rows} >= {"beta"}, page
        purged = api_client.delete("/api/v1/packages/pypi/Gamma").json()
        assert (purged["package"], purged["deleted"]) == ("gamma", 3)
        left = api_client.get("/api/v1/entries", params={"repository": "pypi", "q": "gamma"})
        assert left.json()["entries"] == []


def test_deleting_one_entry(proxied: str, upstream: FakeUpstream) -> None:
    fetch_all(proxied)
    with client(proxied) as api_client:
        assert api_client.delete("/api/v1/entries/pypi/files/beta/beta-2.0.tar.gz").json() == {
            "repository": "pypi", "key": "files/beta/beta-2.0.tar.gz", "deleted": 1,
        }  # fmt: skip
        again = api_client.delete("/api/v1/entries/pypi/files/beta/beta-2.0.tar.gz")
        assert again.status_code == 404
        # A key with "#" in it (the root page's representation) travels encoded.
        assert httpx.get(f"{proxied}/pypi/simple/").status_code == 200
        listed = api_client.get("/api/v1/entries", params={"repository": "pypi"}).json()
        [page_key] = [e["key"] for e in listed["entries"] if e["key"].startswith("simple/#")]
        encoded = page_key.replace("#", "%23")
        assert api_client.delete(f"/api/v1/entries/pypi/{encoded}").status_code == 200
    assert httpx.get(f"{proxied}/pypi/files/beta/beta-2.0.tar.gz").status_code == 200
    assert upstream.count("/packages/beta-2.0.tar.gz") == 2


def run_state(api_client: httpx.Client, run_id: int) -> dict[str, object]:
    response = api_client.get(f"/api/v1/mirror-runs/{run_id}")
    assert response.status_code == 200
    found: dict[str, object] = response.json()
    return found


def test_mirror_runs_started_followed_and_recorded_in_jobs(
    proxied: str, upstream: FakeUpstream
) -> None:
    with client(proxied) as api_client:
        started = api_client.post("/api/v1/mirror-runs", json={"purls": ["pkg:pypi/gamma@2.0"]})
        assert started.status_code == 202, started.text
        run_id = started.json()["id"]
        assert started.headers["location"] == f"/api/v1/mirror-runs/{run_id}"
        done = wait_until(
            "the run to end",
            lambda: (r := run_state(api_client, run_id))["state"] != "running" and r,
        )
        assert done["state"] == "ok" and done["fetched"] == 1 and done["origin"] == "api"
        assert upstream.count("/packages/gamma-2.0.tar.gz") == 1
        jobs = api_client.get("/api/v1/jobs").json()
        assert jobs["mirror_runs"][0]["id"] == run_id
        assert {"reclaim", "evict"} <= {j["name"] for j in jobs["jobs"]}
        assert api_client.delete(f"/api/v1/mirror-runs/{run_id}").status_code == 409
        # An SBOM inline: its purls of types nobody mirrors are skipped, not refused.
        sbom = {"bomFormat": "CycloneDX", "specVersion": "1.5",
                "components": [{"purl": "pkg:pypi/delta@1.0"}, {"purl": "pkg:golang/x/y@v1"}]}  # fmt: skip
        run_id = api_client.post("/api/v1/mirror-runs", json={"sbom": sbom}).json()["id"]
        done = wait_until(
            "the run to end",
            lambda: (r := run_state(api_client, run_id))["state"] != "running" and r,
        )
        assert done["fetched"] == 1 and done["skipped"] == 1 and done["state"] == "failed"
        assert "1 skipped" in str(done["error"])


def test_a_running_mirror_run_is_cancelled(proxied: str, upstream: FakeUpstream) -> None:
    upstream.fault("/simple/alpha/", hang=True)
    with client(proxied) as api_client:
        run_id = api_client.post("/api/v1/mirror-runs", json={"purls": ["pkg:pypi/alpha"]}).json()[
            "id"
        ]
        assert run_state(api_client, run_id)["state"] == "running"
        cancelled = api_client.delete(f"/api/v1/mirror-runs/{run_id}")
        assert cancelled.status_code == 202 and cancelled.json()["cancel_requested"] is True
        done = wait_until(
            "the cancellation",
            lambda: (r := run_state(api_client, run_id))["state"] != "running" and r,
        )
        assert done["state"] == "cancelled" and done["error"] == "cancelled on request"
    upstream.clear_faults()


def test_downloads_in_flight_report_their_progress(proxied: str, upstream: FakeUpstream) -> None:
    big = b"x" * (2 * 1024 * 1024)
    upstream.add_project("huge", [ProjectFile("huge-1.0.tar.gz", big)])
    assert httpx.get(f"{proxied}/pypi/simple/huge/").status_code == 200
    upstream.fault("/packages/huge-1.0.tar.gz", chunk_size=64 * 1024, chunk_delay_s=0.15)
    fetched: list[int] = []
    thread = threading.Thread(
        target=lambda: fetched.append(
            len(httpx.get(f"{proxied}/pypi/files/huge/huge-1.0.tar.gz", timeout=60).content)
        )
    )
    thread.start()
    try:
        with client(proxied) as api_client:
            row = wait_until(
                "a renewal that reports bytes",
                lambda: next((d for d in api_client.get("/api/v1/in-flight").json()["in_flight"]
                              if d["key"] == "pypi/files/huge/huge-1.0.tar.gz" and d["bytes"]), None),
            )  # fmt: skip
        assert row["length"] == len(big) and 0 < row["bytes"] <= len(big)
        assert row["waiters"] == 1 and row["rate"] > 0 and ":" in row["holder"]
    finally:
        thread.join(60)
    assert fetched == [len(big)]


def test_purging_an_entry_being_downloaded_says_so(proxied: str, upstream: FakeUpstream) -> None:
    """A purge of a file whose download is in flight answered 404 "no entry" (nothing is
    stored yet), and the download stored it a moment later: the operator read that it
    was gone. It says what is happening, and the purge after the download works."""
    upstream.add_project("slow", [ProjectFile("slow-1.0.tar.gz", b"s" * (512 * 1024))])
    assert httpx.get(f"{proxied}/pypi/simple/slow/").status_code == 200
    upstream.fault("/packages/slow-1.0.tar.gz", chunk_size=32 * 1024, chunk_delay_s=0.2)
    fetched: list[int] = []
    thread = threading.Thread(
        target=lambda: fetched.append(
            len(httpx.get(f"{proxied}/pypi/files/slow/slow-1.0.tar.gz", timeout=60).content)
        )
    )
    thread.start()
    key = "files/slow/slow-1.0.tar.gz"
    try:
        with client(proxied) as api_client:
            wait_until(
                "the download in flight",
                lambda: any(d["key"] == f"pypi/{key}"
                            for d in api_client.get("/api/v1/in-flight").json()["in_flight"]),
            )  # fmt: skip
            busy = api_client.delete(f"/api/v1/entries/pypi/{key}")
            assert busy.status_code == 409, busy.text
            assert "being downloaded" in busy.json()["error"]
    finally:
        thread.join(60)
    assert fetched == [512 * 1024]
    with client(proxied) as api_client:
        assert api_client.delete(f"/api/v1/entries/pypi/{key}").json()["deleted"] == 1
        assert api_client.delete(f"/api/v1/entries/pypi/{key}").status_code == 404


def test_openapi_describes_every_route() -> None:
    document = openapi_document()
    described = {
        (path, method.upper()) for path, item in document["paths"].items() for method in item
    }
    served = set()
    for route in api.routes():
        path = "/api" + route.path.replace("{path:path}", "{path}").replace(":path}", "}")  # type: ignore[attr-defined]
        if "{rest" in path:
            continue
        for method in route.methods - {"HEAD"}:  # type: ignore[attr-defined]
            served.add((path, method))
    assert served == described
    json.dumps(document)  # serializable


def test_every_answer_matches_its_openapi_schema(proxied: str, upstream: FakeUpstream) -> None:
    """What each endpoint answers (its data and its errors) is what the OpenAPI document
    says it answers: a client generated from the document must be able to read it."""
    fetch_all(proxied)
    document = openapi_document()
    registry: Registry[Any] = Registry().with_resource(
        "urn:openapi", Resource.from_contents(document, default_specification=DRAFT202012)
    )
    # A download in flight, a running run: of a project whose page is not cached yet
    # (one stored page model serves every representation, so a cached one is no fetch).
    upstream.add_project("epsilon", [ProjectFile("epsilon-1.0.tar.gz", b"epsilon 1.0")])
    upstream.fault("/simple/epsilon/", hang=True)
    with client(proxied) as api_client:
        run = api_client.post("/api/v1/mirror-runs", json={"purls": ["pkg:pypi/epsilon"]})
        run_id = run.json()["id"]
        wait_until("the download", lambda: api_client.get("/api/v1/in-flight").json()["in_flight"])
        asked = [
            ("/api/v1/stats", "/api/v1/stats", "get"),
            ("/api/v1/replicas", "/api/v1/replicas", "get"),
            ("/api/v1/in-flight", "/api/v1/in-flight", "get"),
            ("/api/v1/jobs", "/api/v1/jobs", "get"),
            ("/api/v1/entries", "/api/v1/entries?repository=pypi&limit=3", "get"),
            ("/api/v1/entries", "/api/v1/entries?repository=pypi&q=al", "get"),
            ("/api/v1/entries", "/api/v1/entries", "get"),
            ("/api/v1/packages", "/api/v1/packages?repository=pypi&limit=2", "get"),
            ("/api/v1/entries/{repository}/{path}",
             "/api/v1/entries/pypi/files/alpha/alpha-1.0.tar.gz", "get"),
            ("/api/v1/entries/{repository}/{path}", "/api/v1/entries/pypi/none", "get"),
            ("/api/v1/packages/{repository}/{package}", "/api/v1/packages/pypi/alpha", "get"),
            ("/api/v1/mirror-runs/{run_id}", f"/api/v1/mirror-runs/{run_id}", "get"),
            ("/api/v1/mirror-runs/{run_id}", f"/api/v1/mirror-runs/{run_id}", "delete"),
            ("/api/v1/mirror-runs/{run_id}", "/api/v1/mirror-runs/x", "get"),
            ("/api/v1/entries/{repository}/{path}",
             "/api/v1/entries/pypi/files/beta/beta-1.0.tar.gz", "delete"),
            ("/api/v1/packages/{repository}/{package}", "/api/v1/packages/pypi/delta", "delete"),
            ("/api/v1/packages/{repository}/{package}", "/api/v1/packages/cache/x", "delete"),
        ]  # fmt: skip
        for path, url, method in asked:
            response = api_client.request(method, url)
            described = document["paths"][path][method]["responses"]
            assert str(response.status_code) in described, (method, url, response.status_code)
            schema = described[str(response.status_code)]["content"]["application/json"]
            reference = {"$ref": "urn:openapi#" + schema["schema"]["$ref"][1:]}
            validator = Draft202012Validator(reference, registry=registry)
            errors = [e.message for e in validator.iter_errors(response.json())]
            assert errors == [], (method, url, errors)
    upstream.clear_faults()


def test_bad_input_gets_a_clear_error(proxied: str) -> None:
    with client(proxied) as api_client:
        cases = [
            (api_client.get("/api/v1/entries"), 400, "give a repository"),
            (
                api_client.get("/api/v1/entries", params={"repository": "nope"}),
                404,
                "configured: pypi, maven, cache",
            ),
            (
                api_client.get("/api/v1/entries", params={"repository": "pypi", "after": "!!"}),
                400,
                "not a cursor",
            ),
            (
                api_client.get("/api/v1/entries", params={"repository": "pypi", "after": "WzFd"}),
                400,
                "not a cursor",
            ),
            (
                api_client.get("/api/v1/entries", params={"repository": "pypi", "limit": "0"}),
                400,
                "limit",
            ),
            (api_client.get("/api/v1/mirror-runs/abc"), 400, "not a mirror run id"),
            (api_client.get("/api/v1/mirror-runs/99999"), 404, "no mirror run 99999"),
            (
                api_client.post(
                    "/api/v1/mirror-runs",
                    content=b"{",
                    headers={"content-type": "application/json"},
                ),
                400,
                "not JSON",
            ),
            (
                api_client.post(
                    "/api/v1/mirror-runs",
                    content=b"purls=x",
                    headers={"content-type": "application/x-www-form-urlencoded"},
                ),
                415,
                "application/json",
            ),
            (api_client.post("/api/v1/mirror-runs", json=[]), 400, "must be an object"),
            (api_client.post("/api/v1/mirror-runs", json={}), 400, "nothing to mirror"),
            (
                api_client.post("/api/v1/mirror-runs", json={"purls": ["nope"]}),
                400,
                "not a package URL",
            ),
            (
                api_client.post("/api/v1/mirror-runs", json={"purls": ["pkg:npm/x@1"]}),
                400,
                "supported: pypi, maven",
            ),
            (
                api_client.post(
                    "/api/v1/mirror-runs", json={"purls": ["pkg:pypi/x"], "versions": "some"}
                ),
                400,
                "versions",
            ),
            (
                api_client.post(
                    "/api/v1/mirror-runs", json={"purls": ["pkg:pypi/x"], "repository": "cache"}
                ),
                400,
                "not a repository that mirrors",
            ),
            (api_client.post("/api/v1/mirror-runs", json={"sbom": {"no": "sbom"}}), 400, "sbom:"),
            (
                api_client.post("/api/v1/mirror-runs", json={"purls": [], "bogus": 1}),
                400,
                "unknown fields bogus",
            ),
            (api_client.get("/api/v1/nothing"), 404, "openapi.json"),
            (api_client.get("/api/v1/entries/pypi/files/none"), 404, "no entry"),
            (api_client.get("/api/v1/packages/pypi/none"), 404, "nothing of package"),
            # A percent-encoded newline is a character like any other: answered by the
            # API in JSON (the router's regex did not match it: Starlette's plain text
            # "Not Found").
            (api_client.get("/api/v1/entries/pypi/files/a%0Ab"), 404, "no entry"),
            (api_client.get("/api/v1/packages/pypi/a%0D%0Ab"), 404, "nothing of package"),
            (api_client.get("/api/v1/%0A"), 404, "openapi.json"),
            # No name is no package: a purge of "" answered 200 "deleted 0".
            (api_client.delete("/api/v1/packages/pypi/"), 400, "give a package name"),
            (api_client.get("/api/v1/packages/pypi/"), 400, "give a package name"),
        ]
        for response, status, message in cases:
            assert response.status_code == status, (response.request.url, response.text)
            assert message in response.json()["error"], (response.request.url, response.text)
        # A Bearer token may send JSON without the content type a browser cannot forge.
        bearer = httpx.post(
            f"{proxied}/api/v1/mirror-runs", content=b'{"purls": ["pkg:pypi/beta@1.0"]}',
            headers={"authorization": f"Bearer {TOKEN}"},
        )  # fmt: skip
        assert bearer.status_code == 202
        # Media types are case-insensitive (RFC 9110 8.3.1): any spelling of JSON is JSON.
        spelled = api_client.post(
            "/api/v1/mirror-runs", content=b'{"purls": ["pkg:pypi/beta@1.0"]}',
            headers={"content-type": "Application/JSON; charset=UTF-8"},
        )  # fmt: skip
        assert spelled.status_code == 202, spelled.text


def test_no_answer_shows_a_secret(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"a")])
    secret_upstream = upstream.base_url.replace("http://", "http://ops:upstream-s3cret@")
    proxy = start_proxy(load(admin_config(tmp_path, secret_upstream), {}))
    assert httpx.get(f"{proxy.url}/pypi/files/alpha/alpha-1.0.tar.gz").status_code == 200
    with client(proxy.url) as api_client:
        bodies = [api_client.get(path).text for path in (
            "/api/v1/stats", "/api/v1/jobs", "/api/v1/in-flight", "/api/v1/replicas",
            "/api/v1/entries?repository=pypi", "/api/v1/entries/pypi/files/alpha/alpha-1.0.tar.gz",
            "/ui/", "/ui/jobs", "/ui/install", "/ui/browse?repository=pypi&view=entries",
            "/ui/entries/pypi/files/alpha/alpha-1.0.tar.gz",
        )]  # fmt: skip
    for body in bodies:
        assert "upstream-s3cret" not in body
        assert AUTH[1] not in body and TOKEN not in body
    assert "***@" in bodies[0]  # the configured upstream, shown without its password


def test_package_names_with_a_slash(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """npm's scoped packages (``@scope/name``) are one package, in the API and the console."""
    from proxy.formats.npm import package_of

    assert package_of("@babel/core/-/core-7.24.0.tgz") is not None
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url), {}))
    with client(proxy.url) as api_client:
        missing = api_client.get("/api/v1/packages/pypi/@scope/name")
        assert missing.status_code == 404 and "@scope/name" in missing.json()["error"]
        assert api_client.delete("/api/v1/packages/pypi/@scope%2Fname").json()["deleted"] == 0


def cursor_of(values: list[str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")


def test_forged_cursors_odd_text_and_numbers_are_a_400(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory, database_url: str
) -> None:
    """Whatever a client puts in a cursor, a search, a key or a number is a 400 saying
    so on either backend, never a 500 (an unencodable surrogate, a NUL that Postgres
    refuses in text, a digit Python's int() reads but not as ASCII, a number over
    64 bits)."""
    database = f'[database]\nurl = "{database_url}"\n'
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url, extra=database), {}))
    odd = ["\ud800", "a\x00b"]
    with client(proxy.url) as api_client:
        responses = []
        for text in odd:
            for values in ([text], ["a", text], [text, "k"]):
                after = cursor_of(values)
                for path in ("/api/v1/entries", "/api/v1/packages"):
                    params = {"repository": "pypi", "after": after}
                    responses.append(api_client.get(path, params=params))
                    responses.append(api_client.get(path, params={**params, "q": "a"}))
                responses.append(api_client.get("/ui/browse", params={"repository": "pypi",
                                                                      "after": after}))  # fmt: skip
        for path in ("/api/v1/entries", "/api/v1/packages"):
            responses.append(api_client.get(path, params={"repository": "pypi", "q": "a\x00"}))
        responses.append(api_client.get("/ui/browse", params={"repository": "pypi", "q": "\x00"}))
        for path in ("entries/pypi/a%00b", "packages/pypi/a%00b"):
            responses.append(api_client.get(f"/api/v1/{path}"))
            responses.append(api_client.delete(f"/api/v1/{path}"))
            responses.append(api_client.get(f"/ui/{path}"))
        for number in ("%C2%B2", "99999999999999999999999"):
            responses.append(api_client.get(f"/api/v1/mirror-runs/{number}"))
            responses.append(api_client.delete(f"/api/v1/mirror-runs/{number}"))
            responses.append(api_client.get(f"/ui/mirror-runs/{number}"))
            responses.append(api_client.get(f"/api/v1/entries?repository=pypi&limit={number}"))
    for response in responses:
        assert response.status_code in (400, 404), (response.request.url, response.text)
        assert "Internal Server Error" not in response.text


def test_a_killed_proxy_mirror_run_is_shown_interrupted_then_forgotten(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """`proxy mirror` killed (SIGKILL, a crash, the machine gone) leaves its run
    'running': it must be shown interrupted once its progress stops being written (the
    API, the console and `proxy jobs` judge it by ``state_of``), and be forgotten with
    the other old runs (it stayed 'running' for ever, and was never deleted)."""
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    upstream.fault("/simple/alpha/", hang=True)
    config = admin_config(tmp_path, upstream.base_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    mirror = subprocess.Popen(
        [sys.executable, "-m", "proxy", "mirror", "-c", str(config), "pkg:pypi/alpha"],
        env={**env, "PYTHONPATH": str(Path.cwd())},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    clock = ManualClock()
    proxy = start_proxy(load(config, {}), clock)
    try:
        with client(proxy.url) as api_client:
            [run] = wait_until(
                "the run to be recorded",
                lambda: api_client.get("/api/v1/jobs").json()["mirror_runs"],
            )
            assert run["state"] == "running" and run["origin"] == "cli"
            mirror.kill()
            mirror.wait(timeout=30)
            clock.advance(60)  # long past the run's last progress
            shown = api_client.get(f"/api/v1/mirror-runs/{run['id']}").json()
            assert shown["state"] == "interrupted", shown
            assert api_client.delete(f"/api/v1/mirror-runs/{run['id']}").status_code == 409
    finally:
        mirror.kill()
        mirror.wait(timeout=30)
        upstream.clear_faults()

    async def forget() -> tuple[list[str], list[int]]:
        catalog = open_catalog(load(config, {}).database_url, clock)
        try:
            states = [state_of(r) for r in await catalog.mirror_runs(10)]
            clock.advance(8 * 86400)
            await catalog.forget_fleet_history(7 * 86400)
            return states, [r.id for r in await catalog.mirror_runs(10)]
        finally:
            await catalog.close()

    states, left = asyncio.run(forget())
    assert states == ["interrupted"] and left == []


def test_an_entry_shows_the_release_policys_decision(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The console's slot for the policy decision (Engine.release_decision): in report
    mode the held file is served, so it is stored, and its entry says it would be held."""
    recent = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 86400))
    upstream.add_project("fresh", [ProjectFile("fresh-1.0.tar.gz", b"fresh", upload_time=recent)])
    policy = '[policy]\ncooldown = "3d"\nmode = "report"\n'
    url = start_proxy(load(admin_config(tmp_path, upstream.base_url, extra=policy), {})).url
    assert httpx.get(f"{url}/pypi/files/fresh/fresh-1.0.tar.gz").status_code == 200
    with client(url) as api_client:
        detail = api_client.get("/api/v1/entries/pypi/files/fresh/fresh-1.0.tar.gz").json()
        page = api_client.get("/api/v1/entries/pypi/simple/fresh/").json()
    policy_of = detail["policy"]
    assert policy_of["decision"].startswith("held back until ")
    assert (policy_of["action"], policy_of["rule"]) == ("hold", "cooldown")
    assert policy_of["package"] == "pkg:pypi/fresh" and policy_of["version"] == "1.0"
    assert policy_of["enforced"] is False and "(upload-time)" in policy_of["reason"]
    assert page["policy"] is None  # a page is no release of one version
