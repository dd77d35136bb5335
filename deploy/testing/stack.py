"""The compose stack of deploy/ on a real Docker engine, for the deploy test and bench/lb.py.

- ``ensure_engine()``: ``docker info`` answers, else docker-standins starts an engine.
- ``ensure_images()``: the base images are present, pulled, or (when the pull fails, as on
  machines without access to public registries) built by docker-standins under the same
  names, so the project's Dockerfile and compose file are used unchanged.
- ``Stack``: deploy/docker-compose.yml plus testing/compose.test.yml (a fake upstream and
  proxy1 published on 127.0.0.1) under a unique project name, on free loopback ports.

Standard library and httpx only.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILES = [DEPLOY / "docker-compose.yml", DEPLOY / "testing" / "compose.test.yml"]
S3_COMPOSE_FILE = DEPLOY / "docker-compose.s3.yml"  # the object-storage variant
IMAGE = "artifact-proxy:deploy-test"
S3_IMAGE = "artifact-proxy-s3:deploy-test"
PULL_TIMEOUT_S = 60
T = TypeVar("T")


def log(message: str) -> None:
    print(message, flush=True)


def run(
    argv: Sequence[str],
    *,
    timeout: float = 300,
    check: bool = True,
    capture: bool = True,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            list(argv),
            capture_output=capture,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"timed out after {timeout:.0f}s: {' '.join(argv)}") from exc
    if check and result.returncode != 0:
        tail = ((result.stdout or "") + (result.stderr or "")).strip()[-3000:]
        raise RuntimeError(f"failed ({result.returncode}): {' '.join(argv)}\n{tail}")
    return result


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, every_s: float = 0.5) -> T:
    """Call ``probe`` until it returns something other than None/False; bounded."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            value = probe()
            if value is not None and value is not False:
                return value
        except Exception as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s{detail}")
        time.sleep(every_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------ engine, images


def standins_tool() -> list[str] | None:
    """The docker-standins command: $DOCKER_STANDINS, or ../shared/tools beside the repo."""
    candidates = [
        os.environ.get("DOCKER_STANDINS", ""),
        str(ROOT.parent / "shared" / "tools" / "docker-standins"),
        "/work/shared/tools/docker-standins",
    ]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate):
            # A read-only copy may have lost its execute bit: run it with bash then.
            return [candidate] if os.access(candidate, os.X_OK) else ["bash", candidate]
    return None


def engine_up() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return run(["docker", "info"], timeout=20, check=False).returncode == 0
    except RuntimeError:
        return False


def ensure_engine() -> bool:
    """True if this call started the engine (with docker-standins)."""
    if engine_up():
        return False
    tool = standins_tool()
    if tool is None:
        raise RuntimeError("no Docker engine answers `docker info`, and docker-standins is absent")
    log(f"no Docker engine answers: starting one with {' '.join(tool)} engine")
    run([*tool, "engine"], timeout=900, capture=False)
    if not engine_up():
        raise RuntimeError("the Docker engine did not come up")
    return True


def stop_standins_engine() -> None:
    tool = standins_tool()
    if tool is not None and standins_engine_pid() is not None:
        run([*tool, "stop"], timeout=120, capture=False)


def standins_engine_pid() -> int | None:
    """The dockerd that docker-standins started, if that is the engine here."""
    pidfile = Path(os.environ.get("DOCKER_STANDINS_DOCKERD_PIDFILE", "/tmp/dockerd.pid"))
    try:
        pid = int(pidfile.read_text().strip())
        if Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd":
            return pid
    except (OSError, ValueError):
        pass
    return None


def restart_standins_engine() -> None:
    tool = standins_tool()
    assert tool is not None
    run([*tool, "stop"], timeout=120, capture=False)
    run([*tool, "engine"], timeout=300, capture=False)


