"""A waiter's copy of a relayed download (proxy/fetch/relayed.py), against relays the test
controls (real HTTP servers on port 0): a broken connection is resumed from the bytes
held, a relay that trickles under upstream.min_rate is dropped (the copy stops growing:
"lost", not a failure), an answer without the relay's proof gives nothing, and the last
byte is released only when the copy is the stored blob."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

from proxy.catalog import StreamInfo
from proxy.config.settings import UpstreamSettings
from proxy.fetch.relay import PROOF_HEADER, proof
from proxy.fetch.relayed import RelayClient
from proxy.fetch.transfer import StoredBlob
from proxy.runtime.tasks import TaskSupervisor
from proxy.storage.blobs import BlobStore, TempBlob
from tests.upstream import ServerThread

TOKEN = "t" * 43
FENCE = 7
BODY = os.urandom(256 * 1024)


class Relay:
    """A relay whose behaviour the test picks: ``mode`` = "break once", "trickle", "short"
    or "no proof"."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.ranges: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        offset = int(headers["range"].removeprefix("bytes=").rstrip("-"))
        self.ranges.append(headers["range"])
        total = len(BODY)
        length = 1000 if self.mode == "short" else total - offset
        head = [
            (b"content-length", str(length).encode()),
            (b"content-range", f"bytes {offset}-{total - 1}/{total}".encode()),
        ]
        if self.mode != "no proof":
            head.append((PROOF_HEADER.encode(), proof(TOKEN, FENCE, offset, total).encode()))
        await send({"type": "http.response.start", "status": 206, "headers": head})
        if self.mode == "trickle":
            for i in range(offset, total, 10):
                await send(
                    {"type": "http.response.body", "body": BODY[i : i + 10], "more_body": True}
                )
                await asyncio.sleep(0.2)
            return
        if self.mode == "short":  # a whole answer, cleanly ended, of too few bytes
            await send({"type": "http.response.body", "body": BODY[offset : offset + 1000]})
            return
        if self.mode == "break once" and len(self.ranges) == 1:
            await send(
                {"type": "http.response.body", "body": BODY[: total // 2], "more_body": True}
            )
            return  # the connection is cut: fewer bytes than announced
        await send({"type": "http.response.body", "body": BODY[offset:]})


def run_follow(tmp_path: Path, mode: str, settings: UpstreamSettings) -> dict[str, Any]:
    relay = Relay(mode)
    server = ServerThread(relay).start()
    files = BlobStore(tmp_path / "local")
    files.prepare()
    adopted: list[str] = []

    async def adopt(temp: TempBlob, sha256: str) -> None:
        await files.publish(temp)
        adopted.append(sha256)

    async def scenario() -> dict[str, Any]:
        tasks = TaskSupervisor()
        client = RelayClient(files, settings, adopt)
        try:
            stream = StreamInfo(None, None, len(BODY), server.url, TOKEN)
            relayed = await client.follow(stream, FENCE, tasks.spawn)
            assert relayed is not None
            started = time.monotonic()
            await asyncio.wait_for(relayed.ended.wait(), 30)
            out: dict[str, Any] = {
                "received": relayed.received,
                "readable": relayed.readable(),
                "error": relayed.error,
                "seconds": time.monotonic() - started,
            }
            blob = StoredBlob(hashlib.sha256(BODY).hexdigest(), len(BODY), "", _never)
            out["stored"] = await relayed.is_stored(blob)
            out["complete"] = relayed.complete()
            if out["stored"]:
                assert relayed.fd is not None
                out["bytes"] = await relayed.read(0, len(BODY))
            relayed.close()
            return out
        finally:
            await client.aclose()
            await tasks.close(2)

    try:
        result = asyncio.run(scenario())
    finally:
        server.stop()
    result["ranges"] = relay.ranges
    result["adopted"] = adopted
    return result


async def _never() -> Any:
    raise AssertionError("not opened")


SETTINGS = UpstreamSettings(connect_timeout_s=2.0, read_timeout_s=5.0)


def test_a_broken_relay_connection_is_resumed_from_the_bytes_held(tmp_path: Path) -> None:
    got = run_follow(tmp_path, "break once", SETTINGS)
    # Asked again from the bytes it held when the connection broke (at most the half
    # the relay sent: what was in flight may be lost with the connection).
    first, second = got["ranges"]
    resumed_at = int(second.removeprefix("bytes=").rstrip("-"))
    assert first == "bytes=0-" and 0 < resumed_at <= len(BODY) // 2
    assert got["received"] == len(BODY) and got["error"] is None
    assert got["readable"] == len(BODY) - 1, "the last byte waits for the stored blob"
    assert got["stored"] and got["complete"] and got["bytes"] == BODY
    assert got["adopted"] == [hashlib.sha256(BODY).hexdigest()], "kept as the local copy"


def test_a_trickling_relay_is_dropped_and_the_copy_only_stops_growing(tmp_path: Path) -> None:
    slow = UpstreamSettings(
        connect_timeout_s=2.0, read_timeout_s=5.0, min_rate=10_000, min_rate_window_s=1.0
    )
    got = run_follow(tmp_path, "trickle", slow)
    assert got["received"] < len(BODY) and got["error"] is None  # lost, not a failure
    assert got["seconds"] < 10  # dropped after the rate window, not after the body
    assert not got["stored"] and not got["complete"] and got["adopted"] == []


def test_an_answer_without_the_relays_proof_gives_nothing(tmp_path: Path) -> None:
    got = run_follow(tmp_path, "no proof", SETTINGS)
    assert got["received"] == 0 and got["readable"] == 0
    assert got["ranges"] == ["bytes=0-"], "not asked again"
    assert not got["stored"] and got["adopted"] == []


def test_a_relay_answering_short_is_asked_a_bounded_number_of_times(tmp_path: Path) -> None:
    got = run_follow(tmp_path, "short", SETTINGS)
    assert got["ranges"] == ["bytes=0-", "bytes=1000-", "bytes=2000-"]
    assert got["received"] == 3000 and not got["stored"]
