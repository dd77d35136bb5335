"""Redirects to the bucket (``[storage.s3] redirect_min_size``; proxy/cache/__init__.py,
proxy/storage/objects.py): a hit on a blob at least that large is a 307 to a short-lived
presigned URL, which nobody may keep; real pip, uv, mvn and Gradle follow it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from proxy.config.load import load
from tests.conftest import ProxyFactory, s3_storage, write_config
from tests.seaweed import SeaweedFS
from tests.test_clients import _installed, packages  # noqa: F401  (the fixture)
from tests.test_jvm_clients import POM, java_project, repo_upstream, run  # noqa: F401
from tests.upstream import FakeUpstream, ServerThread

pytestmark = pytest.mark.slow

REDIRECT = 'redirect_min_size = "100B"'


def redirects() -> float:
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name == "proxy_http_requests":
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels.get("status") == "307":
                    total += sample.value
    return total


def storage_keys(tmp_path: Path, seaweedfs: SeaweedFS, bucket: str) -> str:
    return f'path = "{tmp_path / "data"}"\n' + s3_storage(
        seaweedfs, bucket, tmp_path / "local", REDIRECT
    )


def test_a_hit_on_a_large_blob_is_a_short_lived_redirect_to_the_bucket(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    upstream.files["/releases/big.bin"] = big = b"b" * 5000
    upstream.files["/releases/small.bin"] = small = b"s" * 50
    config = write_config(
        tmp_path,
        f"""
        [storage]
        {storage_keys(tmp_path, seaweedfs, s3_bucket)}
        [[repositories]]
        name = "tools"
        format = "raw"
        upstream = "{upstream.base_url}/releases/"
        """,
    )
    proxy = start_proxy(load(config, {}))
    # The miss: stored whole (one chunk), then answered like a hit.
    miss = httpx.get(proxy.url + "/tools/big.bin", follow_redirects=True)
    assert miss.content == big
    hit = httpx.get(proxy.url + "/tools/big.bin")
    assert hit.status_code == 307 and hit.headers["cache-control"] == "no-store"
    location = hit.headers["location"]
    assert location.startswith(seaweedfs.endpoint) and "X-Amz-Expires=300" in location
    assert httpx.get(location).content == big  # the bucket serves it, signed
    assert httpx.get(proxy.url + "/tools/big.bin", follow_redirects=True).content == big
    head = httpx.head(proxy.url + "/tools/big.bin")  # HEAD is answered here
    assert head.status_code == 200 and head.headers["content-length"] == "5000"
    assert httpx.get(proxy.url + "/tools/small.bin").content == small
    assert httpx.get(proxy.url + "/tools/small.bin").status_code == 200  # under the size


def test_a_conditional_get_on_a_large_blob_is_answered_here_by_the_entrys_validators(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    """A revalidation with the ETag or date the proxy gave was redirected to the bucket,
    whose validators are not ours: a 200 with the whole file instead of a 304, and an
    If-Range resume restarted from the first byte."""
    upstream.files["/releases/big.bin"] = big = bytes(range(256)) * 40
    config = write_config(
        tmp_path,
        f"""
        [storage]
        {storage_keys(tmp_path, seaweedfs, s3_bucket)}
        [[repositories]]
        name = "tools"
        format = "raw"
        upstream = "{upstream.base_url}/releases/"
        """,
    )
    proxy = start_proxy(load(config, {}))
    url = proxy.url + "/tools/big.bin"
    assert httpx.get(url, follow_redirects=True).content == big
    head = httpx.head(url)
    etag, modified = head.headers["etag"], head.headers["last-modified"]
    for condition in ({"if-none-match": etag}, {"if-modified-since": modified}):
        answer = httpx.get(url, headers=condition)
        assert answer.status_code == 304 and answer.content == b"", (condition, answer)
    resumed = httpx.get(url, headers={"range": "bytes=100-", "if-range": etag})
    assert resumed.status_code == 206 and resumed.content == big[100:]
    changed = httpx.get(url, headers={"if-none-match": '"another"'}, follow_redirects=True)
    assert changed.status_code == 200 and changed.content == big
    assert httpx.get(url).status_code == 307  # a plain GET still goes to the bucket


@pytest.fixture
def redirecting_pypi(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> ServerThread:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        {storage_keys(tmp_path, seaweedfs, s3_bucket)}
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "{upstream.base_url}/simple/"
        """,
    )
    return start_proxy(load(config, {}))