def base_images() -> list[str]:
    """Every image the Dockerfile builds FROM and the compose file runs (not built)."""
    images = re.findall(r"^FROM\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    for file in COMPOSE_FILES:
        images += re.findall(r"^\s+image:\s+([^\s$]+)\s*$", file.read_text(), re.MULTILINE)
    return sorted(set(images))


def image_present(image: str) -> bool:
    return run(["docker", "image", "inspect", image], check=False, timeout=30).returncode == 0


def ensure_images(images: Sequence[str]) -> None:
    missing = [image for image in images if not image_present(image)]
    for image in list(missing):
        log(f"  {image}: not here; docker pull ({PULL_TIMEOUT_S}s at most)")
        try:
            if (
                run(["docker", "pull", "-q", image], timeout=PULL_TIMEOUT_S, check=False).returncode
                == 0
            ):
                missing.remove(image)
                continue
        except RuntimeError:
            pass
        log(f"  {image}: pull failed")
    if missing:
        tool = standins_tool()
        if tool is None:
            raise RuntimeError(f"cannot pull {', '.join(missing)} and docker-standins is absent")
        log(f"  building local stand-ins: {' '.join(tool)} build --no-pull {' '.join(missing)}")
        run([*tool, "build", "--no-pull", *missing], timeout=1800, capture=False)


def build_image(tag: str = IMAGE) -> float:
    started = time.monotonic()
    run(["docker", "build", "-q", "-t", tag, str(ROOT)], timeout=900)
    return time.monotonic() - started


def build_s3_image(tag: str = S3_IMAGE) -> float:
    """The object-storage variant's S3 server (deploy/s3/)."""
    started = time.monotonic()
    run(["docker", "build", "-q", "-t", tag, str(DEPLOY / "s3")], timeout=900)
    return time.monotonic() - started


def compose_command() -> list[str]:
    if run(["docker", "compose", "version"], check=False, timeout=30).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("neither `docker compose` nor `docker-compose` is installed")


# ------------------------------------------------------------------------ test packages


def make_wheel(
    folder: Path, name: str, version: str, requires: Sequence[str] = (), payload: int = 0
) -> Path:
    """A minimal valid pure-Python wheel (``payload`` bytes of random data inside)."""
    dist = name.replace("-", "_")
    module = f"{dist}/__init__.py"
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {req}\n" for req in requires
    )
    files = {
        module: f"VERSION = {version!r}\n".encode(),
        f"{dist}/data.bin": os.urandom(payload),
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: deploy-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for path, body in files.items():
            archive.writestr(path, body)
    target = folder / name / f"{dist}-{version}-py3-none-any.whl"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(buffer.getvalue())
    target.chmod(0o644)
    target.parent.chmod(0o755)
    return target


def make_packages(folder: Path) -> dict[str, Path]:
    """dt-alpha (needs dt-beta), dt-beta, dt-big (1 MiB, for measurements) and dt-gamma
    (for the LB cache key: fetched by no other check)."""
    folder.chmod(0o755)
    return {
        "dt-alpha": make_wheel(folder, "dt-alpha", "1.0", ["dt-beta"]),
        "dt-beta": make_wheel(folder, "dt-beta", "1.0", payload=20_000),
        "dt-big": make_wheel(folder, "dt-big", "1.0", payload=1024 * 1024),
        "dt-gamma": make_wheel(folder, "dt-gamma", "1.0", payload=5_000),
    }


# ------------------------------------------------------------------------ the stack


class Stack:
    """The compose stack under a unique project name, on free loopback ports."""

    def __init__(
        self, image: str = IMAGE, prefix: str = "proxytest", object_storage: bool = False
    ) -> None:
        """``object_storage``: the variant of docker-compose.s3.yml (a bucket, no shared
        volume)."""
        self.project = f"{prefix}-{secrets.token_hex(3)}"
        self.compose_files = COMPOSE_FILES + ([S3_COMPOSE_FILE] if object_storage else [])
        self.object_storage = object_storage
        self.compose = compose_command()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.project}-"))
        self.files = self.workdir / "files"
        self.files.mkdir()
        self.packages = make_packages(self.files)
        self.lb_port = free_port()
        self.proxy1_port = free_port()
        self.prometheus_port = free_port()
        self.gradle_password = secrets.token_hex(12)  # deploy/proxy.toml's user `ci`
        self.env = {
            **os.environ,
            "PROXY_IMAGE": image,
            "PROXY_UPSTREAM_PYPI": "http://upstream:8000/simple/",
            "PROXY_PUBLISH_ADDRESS": "127.0.0.1",
            "PROXY_LB_PORT": str(self.lb_port),
            "PROMETHEUS_PORT": str(self.prometheus_port),
            "DEPLOY_TEST_PROXY1_PORT": str(self.proxy1_port),
            "DEPLOY_TEST_FILES": str(self.files),
            "GRADLE_CACHE_CI_PASSWORD": self.gradle_password,
            "PROXY_S3_IMAGE": S3_IMAGE,
            "S3_SECRET_KEY": secrets.token_hex(16),
        }
        self.lb = f"http://127.0.0.1:{self.lb_port}"
        self.proxy1 = f"http://127.0.0.1:{self.proxy1_port}"
        self.prometheus = f"http://127.0.0.1:{self.prometheus_port}"

    def run(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [*self.compose, "-p", self.project]
        for file in self.compose_files:
            argv += ["-f", str(file)]
        return run([*argv, *args], timeout=timeout, check=check, env=self.env, cwd=DEPLOY)

    def up(self, *services: str, timeout: float = 240) -> None:
        self.run("up", "-d", "--no-build", *services, timeout=timeout)

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service).stdout.split()
        if not ids:
            raise RuntimeError(f"no container for service {service}")
        return ids[0]

    def containers(self) -> dict[str, str]:
        """service -> container id, for every container of the project (running or not)."""
        out = run(
            ["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
             "--format", '{{.ID}} {{.Label "com.docker.compose.service"}}'],
            timeout=30,
        ).stdout  # fmt: skip
        return {line.split()[1]: line.split()[0] for line in out.splitlines() if line.strip()}

    def inspect(self, service: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(
            run(["docker", "inspect", self.containers()[service]], timeout=30).stdout
        )
        return data[0]

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        if "Health" in state:
            return str(state["Health"]["Status"])
        return str(state["Status"])

    def address(self, service: str) -> str:
        networks = self.inspect(service)["NetworkSettings"]["Networks"]
        return str(next(iter(networks.values()))["IPAddress"])

    def logs(self, service: str, since: str | None = None) -> str:
        argv = ["docker", "logs"]
        if since:
            argv += ["--since", since]
        result = run([*argv, self.containers()[service]], timeout=60, check=False)
        return result.stdout + result.stderr

    def sql(self, query: str) -> str:
        return self.run(
            "exec", "-T", "db", "psql", "-U", "proxy", "-d", "proxy", "-Atc", query
        ).stdout

    def bucket_keys(self) -> dict[str, int]:
        """The objects of the variant's bucket (key -> size), listed from proxy1 (its
        image has the S3 client and the environment the credentials)."""
        script = (
            "import asyncio, json, os\n"
            "from aiobotocore.session import get_session\n"
            "async def main():\n"
            "    async with get_session().create_client('s3', endpoint_url='http://s3:8333',"
            " region_name='us-east-1') as s3:\n"
            "        found = {}\n"
            "        async for page in s3.get_paginator('list_objects_v2').paginate("
            "Bucket=os.environ['S3_BUCKET']):\n"
            "            found.update({o['Key']: o['Size'] for o in page.get('Contents', [])})\n"
            "        print(json.dumps(found))\n"
            "asyncio.run(main())\n"
        )
        out = self.run("exec", "-T", "proxy1", "python3", "-c", script).stdout
        keys: dict[str, int] = json.loads(out.strip().splitlines()[-1])
        return keys

    def upstream_counts(self) -> dict[str, int]:
        out = self.run(
            "exec", "-T", "upstream", "python3", "-c",
            "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/_counts').read().decode())",
        ).stdout  # fmt: skip
        counts: dict[str, int] = json.loads(out)
        return counts

    def wait_healthy(self, services: Sequence[str], timeout_s: float) -> float:
        started = time.monotonic()

        def all_healthy() -> bool:
            return all(self.health(service) in ("healthy", "running") for service in services)

        wait_for(f"{', '.join(services)} healthy", all_healthy, timeout_s, every_s=1)
        return time.monotonic() - started


def file_url(base: str, wheel: Path) -> str:
    return f"{base}/pypi/files/{wheel.parent.name}/{wheel.name}"


if __name__ == "__main__":
    sys.exit("import this module: deploy/test_stack.py and bench/lb.py use it")
