"""Real pip, uv and mvn through the release policy (issue 17's acceptance): the same
upstream served with and without a 3-day cooldown gives each client the newest version
it allows; a held version pinned or named by URL fails with the proxy's 403; report mode
serves everything and counts; ``uv --exclude-newer`` works through an upstream that
states no upload-time. Publish times are set relative to now: nothing sleeps."""

from __future__ import annotations

import email.utils
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from proxy.config.load import load
from proxy.runtime import metrics
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.test_jvm_clients import java_project
from tests.upstream import (
    FakeUpstream,
    ProjectFile,
    ServerThread,
    make_wheel,
    start_upstream,
    zip_bytes,
)

pytestmark = pytest.mark.slow

AGES_DAYS = {"1.0": 30, "2.0": 10, "3.0": 1}  # 3.0 is within a 3-day cooldown
COOLDOWN = '[policy]\ncooldown = "3d"\n'


def published(days: float) -> datetime:
    return datetime.now(UTC) - timedelta(days=days)


@pytest.fixture
def released(upstream: FakeUpstream) -> FakeUpstream:
    for version, age in AGES_DAYS.items():
        filename, body, metadata = make_wheel("demo", version, [])
        upload_time = published(age).strftime("%Y-%m-%dT%H:%M:%SZ")
        upstream.projects.setdefault("demo", []).append(
            ProjectFile(filename, body, metadata=metadata, upload_time=upload_time)
        )
    return upstream


def pypi_proxy(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory, name: str, policy: str
) -> str:
    """A proxy of its own (storage, catalog) on ``upstream``; its index URL."""
    body = pypi_config(tmp_path / name, upstream.base_url, extra=policy)
    server = start_proxy(load(write_config(tmp_path, body, f"{name}.toml"), {}))
    return f"{server.url}/pypi/simple/"


def pip_install(
    index: str, target: Path, env: dict[str, str], *wanted: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--isolated", "--no-cache-dir",
            "--disable-pip-version-check", "--index-url", index, "--target", str(target), *wanted,
        ],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def uv_install(
    index: str, target: Path, env: dict[str, str], *wanted: str
) -> subprocess.CompletedProcess[str]:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    assert uv is not None, "uv is a test dependency (pip install -e '.[dev]')"
    return subprocess.run(
        [
            uv, "pip", "install", "--no-config", "--no-cache", "--python", sys.executable,
            "--index-url", index, "--target", str(target), *wanted,
        ],
        capture_output=True, text=True, timeout=300, env={**env, "UV_NO_CONFIG": "1"},
    )  # fmt: skip


def installed(target: Path) -> set[str]:
    return {p.name for p in target.iterdir() if p.name.endswith(".dist-info")}


def test_pip_and_uv_get_the_newest_allowed_version(
    tmp_path: Path,
    released: FakeUpstream,
    start_proxy: ProxyFactory,
    clean_env: dict[str, str],
) -> None:
    plain = pypi_proxy(tmp_path, released, start_proxy, "plain", "")
    held = pypi_proxy(tmp_path, released, start_proxy, "held", COOLDOWN)
    for install in (pip_install, uv_install):
        for index, expected in ((plain, "demo-3.0.dist-info"), (held, "demo-2.0.dist-info")):
            target = tmp_path / f"{install.__name__}-{len(index)}-{expected}"
            result = install(index, target, clean_env, "demo")
            assert result.returncode == 0, result.stdout + result.stderr
            assert installed(target) == {expected}, (install.__name__, index)