@pytest.mark.parametrize("client", ["pip", "uv"])
def test_pip_and_uv_follow_the_redirect(
    redirecting_pypi: ServerThread,
    upstream: FakeUpstream,
    packages: dict[str, bytes],  # noqa: F811
    tmp_path: Path,
    clean_env: dict[str, str],
    client: str,
) -> None:
    index = f"{redirecting_pypi.url}/pypi/simple/"
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    assert uv is not None
    before = 0.0
    for attempt in ("cold", "warm"):
        target = tmp_path / attempt
        if client == "pip":
            argv = [
                sys.executable, "-m", "pip", "install", "--isolated", "--no-cache-dir",
                "--disable-pip-version-check", "--index-url", index, "--target", str(target),
                "alpha",
            ]  # fmt: skip
        else:
            argv = [
                uv, "pip", "install", "--no-config", "--no-cache", "--python", sys.executable,
                "--index-url", index, "--target", str(target), "alpha",
            ]  # fmt: skip
        before = redirects()
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=300,
            env={**clean_env, "UV_NO_CONFIG": "1"},
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert _installed(target) == {"alpha-1.0.dist-info", "beta-2.0.dist-info"}
    assert redirects() - before >= 2, "the warm install's wheels came from the bucket"
    assert upstream.count("/packages/alpha-1.0-py3-none-any.whl") == 1


@pytest.fixture
def redirecting_jvm_proxy(
    tmp_path: Path,
    repo_upstream: tuple[FakeUpstream, ServerThread],  # noqa: F811
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> ServerThread:
    _fake, server = repo_upstream
    config = write_config(
        tmp_path,
        f"""
        [storage]
        {storage_keys(tmp_path, seaweedfs, s3_bucket)}
        [[repositories]]
        name = "maven"
        format = "maven"
        upstream = "{server.url}/"
        """,
    )
    return start_proxy(load(config, {}))


def test_mvn_and_gradle_follow_the_redirect(
    tmp_path: Path,
    redirecting_jvm_proxy: ServerThread,
    repo_upstream: tuple[FakeUpstream, ServerThread],  # noqa: F811
) -> None:
    if shutil.which("gradle") is None:
        pytest.fail("gradle is missing: apt-get install gradle (.ci/run does)")
    fake, server = repo_upstream
    proxy = redirecting_jvm_proxy
    project = java_project(tmp_path / "project")
    (project / "pom.xml").write_text(POM)
    settings = tmp_path / "settings.xml"
    settings.write_text(
        textwrap.dedent(f"""
        <settings><mirrors><mirror>
          <id>proxy</id><mirrorOf>*</mirrorOf><url>{proxy.url}/maven/</url>
        </mirror></mirrors></settings>
    """)
    )
    (project / "build.gradle").write_text(
        textwrap.dedent(f"""
        apply plugin: 'java'
        sourceCompatibility = 1.8
        targetCompatibility = 1.8
        repositories {{ maven {{ url '{proxy.url}/maven/' }} }}
        dependencies {{ testCompile 'junit:junit:4.13.2' }}
    """)
    )
    (project / "settings.gradle").write_text("rootProject.name = 'demo'\n")
    cold = run(
        ["mvn", "-B", "--strict-checksums", "-s", str(settings),
         f"-Dmaven.repo.local={tmp_path / 'm2-cold'}", "package"],
        cwd=project,
    )  # fmt: skip
    assert cold.returncode == 0, cold.stdout[-4000:]
    shutil.rmtree(project / "target")
    server.stop()  # from now on, everything comes from the cache: by redirect
    before = redirects()
    warm = run(
        ["mvn", "-B", "--strict-checksums", "-s", str(settings),
         f"-Dmaven.repo.local={tmp_path / 'm2-warm'}", "package"],
        cwd=project,
    )  # fmt: skip
    assert warm.returncode == 0, warm.stdout[-4000:]
    assert "Tests run: 1, Failures: 0" in warm.stdout
    maven_redirects = redirects() - before
    assert maven_redirects >= 10, maven_redirects
    before = redirects()
    gradle = run(
        ["gradle", "--no-daemon", "--console=plain", "build"],
        cwd=project,
        env={"GRADLE_USER_HOME": str(tmp_path / "gradle-home")},
    )
    assert gradle.returncode == 0, gradle.stdout[-4000:] + gradle.stderr[-4000:]
    assert redirects() - before >= 1  # junit's jar (and hamcrest's) from the bucket
    assert fake.count("/junit/junit/4.13.2/junit-4.13.2.jar") == 1
