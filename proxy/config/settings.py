"""The proxy's settings as frozen dataclasses, with every default in one place.

``config.load`` builds them (from TOML, the environment and the embedded defaults) and
validates every value once; nothing else parses configuration. A repository's own
settings are its format's options dataclass (``RepositorySettings.options``), declared
by the format module itself (docs/architecture.md, "Adding a format").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from proxy.config.options import (
    Hosts,
    Networks,
    Percent,
    Urls,
    options_of,
    toml_key,
    toml_string,
)
from proxy.redaction import redact
from proxy.units import format_duration, format_size, format_timestamp

# The largest body a proxying repository stores unless it sets max_file_size (the
# largest wheels and images are a few GB; nothing legitimate comes near this).
DEFAULT_MAX_FILE_SIZE = 20 * 10**9
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_STORAGE_PATH = "./data"
DEFAULT_WORKERS = 1
# A reverse proxy on this machine (nginx in front of 127.0.0.1) forwards for its clients.
DEFAULT_TRUSTED_PROXIES = ("127.0.0.1/32", "::1/128")
DEFAULT_ACCESS_LOG = True  # one line per request, as uvicorn and nginx do by default
LOG_FORMATS = ("text", "json")
DEFAULT_LOG_FORMAT = "text"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 2
DEFAULT_MAX_CONNECTIONS = 100  # per upstream host
DEFAULT_TRANSFER_TIMEOUT_S = 4 * 3600.0  # a multi-GB artifact on a slow link fits
DEFAULT_MIN_RATE = 4 * 1024  # bytes per second, averaged over the window below
DEFAULT_MIN_RATE_WINDOW_S = 30.0
# Parsing one upstream index page: a real index's 600,000-project root page takes a few
# seconds; pages that take CPython's HTML parser quadratic time would take hours.
DEFAULT_PARSE_TIMEOUT_S = 30.0
DEFAULT_MIN_FREE = 512 * 2**20  # below it /readyz fails, new bodies are refused
# Connections of one replica to Postgres (docs/architecture.md, "The catalog's
# connections"): at most this many pooled, plus the one session connection.
DEFAULT_POOL_SIZE = 10
DEFAULT_POOL_IDLE_TIMEOUT_S = 30.0  # a pooled connection unused this long is closed
DEFAULT_LOCAL_CACHE_MAX_SIZE = 10 * 10**9  # each replica's local tier on object storage
DEFAULT_LEASE_TTL_S = 15.0
DEFAULT_LEASE_POLL_INTERVAL_S = 0.25
DEFAULT_LEASE_RETENTION_S = 24 * 3600.0
DEFAULT_RECLAIM_INTERVAL_S = 3600.0
DEFAULT_SWEEP_INTERVAL_S = 300.0
DEFAULT_LOW_WATERMARK = 0.9
DEFAULT_EVICT_INTERVAL_S = 300.0
DEFAULT_RETENTION_INTERVAL_S = 3600.0
DEFAULT_EVICT_GRACE_S = 3600.0
DEFAULT_SCRUB_INTERVAL_S = 24 * 3600.0
# The scrub re-hashes stored blobs at this pace at most, so it never competes with hits
# for the disk (or the bucket): a day covers 4 TB.
DEFAULT_SCRUB_RATE = 50 * 10**6
DEFAULT_MIRROR_INTERVAL_S = 24 * 3600.0
DEFAULT_MIRROR_VERSIONS = "latest"
MIRROR_VERSIONS = ("latest", "all")
# The release policy (docs/architecture.md, "Release policy").
POLICY_MODES = ("enforce", "report")
DEFAULT_POLICY_MODE = "enforce"
UNKNOWN_PUBLISH_TIMES = ("first-seen", "allow", "deny")
DEFAULT_UNKNOWN_PUBLISH_TIME = "first-seen"
RULE_ACTIONS = ("allow", "deny")

OptionsT = TypeVar("OptionsT")


@dataclass(frozen=True)
class RepositorySettings(Generic[OptionsT]):
    name: str
    format: str
    options: OptionsT  # the format's own settings dataclass
    # The engine's keys of a repository whose format declares proxying (the config
    # layer reads them for every such format; contract.ENGINE_REPOSITORY_KEYS).
    proxies: bool = False
    upstreams: tuple[str, ...] = ()  # tried in order; empty: not configured yet
    # Internal hosts this repository's upstream-listed URLs may reach (SSRF policy).
    allow_hosts: tuple[str, ...] = ()
    retention_s: float | None = None  # entries not accessed for this long go (None: kept)
    # No body larger than this is stored (or passed on) for the repository.
    max_file_size: int = DEFAULT_MAX_FILE_SIZE
    # The release policy's cooldown here (None: [policy].cooldown); only for formats
    # whose releases the policy can judge (contract.Releases).
    cooldown_s: float | None = None

    @property
    def upstream_setting(self) -> str:
        """What an operator sets to give this repository an upstream (for messages)."""
        env_var = upstream_env_var(self.name)
        return f"repositories.{self.name}.upstream (or the environment variable {env_var})"


ADMIN_ANONYMOUS = ("none", "read")


@dataclass(frozen=True)
class AdminUser:
    """A user of the console and the admin API. Secrets are kept as SHA-256 digests
    only (a plain ``password`` is hashed when the config loads)."""

    name: str
    password_sha256: str | None = None  # HTTP Basic
    token_sha256: str | None = None  # Authorization: Bearer


@dataclass(frozen=True)
class AdminSettings:
    """``[admin]``: who may use ``/ui/`` and ``/api/`` (docs/architecture.md,
    "Operating: console, API and logs")."""

    anonymous: str = "none"  # "read": the console and the API's reads open to anyone
    users: tuple[AdminUser, ...] = ()

    def user(self, name: str) -> AdminUser | None:
        return next((u for u in self.users if u.name == name), None)


@dataclass(frozen=True)
class TlsSettings:
    """``server.tls_cert`` / ``server.tls_key``: HTTPS without a load balancer."""

    cert: Path  # PEM: the certificate, then any intermediates
    key: Path  # PEM: its private key (unencrypted)


@dataclass(frozen=True)
class UpstreamSettings:
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    min_rate: int = DEFAULT_MIN_RATE
    min_rate_window_s: float = DEFAULT_MIN_RATE_WINDOW_S
    parse_timeout_s: float = DEFAULT_PARSE_TIMEOUT_S


@dataclass(frozen=True)
class DatabaseSettings:
    """How a replica connects to Postgres besides ``Settings.database_url``, the pool's
    URL (docs/architecture.md, "The catalog's connections")."""

    # The one connection that needs a session (LISTEN, job locks): direct to Postgres
    # or through a session-mode pooler. None: the same as the pool's URL.
    session_url: str | None = None
    pool_size: int = DEFAULT_POOL_SIZE
    idle_timeout_s: float = DEFAULT_POOL_IDLE_TIMEOUT_S


@dataclass(frozen=True)
class LeaseSettings:
    ttl_s: float = DEFAULT_LEASE_TTL_S
    # Between a waiter's checks while the lease notifications are not being received
    # (the listener is reconnecting, or notify is off); with them, waiters check at the
    # lease's renewal pace (ttl/3).
    poll_interval_s: float = DEFAULT_LEASE_POLL_INTERVAL_S
    retention_s: float = DEFAULT_LEASE_RETENTION_S
    notify: bool = True  # LISTEN/NOTIFY wake-ups (Postgres); False: waiters poll only


@dataclass(frozen=True)
class StorageSettings:
    """Bounds of the proxied entries (docs/architecture.md, "Eviction and retention")."""

    max_size: int | None = None  # all proxied repositories together; None: no limit
    low_watermark: float = DEFAULT_LOW_WATERMARK  # a pass stops at or under this share
    min_free: int = DEFAULT_MIN_FREE  # below it: /readyz not ready, new bodies refused
    # Hash every read of a stored blob as it is sent, stamped or not (docs/architecture.md,
    # "Blobs verified when read": off, it costs the hit path its cheapest reads).
    verify_reads: bool = False
    scrub_rate: int = DEFAULT_SCRUB_RATE  # bytes per second the scrub reads at most


@dataclass(frozen=True)
class ObjectStorageSettings:
    """Blobs in an S3-compatible bucket (docs/architecture.md, "Object storage"):
    ``storage.url = "s3://bucket/prefix/"`` and ``[storage.s3]``. Credentials come only
    from the standard AWS chain (environment, shared files, web identity), never from
    here."""

    bucket: str
    prefix: str  # "" or ending with "/"
    local_cache: Path  # this replica's own disk tier (never shared)
    local_cache_max_size: int = DEFAULT_LOCAL_CACHE_MAX_SIZE
    endpoint: str | None = None  # None: AWS
    region: str | None = None
    path_style: bool = False
    redirect_min_size: int | None = None  # None: hits are never redirected

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class JobSettings:
    reclaim_interval_s: float = DEFAULT_RECLAIM_INTERVAL_S
    sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S
    evict_interval_s: float = DEFAULT_EVICT_INTERVAL_S
    retention_interval_s: float = DEFAULT_RETENTION_INTERVAL_S
    # An evicted blob is deleted only this long after its last entry went, so a client
    # still reading it (on any replica of a shared volume) finishes first.
    evict_grace_s: float = DEFAULT_EVICT_GRACE_S
    scrub_interval_s: float = DEFAULT_SCRUB_INTERVAL_S  # stored blobs re-hashed (scrub)


@dataclass(frozen=True)
class MirrorSettings:
    """A schedule that warms the cache with packages named by purls (and an SBOM)."""

    name: str
    interval_s: float = DEFAULT_MIRROR_INTERVAL_S
    packages: tuple[str, ...] = ()  # purls, validated
    sbom: Path | None = None  # CycloneDX or SPDX JSON, read at every run
    versions: str = DEFAULT_MIRROR_VERSIONS  # for a purl without a version: latest | all
    repository: str | None = None  # None: the first repository serving the purl's type

    @property
    def job_name(self) -> str:
        return f"mirror:{self.name}"


@dataclass(frozen=True)
class PolicyRule:
    """One ``[[policy.rules]]`` table, validated (``config.load``); ``policy.rules``
    compiles it. ``index`` is its place in the file, which names it in messages."""

    index: int
    match: str  # the canonical purl of a package, without a version
    versions: str | None = None  # a vers range (``vers:pypi/>=1.2|<1.3``); None: every version
    action: str | None = None  # "allow" | "deny"; None: the cooldown applies
    cooldown_s: float | None = None  # replaces the repository's cooldown
    reason: str | None = None
    name: str | None = None  # a short label for metrics and messages

    @property
    def label(self) -> str:
        """The rule's label in metrics: its name, else its index (bounded either way)."""
        return self.name or str(self.index)

    @property
    def key(self) -> str:
        return f"policy.rules[{self.index}]"