def test_a_held_version_pinned_or_by_url_fails(
    tmp_path: Path,
    released: FakeUpstream,
    start_proxy: ProxyFactory,
    clean_env: dict[str, str],
) -> None:
    index = pypi_proxy(tmp_path, released, start_proxy, "held", COOLDOWN)
    pinned = pip_install(index, tmp_path / "pinned", clean_env, "demo==3.0")
    assert pinned.returncode != 0
    # Not offered at all: pip sees only the allowed versions.
    assert "(from versions: 1.0, 2.0)" in pinned.stderr, pinned.stderr
    assert "No matching distribution found for demo==3.0" in pinned.stderr
    # A lock file naming the file's URL: refused, the 403 in pip's output.
    url = index.removesuffix("simple/") + "files/demo/demo-3.0-py3-none-any.whl"
    by_url = pip_install(index, tmp_path / "by-url", clean_env, url)
    assert by_url.returncode != 0
    assert "403" in by_url.stdout + by_url.stderr, by_url.stdout + by_url.stderr
    assert released.count("/packages/demo-3.0-py3-none-any.whl") == 0
    # What the 403 says, for whoever reads it (a lock tool, a person with curl).
    refused = httpx.get(url)
    assert refused.status_code == 403
    assert "pkg:pypi/demo@3.0 is held back until" in refused.text
    assert "policy.cooldown" in refused.text


