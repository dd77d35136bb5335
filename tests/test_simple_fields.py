"""Every field of the Simple Repository API kept through the proxy's page model, in both
representations (proxy/formats/simple_model.py): a third-party client, pypi-simple,
reads the same values from the proxy as from the upstream. PEP 592 yanked and its
reason, 658/714 metadata under both names, 700 versions/size/upload-time, 708 tracks
and alternate locations, 740 provenance (an absolute URL on the proxy, serving the
upstream's file), 792 project status and its reason."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from pypi_simple import (
    ACCEPT_HTML_ONLY,
    ACCEPT_JSON_ONLY,
    DistributionPackage,
    ProjectPage,
    PyPISimple,
)

from proxy.config.load import load
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.upstream import FakeUpstream, ServerThread

WHEEL = b"PK a wheel of full 1.0"
SDIST = b"an sdist of full 2.0"
METADATA = b"Metadata-Version: 2.1\nName: full\nVersion: 1.0\n"
PROVENANCE = {"version": 1, "attestation_bundles": [{"publisher": {"kind": "test"}}]}
TRACKS = ["https://other.example/simple/full/"]
ALTERNATES = ["https://mirror.example/simple/full/", "https://third.example/simple/full/"]


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def json_page(base: str) -> bytes:
    return json.dumps(
        {
            "meta": {"api-version": "1.4", "tracks": TRACKS},
            "name": "full",
            "alternate-locations": ALTERNATES,
            "project-status": {"status": "deprecated", "reason": "use another project"},
            "versions": ["1.0", "2.0"],
            "files": [
                {
                    "filename": "full-1.0-py3-none-any.whl",
                    "url": f"{base}/packages/full-1.0-py3-none-any.whl",
                    "hashes": {"sha256": sha(WHEEL)},
                    "requires-python": ">=3.8",
                    "core-metadata": {"sha256": sha(METADATA)},
                    "dist-info-metadata": {"sha256": sha(METADATA)},
                    "gpg-sig": False,
                    "size": len(WHEEL),
                    "upload-time": "2024-01-02T03:04:05.678901Z",
                    "provenance": f"{base}/packages/full-1.0-py3-none-any.whl.provenance",
                },
                {
                    "filename": "full-2.0.tar.gz",
                    "url": f"{base}/packages/full-2.0.tar.gz",
                    "hashes": {"sha256": sha(SDIST)},
                    "yanked": "broken build",
                    "size": len(SDIST),
                    "upload-time": "2024-02-03T04:05:06.000000Z",
                },
            ],
        }
    ).encode()


def html_page(base: str) -> bytes:
    wheel = f"{base}/packages/full-1.0-py3-none-any.whl"
    return f"""<!DOCTYPE html><html><head>
<meta name="pypi:repository-version" content="1.4">
<meta name="pypi:tracks" content="{TRACKS[0]}">
<meta name="pypi:alternate-locations" content="{ALTERNATES[0]}">
<meta name="pypi:alternate-locations" content="{ALTERNATES[1]}">
<meta name="pypi:project-status" content="deprecated">
<meta name="pypi:project-status-reason" content="use another project">
</head><body>
<a href="{wheel}#sha256={sha(WHEEL)}" data-requires-python="&gt;=3.8"
   data-core-metadata="sha256={sha(METADATA)}" data-dist-info-metadata="sha256={sha(METADATA)}"
   data-gpg-sig="false" data-provenance="{wheel}.provenance">full-1.0-py3-none-any.whl</a>
