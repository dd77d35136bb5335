"""Loading settings: TOML file (or embedded defaults) + environment -> ``Settings``.

``load(path, environ)`` is the only place that reads the environment. It walks every
table and key, collecting errors instead of stopping at the first, so an operator sees
every bad key at once; each error names its key (``repositories.pypi.metadata_ttl: ...``).
A repository's keys are validated generically from the options its format declares
(``proxy/config/options.py``); this module knows no format by name.
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy import formats
from proxy.config.options import (
    Choice,
    Duration,
    Flag,
    Hosts,
    Integer,
    Networks,
    OptionalSize,
    OptionType,
    Percent,
    PublicUrl,
    Rate,
    Size,
    Text,
    Timestamp,
    Urls,
    options_of,
)
from proxy.config.settings import (
    ADMIN_ANONYMOUS,
    DEFAULT_ACCESS_LOG,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_EVICT_GRACE_S,
    DEFAULT_EVICT_INTERVAL_S,
    DEFAULT_LEASE_POLL_INTERVAL_S,
    DEFAULT_LEASE_RETENTION_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LISTEN,
    DEFAULT_LOCAL_CACHE_MAX_SIZE,
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOW_WATERMARK,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_FILE_SIZE,
    DEFAULT_MIN_FREE,
    DEFAULT_MIN_RATE,
    DEFAULT_MIN_RATE_WINDOW_S,
    DEFAULT_MIRROR_INTERVAL_S,
    DEFAULT_MIRROR_VERSIONS,
    DEFAULT_PARSE_TIMEOUT_S,
    DEFAULT_POLICY_MODE,
    DEFAULT_POOL_IDLE_TIMEOUT_S,
    DEFAULT_POOL_SIZE,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_RECLAIM_INTERVAL_S,
    DEFAULT_RETENTION_INTERVAL_S,
    DEFAULT_RETRIES,
    DEFAULT_SCRUB_INTERVAL_S,
    DEFAULT_SCRUB_RATE,
    DEFAULT_STORAGE_PATH,
    DEFAULT_SWEEP_INTERVAL_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    DEFAULT_TRUSTED_PROXIES,
    DEFAULT_UNKNOWN_PUBLISH_TIME,
    DEFAULT_WORKERS,
    LOG_FORMATS,
    MIRROR_VERSIONS,
    POLICY_MODES,
    RULE_ACTIONS,
    UNKNOWN_PUBLISH_TIMES,
    AdminSettings,
    AdminUser,
    DatabaseSettings,
    JobSettings,
    LeaseSettings,
    MirrorSettings,
    ObjectStorageSettings,
    PolicyRule,
    PolicySettings,
    RepositorySettings,
    Settings,
    StorageSettings,
    TlsSettings,
    UpstreamSettings,
    upstream_env_var,
)
from proxy.contract import ENGINE_REPOSITORY_KEYS, RELEASE_REPOSITORY_KEYS, FormatPlugin
from proxy.exceptions import ConfigError, InvalidPlugin
from proxy.mirror.purls import parse_purl
from proxy.policy.rules import parse_match, parse_versions
from proxy.redaction import redact_url
from proxy.upstream.ssrf import relay_url_problem

RETENTION = Duration(positive=True)
SCRUB_RATE_MIN = 2**20  # bytes per second: storage.scrub_rate's floor
# First path segments the proxy answers itself (a repository cannot be named so).
RESERVED_NAMES = frozenset({"healthz", "readyz", "metrics", "favicon.ico", "ui", "api"})
_REPO_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_RULE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RULE_KEYS = frozenset({"match", "versions", "action", "cooldown", "reason", "name"})
_ENV_REF_RE = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)\})")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# What botocore accepts as a region (botocore.utils.validate_region_name); anything
# else raised while the client was made, a traceback at start.
_REGION_RE = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$")


def _usable_endpoint(endpoint: str) -> bool:
    """An S3 endpoint botocore can send to. urlsplit and its port raise on some (a
    traceback at load); a query or fragment has no place in a URL keys are joined to."""
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 (raises ValueError when out of range or not a number)
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and not parts.username
        and not parts.query
        and not parts.fragment
        and "?" not in endpoint
        and "#" not in endpoint
    )


@dataclass(frozen=True)
class Needs:
    """The settings a command reads. A ``${VAR}`` anywhere else may stay unset (its
    value is then empty, and never used): ``proxy mirror`` must not need the build
    cache's password. ``sections`` None: every section (``serve``, ``check-config``).
    ``repositories``: "all", "mirrors" (those whose format mirrors purls) or "none"."""

    sections: frozenset[str] | None = None
    repositories: str = "all"

    def wants(self, key: str, repository_format: str | None) -> bool:
        section = key.split(".", 1)[0].split("[", 1)[0]
        if section == "repositories":
            if self.repositories == "mirrors":
                return (
                    repository_format is not None
                    and formats.plugin(repository_format).mirroring is not None
                )
            return self.repositories == "all"
        return self.sections is None or section in self.sections


EVERYTHING = Needs()


EMBEDDED_DEFAULTS = "embedded defaults"  # the source of settings read from no file


def load(
    path: str | os.PathLike[str] | None, environ: Mapping[str, str], needs: Needs = EVERYTHING
) -> Settings:
    """Read the TOML file (or the embedded defaults), apply the environment, validate.

    Raises ``ConfigError`` listing every bad key, each once.
    """
    if path is None:
        path = environ.get("PROXY_CONFIG") or None
    if path is None:
        raw: dict[str, Any] = {}
        source = EMBEDDED_DEFAULTS
    else:
        source = str(path)
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError([f"config file {source}: not found"]) from None
        except OSError as exc:
            raise ConfigError([f"config file {source}: cannot be read ({exc.strerror})"]) from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"config file {source}: not valid TOML ({exc})"]) from exc
        except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib does not say it politely
            raise ConfigError(
                [f"config file {source}: not UTF-8 text (byte {exc.start}); save it as UTF-8"]
            ) from exc
    parser = _Parser(environ, needs)
    settings = parser.settings(raw, source)
    if parser.errors:
        raise ConfigError(parser.errors)
    assert settings is not None
    return settings


def object_storage_target(
    url: str,
    environ: Mapping[str, str],
    endpoint: str | None = None,
    region: str | None = None,
    path_style: bool = False,
) -> ObjectStorageSettings:
    """The bucket an ``s3://bucket/prefix/`` URL and ``[storage.s3]``-like options name
    (``proxy storage copy --to``), validated like the config's; ``ConfigError`` if bad."""
    s3: dict[str, Any] = {"path_style": path_style}
    if endpoint is not None:
        s3["endpoint"] = endpoint
    if region is not None:
        s3["region"] = region
    parser = _Parser({k: v for k, v in environ.items() if k != "PROXY_STORAGE_URL"})
    table = {"url": url, "local_cache": "/nonexistent", "s3": s3}
    if not url.startswith("s3://"):
        parser.error("--to", f"{url!r} is not an s3://BUCKET/PREFIX/ URL")
        raise ConfigError(parser.errors)
    target, _folder = parser.storage_url(table, EMBEDDED_DEFAULTS)
    if parser.errors or target is None:
        flags = {"storage.url": "--to", "storage.s3.endpoint": "--endpoint"}
        flags["storage.s3.region"] = "--region"
        errors = parser.errors
        for key, flag in flags.items():
            errors = [e.replace(f"{key}:", f"{flag}:", 1) for e in errors]
        raise ConfigError(errors)
    return target


