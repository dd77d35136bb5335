"""Mirrors: purls and SBOMs -> keys warmed through the cache (docs/architecture.md,
"Mirrors"). Pure parts first, then runs through the engine against fake upstreams."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.engine import Engine, open_engine
from proxy.exceptions import ConfigError
from proxy.formats import simple_index as si
from proxy.formats.maven_metadata import ArtifactVersions, parse_metadata, select_versions
from proxy.formats.pypi import select_files
from proxy.mirror.progress import MirrorProgress
from proxy.mirror.purls import parse_purl
from proxy.mirror.sbom import purls_in_sbom
from tests.conftest import write_config
from tests.upstream import FakeUpstream, ProjectFile

# -- pure ---------------------------------------------------------------------------------

CYCLONEDX = {
    "bomFormat": "CycloneDX",
    "specVersion": "1.5",
    "metadata": {"component": {"name": "app", "purl": "pkg:pypi/app@9.9"}},
    "components": [
        {"type": "library", "name": "requests", "purl": "pkg:pypi/requests@2.32.3"},
        {
            "type": "library",
            "name": "outer",
            "purl": "pkg:maven/org.example/outer@1.0",
            "components": [{"type": "library", "purl": "pkg:maven/org.example/inner@2.0"}],
        },
        {"type": "library", "name": "no purl"},
        {"type": "library", "purl": "pkg:pypi/requests@2.32.3"},
    ],
}
SPDX = {
    "spdxVersion": "SPDX-2.3",
    "packages": [
        {
            "name": "flask",
            "externalRefs": [
                {
                    "referenceCategory": "SECURITY",
                    "referenceType": "cpe23Type",
                    "referenceLocator": "x",
                },
                {
                    "referenceCategory": "PACKAGE-MANAGER",
                    "referenceType": "purl",
                    "referenceLocator": "pkg:pypi/flask@3.0.0",
                },
            ],
        },
        {"name": "no refs"},
    ],
}


def test_sbom_purls_cyclonedx_spdx2_and_spdx3() -> None:
    assert purls_in_sbom(json.dumps(CYCLONEDX).encode()) == [
        "pkg:pypi/requests@2.32.3",
        "pkg:maven/org.example/outer@1.0",
        "pkg:maven/org.example/inner@2.0",
    ]
    assert purls_in_sbom(json.dumps(SPDX).encode()) == ["pkg:pypi/flask@3.0.0"]
    spdx3 = {"@context": "https://spdx.org/rdf/3.0.1/spdx-context.jsonld", "@graph": [
        {"type": "software_Package", "software_packageUrl": "pkg:pypi/idna@3.7"},
        {"type": "Person", "name": "someone"},
    ]}  # fmt: skip
    assert purls_in_sbom(json.dumps(spdx3).encode()) == ["pkg:pypi/idna@3.7"]
    for bad, reason in ((b"{", "not JSON"), (b"[]", "top level"), (b"{}", "CycloneDX")):
        with pytest.raises(ValueError, match=reason):
            purls_in_sbom(bad)


def test_purls_are_parsed_and_normalized_by_packageurl() -> None:
    ref = parse_purl("pkg:maven/org.slf4j/slf4j-api@2.0.13?type=jar&classifier=sources")
    assert (ref.type, ref.namespace, ref.name, ref.version) == (
        "maven",
        "org.slf4j",
        "slf4j-api",
        "2.0.13",
    )
    assert ref.qualifier("classifier") == "sources" and ref.qualifier("nope") is None
    assert parse_purl("pkg:pypi/Django_Rest").name == "django-rest"
    with pytest.raises(ValueError, match="not a package URL"):
        parse_purl("requests==2.0")


def _link(filename: str, yanked: bool = False) -> si.FileLink:
    return si.FileLink(filename, f"https://upstream.example/{filename}", yanked=yanked)


def test_pypi_versions_latest_all_and_pinned() -> None:
    files = [
        _link("p-1.0.tar.gz"),
        _link("p-1.0-py3-none-any.whl"),
        _link("p-2.0.tar.gz"),
        _link("p-2.5.tar.gz", yanked=True),
        _link("p-3.0rc1.tar.gz"),
        _link("p-0.1.exe"),  # no version we can read: never chosen
    ]

    def names(chosen: list[si.FileLink]) -> list[str]:
        return [f.filename for f in chosen]

    assert names(select_files(files, None, "latest")) == ["p-2.0.tar.gz"]
    assert names(select_files(files, None, "all")) == [
        "p-1.0.tar.gz", "p-1.0-py3-none-any.whl", "p-2.0.tar.gz", "p-3.0rc1.tar.gz",
    ]  # fmt: skip
    assert names(select_files(files, "1.0", "latest")) == ["p-1.0.tar.gz", "p-1.0-py3-none-any.whl"]
    assert names(select_files(files, "2.5", "latest")) == ["p-2.5.tar.gz"]  # pinned: even yanked
    assert names(select_files(files[4:5], None, "latest")) == ["p-3.0rc1.tar.gz"]  # only a pre


def test_maven_metadata_versions() -> None:
    body = (
        b"<?xml version='1.0'?><metadata><versioning><latest>3.0-SNAPSHOT</latest>"
        b"<versions><version>1.0</version><version>2.0</version>"
        b"<version>3.0-SNAPSHOT</version></versions></versioning></metadata>"
    )
    found = parse_metadata(body, "m.xml")
    assert found == ArtifactVersions(None, "3.0-SNAPSHOT", ["1.0", "2.0", "3.0-SNAPSHOT"])
    assert select_versions(found, "latest") == ["2.0"]  # no <release>: last listed release
    assert select_versions(found, "all") == ["1.0", "2.0"]
    with_release = ArtifactVersions("1.0", None, ["1.0", "2.0"])
    assert select_versions(with_release, "latest") == ["1.0"]


def test_mirror_settings_errors_name_the_key(tmp_path: Path) -> None:
    body = """
    [[repositories]]
    name = "pypi"
    format = "pypi"
    [[mirrors]]
    name = "m"
    interval = "soon"
    packages = ["pkg:pypi/ok@1", "nonsense", "pkg:npm/left-pad@1", 3]
    versions = "newest"
    repository = "nowhere"
    colour = "blue"
    [[mirrors]]
    name = "empty"
    """
    with pytest.raises(ConfigError) as info:
        load(write_config(tmp_path, body), {})
    joined = "\n".join(info.value.errors)
    for expected in (
        "mirrors.m.interval:",
        "mirrors.m.packages[1]: 'nonsense' is not a package URL",
        "mirrors.m.packages[3]:",
        "mirrors.m.versions: 'newest' is not one of latest, all",
        "mirrors.m.repository: 'nowhere' is not a repository that can mirror packages",
        "mirrors.m.colour: unknown key",
        "mirrors.empty: needs packages",
    ):
        assert expected in joined, f"{expected} missing from:\n{joined}"
    body = body.replace('repository = "nowhere"', "").replace("nonsense", "pkg:pypi/x")
    body = body.replace('interval = "soon"', "").replace(", 3]", "]").replace("newest", "all")
    body = body.replace('colour = "blue"', "").replace(
        'name = "empty"', 'name = "e"\nsbom = "s.json"'
    )
    with pytest.raises(ConfigError) as info:
        load(write_config(tmp_path, body), {})
    assert info.value.errors == [
        "mirrors.m.packages[2]: 'pkg:npm/left-pad@1': no repository here mirrors purl type 'npm'"
    ]


# -- runs through the engine -----------------------------------------------------------------


@asynccontextmanager
async def mirror_engine(
    tmp_path: Path, upstream: FakeUpstream, extra: str = ""
) -> AsyncIterator[Engine]:
    body = f"""
    [storage]
    path = "{tmp_path / "data"}"
    [upstream]
    retries = 0
    [[repositories]]
    name = "pypi"
    format = "pypi"
    upstream = "{upstream.base_url}/simple/"
    [[repositories]]
    name = "maven"
    format = "maven"
    upstream = "{upstream.base_url}/m2/"
    {extra}
    """
    settings = load(write_config(tmp_path, body), {})
    async with open_engine(settings, ManualClock()) as engine:
        yield engine


def add_pypi_project(upstream: FakeUpstream) -> list[ProjectFile]:
    files = [
        ProjectFile("demo-1.0.tar.gz", b"demo 1.0 sdist"),
        ProjectFile("demo-1.0-py3-none-any.whl", b"demo 1.0 wheel", metadata=b"Name: demo\n"),
        ProjectFile("demo-2.0.tar.gz", b"demo 2.0 sdist"),
        ProjectFile("demo-2.1.tar.gz", b"demo 2.1 sdist", yanked="broken"),
    ]
    upstream.add_project("demo", files)
    return files


def add_maven_artifact(upstream: FakeUpstream) -> None:
    base = "/m2/org/example/lib"
    for version in ("1.0", "2.0"):
        for name in (f"lib-{version}.pom", f"lib-{version}.jar", f"lib-{version}-sources.jar"):
            body = f"{name} body".encode()
            upstream.files[f"{base}/{version}/{name}"] = body
            upstream.files[f"{base}/{version}/{name}.sha1"] = (
                hashlib.sha1(body).hexdigest().encode()
            )
    upstream.files[f"{base}/maven-metadata.xml"] = (
        b"<metadata><groupId>org.example</groupId><artifactId>lib</artifactId><versioning>"
        b"<release>2.0</release><versions><version>1.0</version><version>2.0</version>"
        b"</versions></versioning></metadata>"
    )


@pytest.mark.anyio
async def test_pypi_mirror_warms_the_files_of_a_version_once(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    add_pypi_project(upstream)
    async with mirror_engine(tmp_path, upstream) as engine:
        summary = await engine.mirrors.run("t", ["pkg:pypi/demo@1.0"], None, "latest", None)
        # The sdist, the wheel and the wheel's PEP 658 metadata file.
        assert (summary.fetched, summary.cached, summary.failed) == (3, 0, 0)
        assert summary.bytes == len(b"demo 1.0 sdist") + len(b"demo 1.0 wheel") + len(
            b"Name: demo\n"
        )
        again = await engine.mirrors.run("t", ["pkg:pypi/demo@1.0"], None, "latest", None)
        assert (again.fetched, again.cached) == (0, 3)
        for name in ("demo-1.0.tar.gz", "demo-1.0-py3-none-any.whl"):
            assert upstream.count(f"/packages/{name}") == 1
        latest = await engine.mirrors.run("t", ["pkg:pypi/demo"], None, "latest", None)
        assert latest.fetched == 1 and upstream.count("/packages/demo-2.0.tar.gz") == 1
        assert upstream.count("/packages/demo-2.1.tar.gz") == 0  # yanked: not the latest
        every = await engine.mirrors.run("t", ["pkg:pypi/demo"], None, "all", None)
        assert (every.fetched, every.cached) == (0, 4)


@pytest.mark.anyio
async def test_failures_and_unknown_types_are_counted_and_the_run_goes_on(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    add_pypi_project(upstream)
    upstream.add_project("broken", [ProjectFile("broken-1.0.tar.gz", b"x")])
    upstream.fault("/packages/broken-1.0.tar.gz", status=500)
    async with mirror_engine(tmp_path, upstream) as engine:
        summary = await engine.mirrors.run(
            "t",
            [
                "pkg:pypi/broken@1.0",  # upstream error: failed
                "pkg:pypi/absent",  # no such project: missing
                "pkg:pypi/demo@7.0",  # no such version: missing
                "pkg:npm/left-pad@1.3.0",  # no repository for npm: skipped
                "pkg:maven/nogroup@1.0",  # a Maven purl without groupId: failed
                "pkg:pypi/demo@1.0",
            ],
            None,
            "latest",
            None,
        )
    assert (summary.fetched, summary.missing, summary.failed, summary.skipped) == (3, 2, 2, 1)


@pytest.mark.anyio
async def test_a_repository_without_upstream_fails_its_mirror_naming_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    body = f"""
    [storage]
    path = "{tmp_path / "data"}"
    [[repositories]]
    name = "pypi"
    format = "pypi"
    [[repositories]]
    name = "maven"
    format = "maven"
    """
    settings = load(write_config(tmp_path, body), {})
    async with open_engine(settings, ManualClock()) as engine:
        summary = await engine.mirrors.run(
            "t", ["pkg:pypi/demo@1.0", "pkg:maven/org.example/lib@1.0"], None, "latest", None
        )
    assert (summary.fetched, summary.missing, summary.failed) == (0, 0, 2)
    assert "set repositories.pypi.upstream" in caplog.text
    assert "set repositories.maven.upstream" in caplog.text


@pytest.mark.anyio
async def test_maven_mirror_pom_jar_classifier_and_latest_from_metadata(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    add_maven_artifact(upstream)
    async with mirror_engine(tmp_path, upstream) as engine:
        pinned = await engine.mirrors.run(
            "t", ["pkg:maven/org.example/lib@1.0?classifier=sources"], None, "latest", None
        )
        assert (pinned.fetched, pinned.failed) == (2, 0)
        assert upstream.count("/m2/org/example/lib/1.0/lib-1.0-sources.jar") == 1
        assert upstream.count("/m2/org/example/lib/1.0/lib-1.0.jar") == 0
        latest = await engine.mirrors.run("t", ["pkg:maven/org.example/lib"], None, "latest", None)
        assert latest.fetched == 2
        assert upstream.count("/m2/org/example/lib/2.0/lib-2.0.jar") == 1
        every = await engine.mirrors.run("t", ["pkg:maven/org.example/lib"], None, "all", None)
        assert (every.fetched, every.cached) == (1, 3)  # 1.0's plain jar was not there yet
        served = engine.adapters["maven"]
        assert served is not None


@pytest.mark.anyio
async def test_an_sbom_drives_a_mirror(tmp_path: Path, upstream: FakeUpstream) -> None:
    add_pypi_project(upstream)
    add_maven_artifact(upstream)
    sbom = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.6",
        "components": [
            {"purl": "pkg:pypi/demo@2.0"},
            {"purl": "pkg:maven/org.example/lib@2.0"},
            {"purl": "pkg:golang/example.com/mod@v1.0.0"},
        ],
    }
    (tmp_path / "sbom.cdx.json").write_text(json.dumps(sbom))
    extra = '[[mirrors]]\nname = "from-sbom"\nsbom = "sbom.cdx.json"'
    async with mirror_engine(tmp_path, upstream, extra) as engine:
        [mirror] = engine.settings.mirrors
        assert mirror.sbom == tmp_path / "sbom.cdx.json"  # beside the config file
        job = next(j for j in engine.jobs() if j.name == "mirror:from-sbom")
        line = await job.run()
        assert line.startswith("3 fetched") and "1 skipped" in line
        assert upstream.count("/packages/demo-2.0.tar.gz") == 1
        assert upstream.count("/m2/org/example/lib/2.0/lib-2.0.jar") == 1
        (tmp_path / "sbom.cdx.json").write_text("{not json")
        assert "1 failed" in await job.run()  # a broken SBOM is one failed item


def test_hostile_sboms_are_clean_errors() -> None:
    deep_list = b"[" * 100_000 + b"]" * 100_000
    deep_bom = b'{"bomFormat": "CycloneDX", "components": ' + b'[{"components": ' * 50_000
    deep_bom += b"[]" + b"}]" * 50_000 + b"}"
    for hostile in (deep_list, deep_bom):
        with pytest.raises(ValueError, match="nested too deeply"):
            purls_in_sbom(hostile)


@pytest.mark.parametrize("tty", [True, False])
def test_progress_escapes_labels_a_terminal_should_not_get(
    tty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A purl from an SBOM is anything: a lone surrogate cannot be written to a UTF-8
    # stream at all, and escape sequences would rewrite the operator's terminal.
    monkeypatch.setenv("COLUMNS", "200")  # the bar fits the terminal: wide enough here
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    progress = MirrorProgress(out, tty)
    progress.planned(2)
    progress.done("pkg:pypi/\ud800", "failed", 0)
    progress.done("pkg:pypi/\x1b[2Jwiped", "failed", 0)
    progress.finish()
    text = raw.getvalue().decode("utf-8")
    assert "\\ud800" in text and "\\x1b[2Jwiped" in text and "\x1b" not in text


@pytest.mark.anyio
async def test_a_hostile_sbom_fails_alone_and_the_packages_still_run(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    add_pypi_project(upstream)
    (tmp_path / "sbom.cdx.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    extra = """
    [[mirrors]]
    name = "nightly"
    sbom = "sbom.cdx.json"
    packages = ["pkg:pypi/demo@2.0"]
    """
    async with mirror_engine(tmp_path, upstream, extra) as engine:
        job = next(j for j in engine.jobs() if j.name == "mirror:nightly")
        line = await job.run()
        assert line.startswith("1 fetched") and "1 failed" in line
        assert upstream.count("/packages/demo-2.0.tar.gz") == 1