<a href="{base}/packages/full-2.0.tar.gz#sha256={sha(SDIST)}" data-yanked="broken build">full-2.0.tar.gz</a>
</body></html>""".encode()


@pytest.fixture
def full_upstream(upstream: FakeUpstream) -> FakeUpstream:
    base = upstream.base_url
    upstream.files["/simple/full/"] = json_page(base)
    upstream.content_types["/simple/full/"] = "application/vnd.pypi.simple.v1+json"
    upstream.files["/simple/fullhtml/"] = html_page(base)
    upstream.content_types["/simple/fullhtml/"] = "text/html"
    upstream.files["/packages/full-1.0-py3-none-any.whl"] = WHEEL
    upstream.files["/packages/full-1.0-py3-none-any.whl.metadata"] = METADATA
    upstream.files["/packages/full-1.0-py3-none-any.whl.provenance"] = json.dumps(
        PROVENANCE
    ).encode()
    upstream.files["/packages/full-2.0.tar.gz"] = SDIST
    return upstream


@pytest.fixture
def proxy(tmp_path: Path, full_upstream: FakeUpstream, start_proxy: ProxyFactory) -> ServerThread:
    config = write_config(tmp_path, pypi_config(tmp_path / "data", full_upstream.base_url))
    return start_proxy(load(config, {}))


def project_fields(page: ProjectPage) -> dict[str, object]:
    return {
        "tracks": page.tracks,
        "alternate_locations": page.alternate_locations,
        "status": page.status,
        "status_reason": page.status_reason,
    }


def package_fields(package: DistributionPackage, json_only: bool) -> dict[str, object]:
    fields: dict[str, object] = {
        "filename": package.filename,
        "version": package.version,
        "package_type": package.package_type,
        "digests": package.digests,
        "requires_python": package.requires_python,
        "has_sig": package.has_sig,
        "is_yanked": package.is_yanked,
        "yanked_reason": package.yanked_reason,
        "has_metadata": package.has_metadata,
        "metadata_digests": package.metadata_digests,
        "has_provenance": package.provenance_url is not None,
    }
    if json_only:  # PEP 700's fields are in the JSON form only
        fields["size"] = package.size
        fields["upload_time"] = package.upload_time
    return fields


def test_pypi_simple_reads_the_same_fields_from_the_proxy_as_from_a_json_upstream(
    proxy: ServerThread, full_upstream: FakeUpstream
) -> None:
    with (
        PyPISimple(f"{full_upstream.base_url}/simple/") as up,
        PyPISimple(f"{proxy.url}/pypi/simple/") as ours,
    ):
        upstream_page = up.get_project_page("full", accept=ACCEPT_JSON_ONLY)
        as_json = ours.get_project_page("full", accept=ACCEPT_JSON_ONLY)
        as_html = ours.get_project_page("full", accept=ACCEPT_HTML_ONLY)
        assert project_fields(as_json) == project_fields(upstream_page)
        assert project_fields(as_html) == project_fields(upstream_page)
        assert project_fields(upstream_page)["status"] is not None  # the test tests something
        assert as_json.versions == upstream_page.versions == ["1.0", "2.0"]
        assert as_json.repository_version == "1.4"
        for served, json_only in ((as_json, True), (as_html, False)):
            assert [package_fields(p, json_only) for p in served.packages] == [
                package_fields(p, json_only) for p in upstream_page.packages
            ]
            wheel = served.packages[0]
            # PEP 740: an absolute URL on the proxy, which serves the upstream's file.
            assert wheel.provenance_url == (
                f"{proxy.url}/pypi/files/full/full-1.0-py3-none-any.whl.provenance"
            )
            assert ours.get_provenance(wheel) == up.get_provenance(upstream_page.packages[0])
            assert ours.get_package_metadata_bytes(wheel) == METADATA
            assert served.packages[1].provenance_url is None
        # Both representations came from one upstream request.
        assert full_upstream.count("/simple/full/") == 2  # ours, and the client's own


def test_pypi_simple_reads_the_same_fields_from_the_proxy_as_from_an_html_upstream(
    proxy: ServerThread, full_upstream: FakeUpstream
) -> None:
    with (
        PyPISimple(f"{full_upstream.base_url}/simple/") as up,
        PyPISimple(f"{proxy.url}/pypi/simple/") as ours,
    ):
        upstream_page = up.get_project_page("fullhtml", accept=ACCEPT_HTML_ONLY)
        assert upstream_page.tracks == TRACKS and upstream_page.alternate_locations == ALTERNATES
        for accept in (ACCEPT_HTML_ONLY, ACCEPT_JSON_ONLY):
            served = ours.get_project_page("fullhtml", accept=accept)
            assert project_fields(served) == project_fields(upstream_page)
            assert [package_fields(p, False) for p in served.packages] == [
                package_fields(p, False) for p in upstream_page.packages
            ]
            assert ours.get_provenance(served.packages[0]) == PROVENANCE
        # An HTML page states no versions; the proxy's JSON page lists its files'.
        assert ours.get_project_page("fullhtml", accept=ACCEPT_JSON_ONLY).versions == [
            "1.0",
            "2.0",
        ]