def default_repositories(listen_host: str) -> list[dict[str, Any]]:
    """What runs with no [[repositories]]: each format's default repository, if it has one
    (for this listen host: a format may offer less to every address than to loopback)."""
    found = []
    for plugin in map(formats.plugin, formats.REGISTRY):
        default = plugin.default_repository
        if callable(default):
            default = default(listen_host)
        if default is not None:
            found.append(dict(default))
    return found


class _Parser:
    """Walks the raw TOML tree; implements ``options.Reporter`` for the option types."""

    def __init__(self, environ: Mapping[str, str], needs: Needs = EVERYTHING) -> None:
        self.environ = environ
        self.needs = needs
        self.errors: list[str] = []
        # Keys whose ${VAR} is unset: that is their one error (an empty value would
        # otherwise be reported again as "must not be empty"), or none if not needed.
        self.unset_keys: set[str] = set()
        self.repository_format: str | None = None  # of the repository being parsed

    def error(self, key: str, message: str) -> None:
        if key not in self.unset_keys:
            self.errors.append(f"{key}: {message}")

    def expand(self, value: str, key: str) -> str:
        def replace(match: re.Match[str]) -> str:
            if match.group(1) == "$":
                return "$"
            var = match.group(2)
            if var not in self.environ:
                if self.needs.wants(key, self.repository_format):
                    self.error(key, f"environment variable {var} is not set")
                self.unset_keys.add(key)
                return ""
            return self.environ[var]

        return _ENV_REF_RE.sub(replace, value)

    def settings(self, raw: dict[str, Any], source: str) -> Settings | None:
        known = {
            "server", "database", "storage", "upstream", "leases", "jobs", "repositories",
            "mirrors", "admin", "policy",
        }  # fmt: skip
        for key in raw:
            if key not in known:
                self.error(key, f"unknown section; expected one of {', '.join(sorted(known))}")
        server = self.table(
            raw,
            "server",
            {
                "listen", "workers", "access_log", "log_format", "tls_cert", "tls_key",
                "public_url", "trusted_proxies", "relay_listen", "relay_url",
            },
        )  # fmt: skip
        database = self.table(raw, "database", {"url", "session_url", "pool_size", "idle_timeout"})
        storage = self.table(
            raw,
            "storage",
            {
                "path", "url", "local_cache", "local_cache_max_size", "s3", "min_free",
                "max_size", "low_watermark", "verify_reads", "scrub_rate",
            },
        )  # fmt: skip
        upstream = self.table(
            raw,
            "upstream",
            {
                "connect_timeout",
                "read_timeout",
                "transfer_timeout",
                "min_rate",
                "min_rate_window",
                "retries",
                "max_connections",
                "parse_timeout",
            },
        )
        leases = self.table(raw, "leases", {"ttl", "poll_interval", "retention", "notify"})
        jobs = self.table(
            raw,
            "jobs",
            {
                "reclaim_interval", "sweep_interval", "evict_interval", "retention_interval",
                "evict_grace", "scrub_interval",
            },
        )  # fmt: skip

        listen = self.environ.get("PROXY_LISTEN") or self.value(server, "server", "listen", Text())
        host, port = self.listen(listen or DEFAULT_LISTEN, "server.listen")
        workers = self.value(server, "server", "workers", Integer(1, 256), DEFAULT_WORKERS)
        access_log = self.value(server, "server", "access_log", Flag(), DEFAULT_ACCESS_LOG)
        log_format = self.value(
            server, "server", "log_format", Choice(*LOG_FORMATS), DEFAULT_LOG_FORMAT
        )
        tls = self.tls(server, source)
        public_url = self.value(server, "server", "public_url", PublicUrl())
        if self.environ.get("PROXY_PUBLIC_URL"):
            public_url = PublicUrl().parse(
                self.environ["PROXY_PUBLIC_URL"].replace("$", "$$"), "PROXY_PUBLIC_URL", self
            )
        trusted_proxies = self.value(
            server, "server", "trusted_proxies", Networks(), DEFAULT_TRUSTED_PROXIES
        )
        relay_host, relay_port = None, 0
        relay_listen = self.value(server, "server", "relay_listen", Text())
        if relay_listen:
            relay_host, relay_port = self.listen(relay_listen, "server.relay_listen")
        relay_url = self.value(server, "server", "relay_url", Text())
        if relay_url:
            problem = relay_url_problem(relay_url)
            if problem is not None:
                self.error(
                    "server.relay_url",
                    f"{relay_url!r} {problem}; use http://HOST:PORT, e.g. "
                    '"http://${POD_IP}:9091"',
                )
            elif not relay_listen or relay_port == 0:
                self.error(
                    "server.relay_url",
                    "needs server.relay_listen with a fixed port (the port the URL reaches)",
                )

        storage_path = self.environ.get("PROXY_STORAGE_PATH") or self.value(
            storage, "storage", "path", Text()
        )
        storage_path = storage_path or DEFAULT_STORAGE_PATH
        object_storage, folder = self.storage_url(storage, source)
        if folder is not None:
            storage_path = folder
        database_url = self.environ.get("PROXY_DATABASE_URL") or self.value(
            database, "database", "url", Text()
        )
        database_url = database_url or f"sqlite:///{Path(storage_path) / 'proxy.db'}"
        self.database_url(database_url, "database.url")
        database_settings = self.database(database, database_url)

        # The shortest values that can work (shorter ones fail every request or lease).
        network = Duration(minimum_s=0.1, why="a network round trip takes that long")
        interval = Duration(minimum_s=1.0, why="a pass would start before the last one ends")
        upstream_settings = UpstreamSettings(
            connect_timeout_s=self.value(
                upstream, "upstream", "connect_timeout", network, DEFAULT_CONNECT_TIMEOUT_S
            ),
            read_timeout_s=self.value(
                upstream, "upstream", "read_timeout", network, DEFAULT_READ_TIMEOUT_S
            ),
            retries=self.value(upstream, "upstream", "retries", Integer(0, 10), DEFAULT_RETRIES),
            max_connections=self.value(
                upstream,
                "upstream",
                "max_connections",
                Integer(1, 100_000),
                DEFAULT_MAX_CONNECTIONS,
            ),
            transfer_timeout_s=self.value(
                upstream,
                "upstream",
                "transfer_timeout",
                Duration(minimum_s=1.0, why="a transfer is a head and a body"),
                DEFAULT_TRANSFER_TIMEOUT_S,
            ),
            min_rate=self.value(upstream, "upstream", "min_rate", Rate(), DEFAULT_MIN_RATE),
            min_rate_window_s=self.value(
                upstream, "upstream", "min_rate_window", network, DEFAULT_MIN_RATE_WINDOW_S
            ),
            parse_timeout_s=self.value(
                upstream, "upstream", "parse_timeout", network, DEFAULT_PARSE_TIMEOUT_S
            ),
        )
        if upstream_settings.transfer_timeout_s < upstream_settings.read_timeout_s:
            self.error(
                "upstream.transfer_timeout", "must not be shorter than upstream.read_timeout"
            )
        lease_settings = LeaseSettings(
            ttl_s=self.value(
                leases,
                "leases",
                "ttl",
                Duration(minimum_s=1.0, why="it is renewed every ttl/3, a database round trip"),
                DEFAULT_LEASE_TTL_S,
            ),
            poll_interval_s=self.value(
                leases,
                "leases",
                "poll_interval",
                Duration(minimum_s=0.01, why="every waiter asks the database this often"),
                DEFAULT_LEASE_POLL_INTERVAL_S,
            ),
            retention_s=self.value(
                leases, "leases", "retention", Duration(), DEFAULT_LEASE_RETENTION_S
            ),
            notify=self.value(leases, "leases", "notify", Flag(), True),
        )
        if lease_settings.poll_interval_s > lease_settings.ttl_s:
            self.error("leases.poll_interval", "must not be longer than leases.ttl")
        job_settings = JobSettings(
            reclaim_interval_s=self.value(
                jobs, "jobs", "reclaim_interval", interval, DEFAULT_RECLAIM_INTERVAL_S
            ),
            sweep_interval_s=self.value(
                jobs, "jobs", "sweep_interval", interval, DEFAULT_SWEEP_INTERVAL_S
            ),
            evict_interval_s=self.value(
                jobs, "jobs", "evict_interval", interval, DEFAULT_EVICT_INTERVAL_S
            ),
            retention_interval_s=self.value(
                jobs, "jobs", "retention_interval", interval, DEFAULT_RETENTION_INTERVAL_S
            ),
            evict_grace_s=self.value(
                jobs, "jobs", "evict_grace", Duration(), DEFAULT_EVICT_GRACE_S
            ),
            scrub_interval_s=self.value(
                jobs, "jobs", "scrub_interval", interval, DEFAULT_SCRUB_INTERVAL_S
            ),
        )
        storage_settings = StorageSettings(
            max_size=self.value(storage, "storage", "max_size", OptionalSize()),
            low_watermark=self.value(
                storage, "storage", "low_watermark", Percent(), DEFAULT_LOW_WATERMARK
            ),
            min_free=self.value(storage, "storage", "min_free", Size(), DEFAULT_MIN_FREE),
            verify_reads=self.value(storage, "storage", "verify_reads", Flag(), False),
            scrub_rate=self.value(
                storage,
                "storage",
                "scrub_rate",
                Rate(minimum=SCRUB_RATE_MIN, why="a round over a few TB would take a year"),
                DEFAULT_SCRUB_RATE,
            ),
        )

        admin = self.admin(raw)

        raw_repos = raw.get("repositories")
        if raw_repos is None:
            raw_repos = default_repositories(host)
        if not isinstance(raw_repos, list):
            self.error("repositories", "must be an array of tables ([[repositories]])")
            raw_repos = []
        repositories: list[RepositorySettings[Any]] = []
        seen: set[str] = set()
        env_vars: dict[str, str] = {}
        for index, raw_repo in enumerate(raw_repos):
            repo = self.repository(raw_repo, index)
            if repo is None:
                continue
            if repo.name in seen:
                self.error(f"repositories.{repo.name}.name", "is used by two repositories")
            seen.add(repo.name)
            env_var = upstream_env_var(repo.name)
            if repo.proxies and env_var in env_vars:
                self.error(
                    f"repositories.{repo.name}.name",
                    f"its upstream variable {env_var} is also that of repository "
                    f"{env_vars[env_var]!r}; rename one of them",
                )
            env_vars.setdefault(env_var, repo.name)
            repositories.append(repo)
        mirrors = self.mirrors(raw.get("mirrors", []), repositories, source)
        policy = self.policy(raw)

        if self.errors:
            return None
        return Settings(
            host=host,
            port=port,
            workers=workers,
            database_url=database_url,
            storage_path=Path(storage_path),
            upstream=upstream_settings,
            leases=lease_settings,
            jobs=job_settings,
            repositories=tuple(repositories),
            source=source,
            storage=storage_settings,
            mirrors=mirrors,
            access_log=access_log,
            log_format=log_format,
            tls=tls,
            database=database_settings,
            public_url=public_url,
            trusted_proxies=trusted_proxies,
            admin=admin,
            object_storage=object_storage,
            relay_host=relay_host,
            relay_port=relay_port,
            relay_url=relay_url or None,
            policy=policy,
        )

    def database(self, database: dict[str, Any], database_url: str) -> DatabaseSettings:
        session_url = self.environ.get("PROXY_DATABASE_SESSION_URL") or self.value(
            database, "database", "session_url", Text()
        )
        if session_url:
            if database_url.startswith("sqlite:"):
                self.error(
                    "database.session_url",
                    "is for a Postgres fleet; database.url is a SQLite file",
                )
            elif self.database_url(session_url, "database.session_url"):
                self.error(
                    "database.session_url",
                    f"{redact_url(session_url)!r}: must be a postgresql:// URL",
                )
        return DatabaseSettings(
            session_url=session_url or None,
            pool_size=self.value(
                database, "database", "pool_size", Integer(1, 1000), DEFAULT_POOL_SIZE
            ),
            idle_timeout_s=self.value(
                database,
                "database",
                "idle_timeout",
                Duration(minimum_s=1.0, why="a closed connection is made again for the next use"),
                DEFAULT_POOL_IDLE_TIMEOUT_S,
            ),
        )

    # -- storage ----------------------------------------------------------------------

    def storage_url(
        self, storage: dict[str, Any], source: str
    ) -> tuple[ObjectStorageSettings | None, str | None]:
        """``storage.url`` (or ``PROXY_STORAGE_URL``): the object storage it names, or
        the folder (a path or file:// URL) that replaces ``storage.path``."""
        key = "storage.url"
        url = self.environ.get("PROXY_STORAGE_URL")
        if url:
            key = "PROXY_STORAGE_URL"
        else:
            url = self.value(storage, "storage", "url", Text())
        s3_table = storage.get("s3", {})
        if not isinstance(s3_table, dict):
            self.error("storage.s3", "must be a table ([storage.s3])")
            s3_table = {}
        if not url or not url.startswith("s3://"):
            for name in ("local_cache", "local_cache_max_size"):
                if name in storage:
                    self.error(f"storage.{name}", "is only used with an s3:// storage.url")
            if s3_table:
                self.error("storage.s3", "is only used with an s3:// storage.url")
        if not url:
            return None, None
        scheme, sep, rest = url.partition("://")
        if not sep:
            return None, url  # a folder path
        if scheme == "file":
            if not rest.startswith("/") or rest == "/":
                self.error(key, f"{url!r} is not file:///ABSOLUTE/PATH")
                return None, None
            return None, rest
        if scheme != "s3":
            self.error(
                key,
                f"{url!r}: the scheme must be s3:// (a bucket), file:// or none (a folder); "
                'use e.g. "s3://artifacts/proxy/" or "./data"',
            )
            return None, None
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            self.error(
                key,
                f"{url!r}: {bucket!r} is not a bucket name (3 to 63 lower-case letters, "
                "digits, '.' or '-')",
            )
        prefix = prefix.strip("/")
        if prefix and (any(part in ("", ".", "..") for part in prefix.split("/"))):
            self.error(key, f"{url!r}: the prefix {prefix!r} has an empty, '.' or '..' part")
        if any(c in prefix for c in "\\?#") or not prefix.isprintable():
            self.error(key, f"{url!r}: the prefix may not contain '\\', '?', '#' or controls")
        local_cache = self.value(storage, "storage", "local_cache", Text())
        if not local_cache:
            self.error(
                "storage.local_cache",
                f"is required with an s3:// {key}: this replica's own folder for downloads "
                'in progress and its copies of blobs, e.g. "/var/cache/proxy"',
            )
        local_path = Path(local_cache or ".")
        if local_cache and not local_path.is_absolute() and source != EMBEDDED_DEFAULTS:
            local_path = Path(source).resolve().parent / local_path
        max_size = self.value(
            storage, "storage", "local_cache_max_size", Size(), DEFAULT_LOCAL_CACHE_MAX_SIZE
        )
        allowed = {"endpoint", "region", "path_style", "redirect_min_size"}
        for name in s3_table:
            if name not in allowed:
                self.error(
                    f"storage.s3.{name}",
                    f"unknown key; expected one of {', '.join(sorted(allowed))} "
                    "(credentials come from the AWS environment variables or shared files, "
                    "never from the config)",
                )
        endpoint = self.value(s3_table, "storage.s3", "endpoint", Text())
        if endpoint is not None and not _usable_endpoint(endpoint):
            self.error(
                "storage.s3.endpoint",
                f"{endpoint!r} is not an http:// or https:// URL without credentials, "
                'query or fragment, with a port up to 65535 (e.g. "http://127.0.0.1:8333")',
            )
        region = self.value(s3_table, "storage.s3", "region", Text())
        if region is not None and not _REGION_RE.match(region):
            self.error(
                "storage.s3.region",
                f"{region!r} is not a region name: letters, digits and '-' (e.g. \"us-east-1\")",
            )
        return (
            ObjectStorageSettings(
                bucket=bucket,
                prefix=f"{prefix}/" if prefix else "",
                local_cache=local_path,
                local_cache_max_size=max_size,
                endpoint=endpoint.rstrip("/") if endpoint else None,
                region=region,
                path_style=self.value(s3_table, "storage.s3", "path_style", Flag(), False),
                redirect_min_size=self.value(
                    s3_table, "storage.s3", "redirect_min_size", OptionalSize()
                ),
            ),
            None,
        )

    # -- repositories -------------------------------------------------------------

    def table_name(
        self,
        raw: object,
        where: str,
        what: str,
        reserved: frozenset[str] | set[str] = frozenset(),
        hint: str = "",
    ) -> str | None:
        """The ``name`` of a ``[[repositories]]``/``[[mirrors]]`` table, or None after
        recording why it has none that is valid."""
        if not isinstance(raw, dict):
            self.error(where, "must be a table")
            return None
        name: str | None = self.value(raw, where, "name", Text())
        if name is None:
            if "name" not in raw:
                self.error(f"{where}.name", "is required")
            return None
        if not _REPO_NAME_RE.match(name) or name in reserved:
            self.error(
                f"{where}.name",
                f"{name!r} is not a valid {what} name; use lower-case letters, digits, "
                f"'.', '_' or '-'{hint}",
            )
            return None
        return name

    def repository(self, raw: object, index: int) -> RepositorySettings[Any] | None:
        name = self.table_name(
            raw,
            f"repositories[{index}]",
            "repository",
            RESERVED_NAMES,
            " (it becomes the first path segment), not healthz/readyz/metrics/ui/api",
        )
        if name is None:
            return None
        assert isinstance(raw, dict)
        where = f"repositories.{name}"
        fmt = self.value(raw, where, "format", Text())
        if "format" not in raw:
            self.error(f"{where}.format", f"is required: one of {', '.join(formats.REGISTRY)}")
            return None
        if fmt not in formats.REGISTRY:
            self.error(f"{where}.format", f"{fmt!r} is not one of {', '.join(formats.REGISTRY)}")
            return None
        self.repository_format = fmt
        try:
            return self._repository_options(raw, name, where, fmt)
        finally:
            self.repository_format = None

    def _repository_options(
        self, raw: dict[str, Any], name: str, where: str, fmt: str
    ) -> RepositorySettings[Any] | None:
        try:
            plugin = formats.plugin(fmt)
        except InvalidPlugin as exc:
            self.error(f"{where}.format", f"cannot be used: {exc}")
            return None
        declared = list(options_of(plugin.options))
        allowed = {option.key for _, option, _ in declared} | {"name", "format"}
        is_proxy = plugin.proxying is not None
        if is_proxy:
            allowed |= set(ENGINE_REPOSITORY_KEYS)
        if plugin.releases is not None:
            allowed |= set(RELEASE_REPOSITORY_KEYS)
        for key in raw:
            if key not in allowed:
                self.error(
                    f"{where}.{key}",
                    f"unknown key for format {fmt!r}; expected one of {', '.join(sorted(allowed))}",
                )
        errors_before = len(self.errors)
        values: dict[str, Any] = {}
        for field_name, option, default in declared:
            value: object = raw.get(option.key)
            if value is None:
                values[field_name] = default
                continue
            parsed = option.kind.parse(value, f"{where}.{option.key}", self)
            values[field_name] = default if parsed is None else parsed
        upstreams: tuple[str, ...] = ()
        allow_hosts: tuple[str, ...] = ()
        retention_s = None
        max_file_size = DEFAULT_MAX_FILE_SIZE
        if is_proxy:
            upstreams = self.upstreams(raw, name, plugin)
            allow_hosts = self.value(raw, where, "allow_hosts", Hosts(), ())
            retention_s = self.value(raw, where, "retention", RETENTION)
            max_file_size = self.value(raw, where, "max_file_size", Size(), DEFAULT_MAX_FILE_SIZE)
        cooldown_s = None
        if plugin.releases is not None:
            cooldown_s = self.value(raw, where, "cooldown", Duration())
        if len(self.errors) > errors_before:
            return None
        options = plugin.options(**values)
        for key, message in (plugin.validate or _no_checks)(options):
            self.error(f"{where}.{key}", message)
        return RepositorySettings(
            name=name,
            format=fmt,
            options=options,
            proxies=is_proxy,
            upstreams=upstreams,
            allow_hosts=allow_hosts,
            retention_s=retention_s,
            max_file_size=max_file_size,
            cooldown_s=cooldown_s,
        )

    def upstreams(
        self, raw: dict[str, Any], name: str, plugin: FormatPlugin[Any, Any]
    ) -> tuple[str, ...]:
        """The upstream URLs of a proxying repository: ``PROXY_UPSTREAM_<NAME>`` (comma
        separated) wins over the ``upstream`` key; none yet is valid (the engine answers
        503 naming the setting until one is set)."""
        assert plugin.proxying is not None
        kind = Urls(max_count=plugin.proxying.max_upstreams)
        key = f"repositories.{name}.upstream"
        value: object = raw.get("upstream")
        env_var = upstream_env_var(name)
        if self.environ.get(env_var):
            key = env_var
            # Taken as written: "$" in an environment value is not a ${VAR} reference.
            value = [
                u.strip().replace("$", "$$") for u in self.environ[env_var].split(",") if u.strip()
            ]
        if value is None:
            return ()
        return kind.parse(value, key, self) or ()

    # -- the release policy ----------------------------------------------------------------

    def policy(self, raw: dict[str, Any]) -> PolicySettings:
        """``[policy]`` and its ``[[policy.rules]]`` (docs/architecture.md, "Release
        policy")."""
        table = self.table(
            raw, "policy", {"cooldown", "mode", "unknown_publish_time", "exclude_newer", "rules"}
        )
        raw_rules = table.get("rules", [])
        if not isinstance(raw_rules, list):
            self.error("policy.rules", "must be an array of tables ([[policy.rules]])")
            raw_rules = []
        judged = _judged_purl_types() if raw_rules else []
        rules = [self.policy_rule(rule, i, judged) for i, rule in enumerate(raw_rules)]
        names: dict[str, int] = {}
        for rule in rules:
            if rule is not None and rule.name is not None:
                if rule.name in names:
                    self.error(
                        f"{rule.key}.name",
                        f"{rule.name!r} is also the name of policy.rules[{names[rule.name]}]",
                    )
                names.setdefault(rule.name, rule.index)
        return PolicySettings(
            cooldown_s=self.value(table, "policy", "cooldown", Duration(), 0.0),
            mode=self.value(table, "policy", "mode", Choice(*POLICY_MODES), DEFAULT_POLICY_MODE),
            unknown_publish_time=self.value(
                table,
                "policy",
                "unknown_publish_time",
                Choice(*UNKNOWN_PUBLISH_TIMES),
                DEFAULT_UNKNOWN_PUBLISH_TIME,
            ),
            exclude_newer_ms=self.value(table, "policy", "exclude_newer", Timestamp()),
            rules=tuple(rule for rule in rules if rule is not None),
        )

    def policy_rule(self, raw: object, index: int, judged: list[str]) -> PolicyRule | None:
        where = f"policy.rules[{index}]"
        if not isinstance(raw, dict):
            self.error(where, "must be a table")
            return None
        for key in raw:
            if key not in RULE_KEYS:
                self.error(
                    f"{where}.{key}", f"unknown key; expected one of {', '.join(sorted(RULE_KEYS))}"
                )
        errors_before = len(self.errors)
        match: str | None = self.value(raw, where, "match", Text())
        purl_type: str | None = None
        if match is None:
            if "match" not in raw:
                self.error(f"{where}.match", 'is required: a package URL, e.g. "pkg:pypi/requests"')
        else:
            try:
                package, match = parse_match(match)
                purl_type = package[0]
            except ValueError as exc:
                self.error(f"{where}.match", str(exc))
            else:
                if purl_type not in judged:
                    self.error(
                        f"{where}.match",
                        f"{match!r}: the policy judges no {purl_type!r} packages; it judges "
                        f"{', '.join(judged) or 'none'}",
                    )
                    purl_type = None
        versions: str | None = self.value(raw, where, "versions", Text())
        if versions is not None and purl_type is not None:
            try:
                versions = str(parse_versions(versions, purl_type))
            except ValueError as exc:
                self.error(f"{where}.versions", str(exc))
        action = self.value(raw, where, "action", Choice(*RULE_ACTIONS))
        cooldown_s = self.value(raw, where, "cooldown", Duration())
        reason = self.value(raw, where, "reason", Text())
        name = self.value(raw, where, "name", Text())
        if name is not None and not _RULE_NAME_RE.match(name):
            self.error(
                f"{where}.name",
                f"{name!r} is not a rule name; use up to 64 letters, digits, '.', '_' or '-' "
                "(it becomes a metric label)",
            )
        if action is not None and cooldown_s is not None:
            self.error(
                f"{where}.cooldown",
                f'a rule with action = "{action}" has no cooldown; leave out one of them',
            )
        if action is None and cooldown_s is None and len(self.errors) == errors_before:
            self.error(where, 'needs an action ("allow" or "deny") or a cooldown')
        if len(self.errors) > errors_before:
            return None
        assert match is not None
        return PolicyRule(
            index=index,
            match=match,
            versions=versions,
            action=action,
            cooldown_s=cooldown_s,
            reason=reason,
            name=name,
        )

    # -- mirrors ------------------------------------------------------------------------

    def mirrors(
        self, raw: object, repositories: list[RepositorySettings[Any]], source: str
    ) -> tuple[MirrorSettings, ...]:
        if not isinstance(raw, list):
            self.error("mirrors", "must be an array of tables ([[mirrors]])")
            return ()
        found: list[MirrorSettings] = []
        for index, raw_mirror in enumerate(raw):
            mirror = self.mirror(raw_mirror, index, repositories, source)
            if mirror is None:
                continue
            if any(m.name == mirror.name for m in found):
                self.error(f"mirrors.{mirror.name}.name", "is used by two mirrors")
            found.append(mirror)
        return tuple(found)

    def mirror(
        self,
        raw: object,
        index: int,
        repositories: list[RepositorySettings[Any]],
        source: str,
    ) -> MirrorSettings | None:
        name = self.table_name(raw, f"mirrors[{index}]", "mirror")
        if name is None:
            return None
        assert isinstance(raw, dict)
        where = f"mirrors.{name}"
        allowed = {"name", "interval", "packages", "sbom", "versions", "repository"}
        for key in raw:
            if key not in allowed:
                self.error(
                    f"{where}.{key}", f"unknown key; expected one of {', '.join(sorted(allowed))}"
                )
        errors_before = len(self.errors)
        interval_s = self.value(
            raw, where, "interval", Duration(positive=True), DEFAULT_MIRROR_INTERVAL_S
        )
        versions = self.value(
            raw, where, "versions", Choice(*MIRROR_VERSIONS), DEFAULT_MIRROR_VERSIONS
        )
        sbom_text = self.value(raw, where, "sbom", Text())
        sbom = None
        if sbom_text:
            sbom = Path(sbom_text)
            if not sbom.is_absolute() and source != EMBEDDED_DEFAULTS:
                sbom = Path(source).resolve().parent / sbom  # beside the config file
        repository = self.value(raw, where, "repository", Text())
        mirrorable = {
            repo.name: mirroring.purl_types
            for repo in repositories
            if (mirroring := formats.plugin(repo.format).mirroring) is not None
        }
        if repository is not None and repository not in mirrorable:
            choices = ", ".join(mirrorable) or "none is configured"
            self.error(
                f"{where}.repository",
                f"{repository!r} is not a repository that can mirror packages ({choices})",
            )
        packages = self.packages(raw.get("packages", []), f"{where}.packages")
        for i, purl in enumerate(packages):
            purl_type = parse_purl(purl).type
            serving = [r for r, types in mirrorable.items() if purl_type in types]
            if repository is not None and repository in mirrorable:
                serving = [repository] if purl_type in mirrorable[repository] else []
            if not serving:
                self.error(
                    f"{where}.packages[{i}]",
                    f"{purl!r}: no repository here mirrors purl type {purl_type!r}"
                    + (f" (repository {repository!r} does not)" if repository else ""),
                )
        if not packages and sbom is None and "packages" not in raw:
            self.error(where, "needs packages (a list of purls) or sbom (a file)")
        if len(self.errors) > errors_before:
            return None
        return MirrorSettings(
            name=name,
            interval_s=interval_s,
            packages=packages,
            sbom=sbom,
            versions=versions,
            repository=repository,
        )

    def packages(self, raw: object, key: str) -> tuple[str, ...]:
        if not isinstance(raw, list):
            self.error(key, 'must be a list of package URLs, e.g. ["pkg:pypi/requests@2.32.3"]')
            return ()
        purls = []
        for i, item in enumerate(raw):
            if not isinstance(item, str):
                self.error(f"{key}[{i}]", f"{item!r} is not a package URL")
                continue
            try:
                purls.append(parse_purl(self.expand(item, f"{key}[{i}]")).purl)
            except ValueError as exc:
                self.error(f"{key}[{i}]", str(exc))
        return tuple(purls)

    # -- helpers ----------------------------------------------------------------------

    def table(self, raw: dict[str, Any], key: str, allowed: set[str]) -> dict[str, Any]:
        value = raw.get(key, {})
        if not isinstance(value, dict):
            self.error(key, "must be a table")
            return {}
        for sub in value:
            if sub not in allowed:
                self.error(
                    f"{key}.{sub}", f"unknown key; expected one of {', '.join(sorted(allowed))}"
                )
        return value

    def value(
        self,
        table: dict[str, Any],
        where: str,
        name: str,
        kind: OptionType[Any],
        default: Any = None,
    ) -> Any:
        """``table[name]`` parsed as ``kind``; ``default`` if absent or invalid (reported)."""
        if name not in table:
            return default
        parsed = kind.parse(table[name], f"{where}.{name}", self)
        return default if parsed is None else parsed

    def admin(self, raw: dict[str, Any]) -> AdminSettings:
        """``[admin]``: ``anonymous`` and ``[admin.users.<name>]`` with ``password`` or
        ``password_sha256`` (Basic auth), and optionally ``token`` or ``token_sha256``."""
        table = self.table(raw, "admin", {"anonymous", "users"})
        anonymous = self.value(table, "admin", "anonymous", Choice(*ADMIN_ANONYMOUS), "none")
        users: list[AdminUser] = []
        raw_users = table.get("users", {})
        if not isinstance(raw_users, dict):
            self.error("admin.users", "must be a table of users: [admin.users.NAME]")
            raw_users = {}
        for name, raw_user in raw_users.items():
            key = f"admin.users.{name}"
            if not isinstance(raw_user, dict):
                self.error(key, "must be a table with password (or password_sha256)")
                continue
            if not name or ":" in name or not name.isprintable():
                self.error(key, "a user name must not be empty or contain ':'")
                continue
            allowed = {"password", "password_sha256", "token", "token_sha256"}
            for sub in raw_user:
                if sub not in allowed:
                    self.error(
                        f"{key}.{sub}", f"unknown key; expected one of {', '.join(sorted(allowed))}"
                    )
            errors_before = len(self.errors)
            password = self.secret(raw_user, key, "password")
            token = self.secret(raw_user, key, "token")
            reported = len(self.errors) > errors_before or f"{key}.password" in self.unset_keys
            if password is None and token is None and not reported:
                self.error(f"{key}.password", "is required (or password_sha256, or a token)")
            users.append(AdminUser(name=name, password_sha256=password, token_sha256=token))
        return AdminSettings(anonymous=anonymous, users=tuple(users))

    def secret(self, raw_user: dict[str, Any], key: str, name: str) -> str | None:
        """``name`` (plain, hashed here) or ``name_sha256`` (64 hex digits): its digest."""
        plain = self.value(raw_user, key, name, Text())
        hashed = self.value(raw_user, key, f"{name}_sha256", Text())
        if plain is not None and hashed is not None:
            self.error(f"{key}.{name}", f"set {name} or {name}_sha256, not both")
            return None
        if hashed is not None:
            if not re.fullmatch(r"[0-9a-fA-F]{64}", hashed):
                self.error(
                    f"{key}.{name}_sha256",
                    "is not a SHA-256 digest (64 hex digits; e.g. from "
                    "`printf %s PASSWORD | sha256sum`)",
                )
                return None
            return str(hashed).lower()
        if plain is None:
            return None
        if not plain:
            self.error(f"{key}.{name}", "must not be empty")
            return None
        return hashlib.sha256(plain.encode()).hexdigest()

    def tls(self, server: dict[str, Any], source: str) -> TlsSettings | None:
        """``tls_cert`` and ``tls_key``, both or neither; the pair must load (a wrong
        key, an encrypted key or a file that is not PEM is named here, not at the first
        client's handshake). Paths are relative to the config file."""
        cert = self.value(server, "server", "tls_cert", Text())
        key = self.value(server, "server", "tls_key", Text())
        if not cert and not key:
            return None
        if not cert or not key:
            missing, given = ("tls_key", "tls_cert") if cert else ("tls_cert", "tls_key")
            self.error(f"server.{missing}", f"is required when server.{given} is set")
            return None
        base = Path(source).resolve().parent if source != EMBEDDED_DEFAULTS else Path.cwd()
        paths = {}
        for name, text in (("tls_cert", cert), ("tls_key", key)):
            path = Path(text) if Path(text).is_absolute() else base / text
            if path.is_dir():
                self.error(f"server.{name}", f"{text!r} is a folder, not a PEM file")
            elif not path.is_file():
                self.error(f"server.{name}", f"{text!r}: no such file")
            paths[name] = path
        if not all(path.is_file() for path in paths.values()):
            return None
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(paths["tls_cert"], paths["tls_key"], password=_no_password)
        except (ssl.SSLError, OSError, ValueError) as exc:
            self.error(
                "server.tls_cert",
                f"{cert!r} with server.tls_key {key!r} cannot be loaded ({exc}); use a PEM "
                "certificate and its unencrypted PEM private key",
            )
            return None
        return TlsSettings(cert=paths["tls_cert"], key=paths["tls_key"])

    def listen(self, value: str, key: str) -> tuple[str, int]:
        host, sep, port_text = value.rpartition(":")
        host = host.strip("[]")
        digits = port_text.isascii() and port_text.isdigit()  # isdigit alone takes "²", "٣"
        if not sep or not host or not digits or not 0 <= int(port_text) <= 65535:
            self.error(key, f'{value!r} is not HOST:PORT; use e.g. "127.0.0.1:8080"')
            return "127.0.0.1", 8080
        return host, int(port_text)

    def database_url(self, value: str, key: str) -> bool:
        """Check a database URL (errors name ``key``); True if it is a SQLite one."""
        scheme = value.split(":", 1)[0]
        if scheme == "sqlite":
            if not value.startswith("sqlite:///") or value == "sqlite:///":
                self.error(key, f"{value!r} is not sqlite:///PATH (e.g. sqlite:///./data/proxy.db)")
            return True
        elif scheme in ("postgresql", "postgres"):
            try:
                hostname = urlsplit(value).hostname
            except ValueError:
                hostname = None
            if not hostname and "host=" not in value:
                self.error(key, f"{redact_url(value)!r} has no host")
        else:
            self.error(
                key,
                f"{redact_url(value)!r}: the scheme must be sqlite:/// or postgresql://",
            )
        return False


def _judged_purl_types() -> list[str]:
    """The purl types of the formats whose releases the policy judges (a format that
    cannot be loaded judges none: its repositories report why)."""
    types = set()
    for name in formats.REGISTRY:
        try:
            releases = formats.plugin(name).releases
        except InvalidPlugin:
            continue
        if releases is not None:
            types.add(releases.purl_type)
    return sorted(types)


def _no_password() -> str:
    # An encrypted key would make OpenSSL prompt on the terminal; refuse it instead.
    raise ValueError("the private key is encrypted")


def _no_checks(options: object) -> list[tuple[str, str]]:
    return []
