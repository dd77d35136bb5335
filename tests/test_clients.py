"""Real pip and uv installing through the proxy (with dependencies and PEP 658 metadata)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.upstream import FakeUpstream, ProjectFile, ServerThread, make_wheel

pytestmark = pytest.mark.slow


@pytest.fixture
def packages(upstream: FakeUpstream) -> dict[str, bytes]:
    wheels = {}
    for name, version, requires in (
        ("alpha", "1.0", ["beta>=2"]),
        ("beta", "1.0", []),
        ("beta", "2.0", []),
    ):
        filename, body, metadata = make_wheel(name, version, requires)
        wheels[filename] = body
        upstream.projects.setdefault(name, []).append(
            ProjectFile(filename, body, metadata=metadata, requires_python=">=3.8")
        )
    return wheels


def _installed(target: Path) -> set[str]:
    return {p.name for p in target.iterdir() if p.name.endswith(".dist-info")}


def test_pip_installs_with_dependencies(
    pypi_proxy: ServerThread,
    upstream: FakeUpstream,
    packages: dict[str, bytes],
    tmp_path: Path,
    clean_env: dict[str, str],
) -> None:
    index = f"{pypi_proxy.url}/pypi/simple/"
    for attempt in ("cold", "warm"):
        target = tmp_path / attempt
        result = subprocess.run(
            [
                sys.executable, "-m", "pip", "install", "--isolated", "--no-cache-dir",
                "--disable-pip-version-check", "--index-url", index, "--target", str(target), "alpha",
            ],
            capture_output=True, text=True, timeout=300, env=clean_env,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert _installed(target) == {"alpha-1.0.dist-info", "beta-2.0.dist-info"}
    # The second install came from the cache: each file was fetched upstream once.
    assert upstream.count("/packages/alpha-1.0-py3-none-any.whl") == 1
    assert upstream.count("/packages/beta-2.0-py3-none-any.whl") == 1
    assert upstream.count("/simple/alpha/") == 1


def test_uv_installs_with_dependencies(
    pypi_proxy: ServerThread,
    upstream: FakeUpstream,
    packages: dict[str, bytes],
    tmp_path: Path,
    clean_env: dict[str, str],
) -> None:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    assert uv is not None, "uv is a test dependency (pip install -e '.[dev]')"
    index = f"{pypi_proxy.url}/pypi/simple/"
    target = tmp_path / "uv-target"
    result = subprocess.run(
        [
            uv, "pip", "install", "--no-config", "--no-cache", "--python", sys.executable,
            "--index-url", index, "--target", str(target), "alpha",
        ],
        capture_output=True, text=True, timeout=300, env={**clean_env, "UV_NO_CONFIG": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert _installed(target) == {"alpha-1.0.dist-info", "beta-2.0.dist-info"}
    # uv reads PEP 658 metadata instead of downloading wheels it does not install.
    assert upstream.count("/packages/beta-1.0-py3-none-any.whl") == 0
