"""The bucket: one S3 client per process (aiobotocore), keys under the configured prefix,
bounded retries, and every error translated to ``StorageError`` here, once
(docs/architecture.md, "Object storage").

- **Keys.** A blob is ``{prefix}blobs/ab/cd/<sha256>``, content-addressed as on a
  folder; nothing else is written under ``{prefix}blobs/``.
- **Retries.** Throttling (503 SlowDown and friends), 5xx and connection errors are
  retried with jittered exponential backoff until ``RETRY_DEADLINE_S`` has passed since
  the first attempt; each attempt has its own connect and read timeouts. botocore's own
  retries are off, so ``proxy_storage_requests_total{operation}`` counts every request
  that left the process.
- **Nothing blocks the event loop.** Payloads are not hashed for the signature
  (UNSIGNED-PAYLOAD: the sha256 of the whole body is verified by us, before any upload)
  and no request or response checksums are computed by botocore; parts are read from
  the file in the I/O pool.
- **Bounded memory.** A file up to ``SINGLE_PUT_MAX_BYTES`` is one PUT; a larger one a
  multipart upload whose parts are read from the file as they are sent, at most
  ``PARTS_IN_FLIGHT`` of them per upload and ``PROCESS_PARTS_IN_FLIGHT`` in the process.
  A multipart upload that fails is aborted; one a crash leaves behind is aborted by the
  reclaim job (``stale_uploads``).
- **Credentials** come from the standard AWS chain only (environment variables, shared
  credentials and config files, web identity, container and instance roles); they are
  never read from the proxy's config and never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import botocore.exceptions
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from proxy.config.settings import ObjectStorageSettings
from proxy.exceptions import StorageError, StorageUnavailable
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.storage.integrity import Stamp

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

log = logging.getLogger("proxy.storage.s3")

T = TypeVar("T")

CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0  # no byte for this long from the bucket: the attempt failed
ATTEMPT_MAX_S = 120.0  # however it trickles, one request ends by then
RETRY_DEADLINE_S = 10.0  # retries stop this long after the first attempt
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 2.0
SINGLE_PUT_MAX_BYTES = 16 * 1024 * 1024
PART_BYTES = 16 * 1024 * 1024  # grown for files over 10,000 parts of it
MAX_PARTS = 10_000
PARTS_IN_FLIGHT = 4
PROCESS_PARTS_IN_FLIGHT = 16  # 256 MiB of part buffers at most, whatever the uploads
DELETE_BATCH = 1000  # keys per DeleteObjects: the API's limit
POOL_CONNECTIONS = 128
GET_CHUNK_BYTES = 1024 * 1024
PRESIGN_EXPIRY_S = 300
RETRYABLE_CODES = frozenset(
    {
        "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
        "ServiceUnavailable", "RequestTimeTooSkewed", "OperationAborted", "503", "500", "502",
        "504",
    }
)  # fmt: skip
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound", "NoSuchUpload"})
CREDENTIAL_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}
)
# The credential chain found nothing to sign with: no request left the process, and no
# retry will find any (a missing role or variable is not a bucket that is down).
NO_CREDENTIALS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.UnknownCredentialError,
)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    modified_s: float  # Unix time


@dataclass(frozen=True, slots=True)
class PendingUpload:
    key: str
    upload_id: str
    initiated_s: float  # Unix time


class ObjectStream:
    """The body of one GET as it arrives; close it when done (also when not read)."""

    stamp: Stamp | None = None  # an object is no file of ours (``Storage.open_blob``)

    def __init__(self, bucket: Bucket, key: str, body: Any, size: int) -> None:
        self._bucket = bucket
        self._key = key
        self._body = body
        self.size = size

    async def chunks(self) -> AsyncIterator[bytes]:
        """The bytes, ``StorageError`` if the transfer breaks off or stalls."""
        try:
            async for chunk in self._body.iter_chunks(GET_CHUNK_BYTES):
                yield chunk
        except (aiohttp.ClientError, botocore.exceptions.BotoCoreError, TimeoutError) as exc:
            raise self._bucket.failure("get", f"reading {self._key}", exc) from exc

    def close(self) -> None:
        self._body.close()


class Bucket:
    """One bucket and prefix, through one client for the whole process."""

    def __init__(self, settings: ObjectStorageSettings) -> None:
        self.settings = settings
        self.name = settings.bucket
        self.prefix = settings.prefix
        self.url = settings.url
        self._stack = contextlib.AsyncExitStack()
        self._client: S3Client | None = None
        self._parts = asyncio.Semaphore(PROCESS_PARTS_IN_FLIGHT)

    # -- life ---------------------------------------------------------------------------

    async def open(self) -> None:
        # botocore's own chatter (it logs request details at DEBUG) never reaches our logs.
        for name in ("botocore", "aiobotocore"):
            logging.getLogger(name).setLevel(logging.WARNING)
        s3: dict[str, Any] = {"payload_signing_enabled": False}
        s3["addressing_style"] = "path" if self.settings.path_style else "auto"
        config = AioConfig(
            s3=s3,
            signature_version="s3v4",
            retries={"total_max_attempts": 1},
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
            max_pool_connections=POOL_CONNECTIONS,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            tcp_keepalive=True,
        )
        # The client loads its service model from disk: once, at start-up. Making it
        # reads the AWS environment and shared files, which the config cannot check.
        try:
            self._client = await self._stack.enter_async_context(
                get_session().create_client(
                    "s3",
                    endpoint_url=self.settings.endpoint,
                    region_name=self.settings.region,
                    config=config,
                )
            )
        except botocore.exceptions.ProfileNotFound as exc:
            raise StorageError(f"AWS_PROFILE: {exc}") from exc
        except botocore.exceptions.InvalidRegionError as exc:
            raise StorageError(
                f"storage.s3.region (or AWS_REGION, AWS_DEFAULT_REGION, the profile's "
                f"region): {exc}"
            ) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise StorageError(f"storage.s3: cannot make the S3 client: {exc}") from exc
        # botocore asks for "100-continue" before an upload's body, and aiohttp waits
        # for it with no timeout of its own: a bucket that stops answering would hold
        # the upload forever. The header is not signed.
        self._client.meta.events.register("before-send.s3", _no_expect)

    async def close(self) -> None:
        self._client = None
        await self._stack.aclose()

    @property
    def client(self) -> S3Client:
        if self._client is None:
            raise StorageUnavailable(f"the object storage {self.url} is not open")
        return self._client

    def key(self, sha256: str) -> str:
        return f"{self.prefix}blobs/{sha256[:2]}/{sha256[2:4]}/{sha256}"

    @property
    def blobs_prefix(self) -> str:
        return f"{self.prefix}blobs/"

    # -- requests -----------------------------------------------------------------------

    async def check(self) -> None:
        """One request that needs the credentials, the bucket and the right to list it;
        a ``StorageError`` naming the setting otherwise (start-up, readiness)."""
        try:
            await self._call(
                "list",
                # Under the blobs' prefix, as every listing: a policy may grant
                # s3:ListBucket for the proxy's prefix only.
                lambda: self.client.list_objects_v2(
                    Bucket=self.name, Prefix=self.blobs_prefix, MaxKeys=1
                ),
            )
        except StorageUnavailable as exc:
            where = self.settings.endpoint or "AWS"
            raise StorageUnavailable(
                f"storage.s3.endpoint: cannot reach the object storage {self.url} at {where}: {exc}"
            ) from exc

    async def get(self, sha256: str) -> ObjectStream:
        """Start one GET of a blob: returns once the answer's head is in.
        FileNotFoundError if there is no such object."""
        key = self.key(sha256)
        answer = await self._call(
            "get", lambda: self.client.get_object(Bucket=self.name, Key=key), missing_ok=False,
            target=key,
        )  # fmt: skip
        return ObjectStream(self, key, answer["Body"], int(answer["ContentLength"]))

    async def put_file(self, sha256: str, fd: int, size: int) -> None:
        """Upload ``size`` bytes of the open file ``fd`` (verified: its sha256 is the
        name) to the blob's key. Only a complete upload creates the object."""
        key = self.key(sha256)
        if size <= SINGLE_PUT_MAX_BYTES:
            async with self._parts:
                body = await run_blocking(_read_exactly, fd, 0, size)
                await self._call(
                    "put",
                    lambda: self.client.put_object(Bucket=self.name, Key=key, Body=body),
                )
            return
        await self._multipart(key, fd, size)

    async def _multipart(self, key: str, fd: int, size: int) -> None:
        part_bytes = max(PART_BYTES, math.ceil(size / MAX_PARTS))
        created = await self._call(
            "create_multipart",
            lambda: self.client.create_multipart_upload(Bucket=self.name, Key=key),
        )
        upload_id = created["UploadId"]
        count = math.ceil(size / part_bytes)
        in_flight = asyncio.Semaphore(PARTS_IN_FLIGHT)

        async def part(number: int) -> dict[str, Any]:
            offset = (number - 1) * part_bytes
            length = min(part_bytes, size - offset)
            async with in_flight, self._parts:
                body = await run_blocking(_read_exactly, fd, offset, length)
                answer = await self._call(
                    "upload_part",
                    lambda: self.client.upload_part(
                        Bucket=self.name,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=body,
                    ),
                )
            return {"PartNumber": number, "ETag": answer["ETag"]}

        try:
            tasks = [asyncio.ensure_future(part(n)) for n in range(1, count + 1)]
            try:
                parts = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            await self._call(
                "complete_multipart",
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.name,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},  # type: ignore[typeddict-item]
                ),
            )
        except BaseException:
            # Shielded: a cancelled upload is aborted all the same (reclaim aborts what a
            # crash leaves).
            with contextlib.suppress(Exception):
                await asyncio.shield(self.abort(key, upload_id))
            raise

    async def abort(self, key: str, upload_id: str) -> None:
        await self._call(
            "abort_multipart",
            lambda: self.client.abort_multipart_upload(
                Bucket=self.name, Key=key, UploadId=upload_id
            ),
            missing_ok=True,
        )

    async def delete(self, sha256s: Sequence[str]) -> None:
        """Delete the blobs' objects, ``DELETE_BATCH`` keys per request; absent ones are
        no error."""
        keys = [self.key(sha) for sha in sha256s]
        await self.delete_keys(keys)

    async def delete_keys(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start : start + DELETE_BATCH]]

            def request(batch: list[dict[str, str]] = batch) -> Awaitable[Any]:
                return self.client.delete_objects(
                    Bucket=self.name,
                    Delete={"Objects": batch, "Quiet": True},  # type: ignore[typeddict-item]
                )

            answer = await self._call("delete", request)
            errors = [e for e in answer.get("Errors", []) if e.get("Code") not in MISSING_CODES]
            if errors:
                first = errors[0]
                raise self.failure(
                    "delete",
                    f"deleting {len(errors)} of {len(batch)} objects",
                    StorageError(f"{first.get('Code')}: {first.get('Message')}"),
                )

    async def list_objects(self, prefix: str) -> AsyncIterator[list[ObjectInfo]]:
        """Every object under ``prefix`` (relative to ours), a page at a time."""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.name, "Prefix": self.prefix + prefix}
            if token:
                kwargs["ContinuationToken"] = token
            answer = await self._call("list", functools.partial(self._list_page, kwargs))
            yield [
                ObjectInfo(item["Key"], int(item["Size"]), item["LastModified"].timestamp())
                for item in answer.get("Contents", [])
            ]
            token = answer.get("NextContinuationToken")
            if not answer.get("IsTruncated") or not token:
                return

    async def uploads(self) -> list[PendingUpload]:
        """Multipart uploads in progress under the blobs' prefix (all pages)."""
        found: list[PendingUpload] = []
        key_marker: str | None = None
        id_marker: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.name, "Prefix": self.blobs_prefix}
            if key_marker:
                kwargs["KeyMarker"] = key_marker
                if id_marker:
                    kwargs["UploadIdMarker"] = id_marker
            answer = await self._call(
                "list_multipart", functools.partial(self._uploads_page, kwargs)
            )
            for upload in answer.get("Uploads", []):
                found.append(
                    PendingUpload(
                        upload["Key"], upload["UploadId"], upload["Initiated"].timestamp()
                    )
                )
            key_marker = answer.get("NextKeyMarker")
            id_marker = answer.get("NextUploadIdMarker")
            if not answer.get("IsTruncated") or not key_marker:
                return found

    def _list_page(self, kwargs: dict[str, Any]) -> Awaitable[Any]:
        return self.client.list_objects_v2(**kwargs)

    def _uploads_page(self, kwargs: dict[str, Any]) -> Awaitable[Any]:
        return self.client.list_multipart_uploads(**kwargs)

    async def presign(self, sha256: str, expires_s: int = PRESIGN_EXPIRY_S) -> str:
        """A GET URL for the blob's object, valid ``expires_s`` (computed here: no request)."""
        url: str = await self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.name, "Key": self.key(sha256)},
            ExpiresIn=expires_s,
        )
        return url

    # -- retries and errors ---------------------------------------------------------------

    async def _call(
        self,
        operation: str,
        request: Callable[[], Awaitable[T]],
        missing_ok: bool | None = None,
        target: str = "",
    ) -> T:
        """Send ``request`` until it succeeds, fails for good, or the deadline passes.
        ``missing_ok``: True -> a missing object is success (None is returned); False ->
        FileNotFoundError; None -> a StorageError like any other failure."""
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            metrics.STORAGE_REQUESTS.labels(operation=operation).inc()
            try:
                async with asyncio.timeout(ATTEMPT_MAX_S):
                    return await request()
            except botocore.exceptions.ClientError as exc:
                code = _code(exc)
                if code in MISSING_CODES and missing_ok is not None:
                    if missing_ok:
                        return None  # type: ignore[return-value]
                    raise FileNotFoundError(
                        errno.ENOENT, f"no such object in {self.url}", target
                    ) from exc
                if code not in RETRYABLE_CODES:
                    raise self.failure(operation, operation, exc) from exc
                error: BaseException = exc
            except NO_CREDENTIALS as exc:
                raise self.failure(operation, operation, exc) from exc
            except (
                aiohttp.ClientError,
                botocore.exceptions.BotoCoreError,
                TimeoutError,
                OSError,
            ) as exc:
                error = exc
            elapsed = time.monotonic() - started
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1))
            delay *= random.uniform(0.5, 1.0)
            if elapsed + delay >= RETRY_DEADLINE_S:
                raise self.failure(
                    operation, f"{operation} ({attempt} attempts in {elapsed:.1f} s)", error
                ) from error
            log.info("storage %s: retrying after %s", operation, _describe(error))
            await asyncio.sleep(delay)

    def failure(self, operation: str, what: str, exc: BaseException) -> StorageError:
        """The ``StorageError`` for a failed request, counted; the caller raises it."""
        code = _code(exc)
        metrics.STORAGE_ERRORS.labels(operation=operation, errno=code).inc()
        detail = _describe(exc)
        if isinstance(exc, NO_CREDENTIALS):
            return StorageError(
                f"storage.url: {self.url}: {what}: no AWS credentials found ({detail}); set "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE with a shared "
                "credentials file, or web identity (AWS_ROLE_ARN, AWS_WEB_IDENTITY_TOKEN_FILE)"
            )
        if code in CREDENTIAL_CODES:
            return StorageError(
                f"storage.url: {self.url}: {what}: access denied ({detail}); check the AWS "
                "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, shared credentials "
                "files, web identity) and the bucket policy"
            )
        if code == "NoSuchBucket":
            return StorageError(f"storage.url: {self.url}: the bucket {self.name!r} does not exist")
        return StorageUnavailable(f"the object storage {self.url}: {what} failed: {detail}")


def _no_expect(request: Any, **kwargs: Any) -> None:
    request.headers.pop("Expect", None)


def _read_exactly(fd: int, offset: int, length: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise OSError(f"the file ended at {offset + len(data)} of {offset + length} bytes")
        data += more
    return data


def _code(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or "")
        if not code or code.isdigit():
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return str(status or code or "error")
        return code
    if isinstance(exc, NO_CREDENTIALS):
        return "no_credentials"
    if isinstance(exc, TimeoutError | botocore.exceptions.ReadTimeoutError):
        return "timeout"
    if isinstance(exc, botocore.exceptions.ConnectTimeoutError):
        return "connect_timeout"
    if isinstance(exc, aiohttp.ClientError | botocore.exceptions.BotoCoreError | OSError):
        return "connection"
    return "error"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{error.get('Code') or status}: {error.get('Message') or 'no message'}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
