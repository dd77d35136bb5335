"""Real mvn and Gradle through the proxy, with Debian's Maven repository as the upstream."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.config.load import load
from tests.conftest import ProxyFactory, write_config
from tests.upstream import FakeUpstream, ServerThread, start_upstream

pytestmark = pytest.mark.slow

GREETER = """
package demo;
public class Greeter { public static String greet(String n) { return "hello " + n; } }
"""
GREETER_TEST = """
package demo;
import org.junit.Test;
import static org.junit.Assert.assertEquals;
public class GreeterTest { @Test public void greets() { assertEquals("hello x", Greeter.greet("x")); } }
"""
POM = """
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
      <groupId>junit</groupId><artifactId>junit</artifactId><version>4.13.2</version><scope>test</scope>
    </dependency>
  </dependencies>
</project>
"""


def java_project(root: Path) -> Path:
    (root / "src/main/java/demo").mkdir(parents=True)
    (root / "src/test/java/demo").mkdir(parents=True)
    (root / "src/main/java/demo/Greeter.java").write_text(GREETER)
    (root / "src/test/java/demo/GreeterTest.java").write_text(GREETER_TEST)
    return root


@pytest.fixture
def repo_upstream(debian_maven_repo: Path) -> Iterator[tuple[FakeUpstream, ServerThread]]:
    fake = FakeUpstream(directory=debian_maven_repo)
    server = start_upstream(fake)
    yield fake, server
    fake.released.set()
    server.stop()


@pytest.fixture
def jvm_proxy(
    tmp_path: Path, repo_upstream: tuple[FakeUpstream, ServerThread], start_proxy: ProxyFactory
) -> ServerThread:
    _fake, server = repo_upstream
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "maven"
        format = "maven"
        upstream = "{server.url}/"
        [[repositories]]
        name = "gradle-cache"
        format = "gradle-build-cache"
        anonymous = "read"
        [repositories.users.ci]
        password = "ci-secret"
        role = "write"
    """,
    )
    return start_proxy(load(config, {}))


def run(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def test_mvn_builds_through_the_proxy_then_from_the_cache_alone(
    tmp_path: Path, jvm_proxy: ServerThread, repo_upstream: tuple[FakeUpstream, ServerThread]
) -> None:
    fake, server = repo_upstream
    project = java_project(tmp_path / "project")
    (project / "pom.xml").write_text(POM)
    settings = tmp_path / "settings.xml"
    settings.write_text(
        textwrap.dedent(f"""
        <settings><mirrors><mirror>
          <id>proxy</id><mirrorOf>*</mirrorOf><url>{jvm_proxy.url}/maven/</url>
        </mirror></mirrors></settings>
    """)
    )
    # --strict-checksums: a checksum file that does not match its artifact fails the build.
    for attempt in ("cold", "warm"):
        result = run(
            ["mvn", "-B", "--strict-checksums", "-s", str(settings),
             f"-Dmaven.repo.local={tmp_path / ('m2-' + attempt)}", "package"],
            cwd=project,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:]
        assert (project / "target/demo-1.0.jar").exists()
        assert "Tests run: 1, Failures: 0" in result.stdout
        shutil.rmtree(project / "target")
        if attempt == "cold":
            assert fake.count("/junit/junit/4.13.2/junit-4.13.2.jar") == 1
            server.stop()  # the second build must come from the cache alone


def test_gradle_resolves_through_the_proxy_and_reuses_its_build_cache(
    tmp_path: Path, jvm_proxy: ServerThread, repo_upstream: tuple[FakeUpstream, ServerThread]
) -> None:
    if shutil.which("gradle") is None:
        pytest.fail("gradle is missing: apt-get install gradle (.ci/run does)")
    fake, server = repo_upstream
    project = java_project(tmp_path / "project")
    (project / "build.gradle").write_text(
        textwrap.dedent(f"""
        apply plugin: 'java'
        sourceCompatibility = 1.8
        targetCompatibility = 1.8
        repositories {{ maven {{ url '{jvm_proxy.url}/maven/' }} }}
        dependencies {{ testCompile 'junit:junit:4.13.2' }}
    """)
    )
    (project / "settings.gradle").write_text(
        textwrap.dedent(f"""
        rootProject.name = 'demo'
        buildCache {{
          local {{ enabled = false }}
          remote(HttpBuildCache) {{
            url = '{jvm_proxy.url}/gradle-cache/'
            push = true
            credentials {{ username = 'ci'; password = 'ci-secret' }}
          }}
        }}
    """)
    )
    outputs = []
    for attempt in ("cold", "warm"):
        result = run(
            ["gradle", "--no-daemon", "--build-cache", "--console=plain", "clean", "build"],
            cwd=project,
            env={"GRADLE_USER_HOME": str(tmp_path / f"gradle-home-{attempt}")},
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        outputs.append(result.stdout)
        shutil.rmtree(project / "build")
        if attempt == "cold":
            assert fake.count("/junit/junit/4.13.2/junit-4.13.2.jar") == 1
            server.stop()  # dependencies must now come from the proxy's cache
    assert ":compileJava FROM-CACHE" not in outputs[0]
    assert ":compileJava FROM-CACHE" in outputs[1]
    assert ":compileTestJava FROM-CACHE" in outputs[1]