def test_report_mode_serves_everything_and_counts(
    tmp_path: Path,
    released: FakeUpstream,
    start_proxy: ProxyFactory,
    clean_env: dict[str, str],
) -> None:
    index = pypi_proxy(tmp_path, released, start_proxy, "report", COOLDOWN + 'mode = "report"\n')
    counted = metrics.POLICY_DECISIONS.labels("pypi", "hold", "cooldown")
    before = counted._value.get()
    result = pip_install(index, tmp_path / "report", clean_env, "demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert installed(tmp_path / "report") == {"demo-3.0.dist-info"}
    # The page counted 3.0 as held, and so did the file (and its metadata) it served.
    assert counted._value.get() >= before + 2


def test_uv_exclude_newer_through_an_upstream_without_upload_times(
    tmp_path: Path,
    upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    clean_env: dict[str, str],
) -> None:
    for version in ("1.0", "2.0"):
        filename, body, metadata = make_wheel("plain", version, [])
        upstream.projects.setdefault("plain", []).append(
            ProjectFile(filename, body, metadata=metadata)
        )
    index = pypi_proxy(tmp_path, upstream, start_proxy, "plain", "")
    # The proxy's pages carry every file's first sight as its upload-time.
    page = httpx.get(index + "plain/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    assert all("upload-time" in f for f in page.json()["files"])
    later = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    result = uv_install(index, tmp_path / "newer", clean_env, "--exclude-newer", later, "plain")
    assert result.returncode == 0, result.stdout + result.stderr
    assert installed(tmp_path / "newer") == {"plain-2.0.dist-info"}
    earlier = "2020-01-01T00:00:00Z"  # before the proxy first saw either file
    result = uv_install(index, tmp_path / "older", clean_env, "--exclude-newer", earlier, "plain")
    assert result.returncode != 0
    assert "plain" in result.stderr


# -- mvn ----------------------------------------------------------------------------------

LIB = "/org/example/lib"
METADATA = """<?xml version="1.0" encoding="UTF-8"?>
<metadata>
  <groupId>org.example</groupId>
  <artifactId>lib</artifactId>
  <versioning>
    <latest>3.0</latest>
    <release>3.0</release>
    <versions><version>1.0</version><version>2.0</version><version>3.0</version></versions>
    <lastUpdated>{last_updated}</lastUpdated>
  </versioning>
</metadata>
"""
LIB_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>org.example</groupId><artifactId>lib</artifactId><version>{version}</version>
</project>
"""
APP_POM = """
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>demo</groupId>
  <artifactId>demo</artifactId>
  <version>1.0</version>
  <properties>
    <maven.compiler.source>11</maven.compiler.source>
    <maven.compiler.target>11</maven.compiler.target>
    <project.build.sourceEncoding>UTF-8</project.build.sourceEncoding>
  </properties>
  <dependencies>
    <dependency>
      <groupId>org.example</groupId><artifactId>lib</artifactId><version>{wanted}</version>
    </dependency>
    <dependency>
      <groupId>junit</groupId><artifactId>junit</artifactId><version>4.13.2</version><scope>test</scope>
    </dependency>
  </dependencies>
</project>
"""


@pytest.fixture
def maven_upstream(debian_maven_repo: Path) -> Iterator[ServerThread]:
    """Debian's Maven repository (plugins, junit) and org.example:lib 1.0, 2.0 and 3.0,
    each pom's Last-Modified its publish time. Debian's files (the build's plugins) were
    published long ago, as a real repository's Last-Modified would say: without any,
    ``first-seen`` would hold them back too."""
    fake = FakeUpstream(
        directory=debian_maven_repo, directory_last_modified="Mon, 01 Jan 2024 00:00:00 GMT"
    )
    # Updated when 3.0 was deployed (an older lastUpdated would vouch for every version).
    last_updated = published(min(AGES_DAYS.values())).strftime("%Y%m%d%H%M%S")
    fake.files[f"{LIB}/maven-metadata.xml"] = METADATA.format(last_updated=last_updated).encode()
    fake.content_types[f"{LIB}/maven-metadata.xml"] = "application/xml"
    for version, age in AGES_DAYS.items():
        base = f"{LIB}/{version}/lib-{version}"
        fake.files[base + ".pom"] = LIB_POM.format(version=version).encode()
        fake.files[base + ".jar"] = zip_bytes(version.encode(), "lib.txt")
        stamp = published(age).timestamp()
        fake.last_modified[base + ".pom"] = email.utils.formatdate(stamp, usegmt=True)
    server = start_upstream(fake)
    yield server
    fake.released.set()
    server.stop()


def mvn_package(tmp_path: Path, proxy: ServerThread, name: str, wanted: str) -> tuple[str, Path]:
    """``mvn package`` of a project that depends on org.example:lib ``wanted``: (its
    output, its local repository)."""
    project = java_project(tmp_path / name)
    (project / "pom.xml").write_text(APP_POM.format(wanted=wanted))
    settings = tmp_path / f"{name}-settings.xml"
    settings.write_text(
        textwrap.dedent(f"""
        <settings><mirrors><mirror>
          <id>proxy</id><mirrorOf>*</mirrorOf><url>{proxy.url}/maven/</url>
        </mirror></mirrors></settings>
    """)
    )
    local = tmp_path / f"{name}-m2"
    result = subprocess.run(
        ["mvn", "-B", "-s", str(settings), f"-Dmaven.repo.local={local}", "package"],
        cwd=project, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return result.stdout + result.stderr if result.returncode else "", local


def maven_proxy(
    tmp_path: Path, upstream: ServerThread, start_proxy: ProxyFactory, name: str, policy: str
) -> ServerThread:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / name}"
        {policy}
        [[repositories]]
        name = "maven"
        format = "maven"
        upstream = "{upstream.url}/"
        """,
        f"{name}.toml",
    )
    return start_proxy(load(config, {}))


def test_mvn_resolves_a_range_to_the_newest_allowed_version_and_a_pinned_held_one_fails(
    tmp_path: Path, maven_upstream: ServerThread, start_proxy: ProxyFactory
) -> None:
    plain = maven_proxy(tmp_path, maven_upstream, start_proxy, "plain", "")
    held = maven_proxy(tmp_path, maven_upstream, start_proxy, "held", COOLDOWN)
    for proxy, expected in ((plain, "3.0"), (held, "2.0")):
        name = f"range-{expected}"
        failed, local = mvn_package(tmp_path, proxy, name, "[1.0,)")
        assert not failed, failed[-4000:]
        jars = sorted(p.name for p in (local / "org/example/lib").glob("*/*.jar"))
        assert jars == [f"lib-{expected}.jar"], (name, jars)
    failed, _local = mvn_package(tmp_path, held, "pinned", "3.0")
    assert "org.example:lib" in failed and "403" in failed, failed[-4000:]
    # The reason mvn 3 does not print (Maven Resolver 2 reads the problem document).
    problem = httpx.get(
        f"{held.url}/maven{LIB}/3.0/lib-3.0.jar", headers={"Accept": "application/problem+json"}
    )
    assert problem.status_code == 403
    assert problem.json()["rule"] == "cooldown" and problem.json()["available_at"]