@dataclass(frozen=True)
class PolicySettings:
    """``[policy]``: which releases clients may have (docs/architecture.md, "Release
    policy"). The defaults hold nothing back."""

    cooldown_s: float = 0.0
    mode: str = DEFAULT_POLICY_MODE
    unknown_publish_time: str = DEFAULT_UNKNOWN_PUBLISH_TIME
    exclude_newer_ms: int | None = None  # nothing published after this (Unix ms)
    rules: tuple[PolicyRule, ...] = ()


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    workers: int
    database_url: str
    storage_path: Path
    upstream: UpstreamSettings
    leases: LeaseSettings
    jobs: JobSettings
    repositories: tuple[RepositorySettings[Any], ...]
    source: str = "embedded defaults"
    storage: StorageSettings = field(default_factory=StorageSettings)
    mirrors: tuple[MirrorSettings, ...] = ()
    # Where clients reach the proxy (behind a load balancer); None: the request's Host.
    public_url: str | None = None
    # Peers whose X-Forwarded-For names the client (a load balancer): the address that
    # logs and wrong-password throttles judge a request by.
    trusted_proxies: tuple[str, ...] = DEFAULT_TRUSTED_PROXIES
    access_log: bool = DEFAULT_ACCESS_LOG
    log_format: str = DEFAULT_LOG_FORMAT
    tls: TlsSettings | None = None
    admin: AdminSettings = field(default_factory=AdminSettings)
    object_storage: ObjectStorageSettings | None = None  # None: blobs in storage_path
    # The relay (object storage only): the internal listener that serves in-flight
    # downloads to other replicas, and the URL they reach it at (None: derived).
    relay_host: str | None = None  # None: the public listen host
    relay_port: int = 0  # 0: any free port
    relay_url: str | None = None

    @property
    def base_url(self) -> str:
        """This proxy's own address as clients would type it (for messages and the
        console's install guide): ``server.public_url`` when a deployment sets it."""
        if self.public_url is not None:
            return self.public_url
        scheme = "https" if self.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)

    def repository(self, name: str) -> RepositorySettings[Any] | None:
        for repo in self.repositories:
            if repo.name == name:
                return repo
        return None

    def describe(self) -> str:
        """The effective settings as TOML, for ``check-config``: redacted as a whole
        (credentials in URLs, passwords), like everything that leaves the process."""
        lines = [
            f"# effective settings from {self.source}",
            "[server]",
            f"listen = {toml_string(f'{self.host}:{self.port}')}",
            f"workers = {self.workers}",
            f"access_log = {'true' if self.access_log else 'false'}",
            f"log_format = {toml_string(self.log_format)}",
            *(
                [
                    f"tls_cert = {toml_string(str(self.tls.cert))}",
                    f"tls_key = {toml_string(str(self.tls.key))}",
                ]
                if self.tls is not None
                else ["# tls_cert and tls_key are not set: plain HTTP"]
            ),
            (
                f"public_url = {toml_string(self.public_url)}"
                if self.public_url is not None
                else "# public_url is not set: URLs back to the proxy use each request's Host"
            ),
            f"trusted_proxies = {Networks().render(self.trusted_proxies)}",
            *_relay_keys(self),
            "[database]",
            f"url = {toml_string(self.database_url)}",
            (
                f"session_url = {toml_string(self.database.session_url)}"
                if self.database.session_url is not None
                else "# session_url is not set: the session connection uses url"
            ),
            f"pool_size = {self.database.pool_size}",
            f'idle_timeout = "{format_duration(self.database.idle_timeout_s)}"',
            "[storage]",
            f"path = {toml_string(str(self.storage_path))}",
            *_object_storage_keys(self.object_storage),
            f'min_free = "{format_size(self.storage.min_free)}"',
            (
                f'max_size = "{format_size(self.storage.max_size)}"'
                if self.storage.max_size is not None
                else "# max_size is not set: proxied entries are never evicted by size"
            ),
            f"low_watermark = {Percent().render(self.storage.low_watermark)}",
            f"verify_reads = {'true' if self.storage.verify_reads else 'false'}",
            f'scrub_rate = "{format_size(self.storage.scrub_rate)}/s"',
            *_object_storage_table(self.object_storage),
            "[upstream]",
            f'connect_timeout = "{format_duration(self.upstream.connect_timeout_s)}"',
            f'read_timeout = "{format_duration(self.upstream.read_timeout_s)}"',
            f'transfer_timeout = "{format_duration(self.upstream.transfer_timeout_s)}"',
            f'min_rate = "{format_size(self.upstream.min_rate)}/s"',
            f'min_rate_window = "{format_duration(self.upstream.min_rate_window_s)}"',
            f"retries = {self.upstream.retries}",
            f"max_connections = {self.upstream.max_connections}",
            f'parse_timeout = "{format_duration(self.upstream.parse_timeout_s)}"',
            "[leases]",
            f'ttl = "{format_duration(self.leases.ttl_s)}"',
            f'poll_interval = "{format_duration(self.leases.poll_interval_s)}"',
            f'retention = "{format_duration(self.leases.retention_s)}"',
            f"notify = {'true' if self.leases.notify else 'false'}",
            "[jobs]",
            f'reclaim_interval = "{format_duration(self.jobs.reclaim_interval_s)}"',
            f'sweep_interval = "{format_duration(self.jobs.sweep_interval_s)}"',
            f'evict_interval = "{format_duration(self.jobs.evict_interval_s)}"',
            f'retention_interval = "{format_duration(self.jobs.retention_interval_s)}"',
            f'evict_grace = "{format_duration(self.jobs.evict_grace_s)}"',
            f'scrub_interval = "{format_duration(self.jobs.scrub_interval_s)}"',
            *self.policy_lines(),
        ]
        lines += ["[admin]", f"anonymous = {toml_string(self.admin.anonymous)}"]
        if not self.admin.users:
            lines.append("# no [admin.users]: /ui/ and /api/ answer 403 (read-only on loopback")
            lines.append("# with the embedded defaults)")
        for user in self.admin.users:
            secrets = []
            if user.password_sha256 is not None:
                secrets.append('password = "***"')
            if user.token_sha256 is not None:
                secrets.append('token = "***"')
            lines.append(f"users.{toml_key(user.name)} = {{ {', '.join(secrets)} }}")
        for repo in self.repositories:
            lines += ["", "[[repositories]]", f'name = "{repo.name}"', f'format = "{repo.format}"']
            if repo.proxies and repo.upstreams:
                lines.append(f"upstream = {Urls().render(repo.upstreams)}")
            elif repo.proxies:
                lines.append(f"# upstream is not set: set {repo.upstream_setting}")
            for field_name, declared, _default in options_of(type(repo.options)):
                value = getattr(repo.options, field_name)
                if value is not None:
                    for line in _render(declared.key, declared.kind.render(value)):
                        lines.append(line)
            if repo.proxies:
                lines.append(f"allow_hosts = {Hosts().render(repo.allow_hosts)}")
            if repo.retention_s is not None:
                lines.append(f'retention = "{format_duration(repo.retention_s)}"')
            if repo.proxies:
                lines.append(f'max_file_size = "{format_size(repo.max_file_size)}"')
            if repo.cooldown_s is not None:
                lines.append(f'cooldown = "{format_duration(repo.cooldown_s)}"')
        for mirror in self.mirrors:
            lines += [
                "",
                "[[mirrors]]",
                f"name = {toml_string(mirror.name)}",
                f'interval = "{format_duration(mirror.interval_s)}"',
                "packages = [" + ", ".join(toml_string(p) for p in mirror.packages) + "]",
            ]
            if mirror.sbom is not None:
                lines.append(f"sbom = {toml_string(str(mirror.sbom))}")
            lines.append(f"versions = {toml_string(mirror.versions)}")
            if mirror.repository is not None:
                lines.append(f"repository = {toml_string(mirror.repository)}")
        return redact("\n".join(lines)) + "\n"

    def policy_lines(self) -> list[str]:
        policy = self.policy
        lines = [
            "[policy]",
            f'cooldown = "{format_duration(policy.cooldown_s)}"',
            f"mode = {toml_string(policy.mode)}",
            f"unknown_publish_time = {toml_string(policy.unknown_publish_time)}",
            (
                f"exclude_newer = {toml_string(format_timestamp(policy.exclude_newer_ms))}"
                if policy.exclude_newer_ms is not None
                else "# exclude_newer is not set: no absolute cut-off"
            ),
        ]
        for rule in policy.rules:
            lines += ["[[policy.rules]]", f"match = {toml_string(rule.match)}"]
            if rule.versions is not None:
                lines.append(f"versions = {toml_string(rule.versions)}")
            if rule.action is not None:
                lines.append(f"action = {toml_string(rule.action)}")
            if rule.cooldown_s is not None:
                lines.append(f'cooldown = "{format_duration(rule.cooldown_s)}"')
            if rule.reason is not None:
                lines.append(f"reason = {toml_string(rule.reason)}")
            if rule.name is not None:
                lines.append(f"name = {toml_string(rule.name)}")
        return lines


def _relay_keys(settings: Settings) -> list[str]:
    if settings.object_storage is None:
        return []
    host = settings.relay_host if settings.relay_host is not None else settings.host
    lines = [f"relay_listen = {toml_string(f'{host}:{settings.relay_port}')}"]
    if settings.relay_url is not None:
        lines.append(f"relay_url = {toml_string(settings.relay_url)}")
    else:
        lines.append("# relay_url is not set: derived from the relay's bound address")
    return lines


def _object_storage_keys(s3: ObjectStorageSettings | None) -> list[str]:
    if s3 is None:
        return []
    return [
        f"url = {toml_string(s3.url)}",
        f"local_cache = {toml_string(str(s3.local_cache))}",
        f'local_cache_max_size = "{format_size(s3.local_cache_max_size)}"',
    ]


def _object_storage_table(s3: ObjectStorageSettings | None) -> list[str]:
    if s3 is None:
        return []
    table = ["[storage.s3]"]
    if s3.endpoint is not None:
        table.append(f"endpoint = {toml_string(s3.endpoint)}")
    if s3.region is not None:
        table.append(f"region = {toml_string(s3.region)}")
    table.append(f"path_style = {'true' if s3.path_style else 'false'}")
    if s3.redirect_min_size is not None:
        table.append(f'redirect_min_size = "{format_size(s3.redirect_min_size)}"')
    else:
        table.append("# redirect_min_size is not set: hits are never redirected")
    return table


def _render(key: str, rendered: str) -> list[str]:
    # Tables (e.g. build-cache users) render as several "key.sub = ..." lines, or none.
    if not rendered or rendered.startswith(f"{key}."):
        return rendered.splitlines()
    return [f"{key} = {rendered}"]


def upstream_env_var(repo_name: str) -> str:
    return "PROXY_UPSTREAM_" + re.sub(r"[^A-Za-z0-9]", "_", repo_name).upper()
