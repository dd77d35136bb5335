"""Validation of the raw TOML tree into ``Settings`` (see ``config.load``).

Walks every table and key, collecting errors instead of stopping at the first, so an
operator sees every bad key at once; each error names its key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from proxy.config import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_LEASE_POLL_INTERVAL_S,
    DEFAULT_LEASE_RETENTION_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LISTEN,
    DEFAULT_MAVEN_METADATA_TTL_S,
    DEFAULT_MAVEN_NEGATIVE_TTL_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_ENTRY_SIZE,
    DEFAULT_METADATA_TTL_S,
    DEFAULT_NEGATIVE_TTL_S,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_RECLAIM_INTERVAL_S,
    DEFAULT_RETRIES,
    DEFAULT_SNAPSHOT_TTL_S,
    DEFAULT_STORAGE_PATH,
    DEFAULT_SWEEP_INTERVAL_S,
    DEFAULT_WORKERS,
    JobSettings,
    LeaseSettings,
    RepositorySettings,
    Settings,
    UpstreamSettings,
    User,
    hide_password,
    upstream_env_var,
)
from proxy.units import parse_duration, parse_size

T = TypeVar("T")

FORMATS = ("pypi", "maven", "gradle-build-cache")
ROLES = ("read", "write")
ANONYMOUS_ACCESS = ("none", "read", "write")
RESERVED_NAMES = frozenset({"healthz", "readyz", "metrics", "favicon.ico"})
_REPO_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_ENV_REF_RE = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)\})")

# Keys each format accepts besides name and format.
_FORMAT_KEYS = {
    "pypi": {"upstream", "metadata_ttl", "negative_ttl"},
    "maven": {"upstream", "metadata_ttl", "snapshot_ttl", "negative_ttl"},
    "gradle-build-cache": {"max_entry_size", "max_size", "anonymous", "users"},
}


def default_repositories() -> list[dict[str, Any]]:
    """What runs with no config file: one repository per format, upstreams unset."""
    return [
        {"name": "pypi", "format": "pypi"},
        {"name": "maven", "format": "maven"},
        {"name": "gradle-cache", "format": "gradle-build-cache", "anonymous": "write"},
    ]


class Parser:
    """Walks the raw TOML tree, collecting errors instead of stopping at the first."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.errors: list[str] = []

    def error(self, key: str, message: str) -> None:
        self.errors.append(f"{key}: {message}")

    def settings(self, raw: dict[str, Any], source: str) -> Settings | None:
        known = {"server", "database", "storage", "upstream", "leases", "jobs", "repositories"}
        for key in raw:
            if key not in known:
                self.error(key, f"unknown section; expected one of {', '.join(sorted(known))}")
        server = self.table(raw, "server", {"listen", "workers"})
        database = self.table(raw, "database", {"url"})
        storage = self.table(raw, "storage", {"path"})
        upstream = self.table(
            raw, "upstream", {"connect_timeout", "read_timeout", "retries", "max_connections"}
        )
        leases = self.table(raw, "leases", {"ttl", "poll_interval", "retention", "notify"})
        jobs = self.table(raw, "jobs", {"reclaim_interval", "sweep_interval"})

        listen = self.environ.get("PROXY_LISTEN") or self.string(server, "server.listen", "listen")
        host, port = self.listen(listen or DEFAULT_LISTEN, "server.listen")
        workers = self.integer(server, "server.workers", "workers", DEFAULT_WORKERS, minimum=1)

        storage_path = self.environ.get("PROXY_STORAGE_PATH") or self.string(
            storage, "storage.path", "path"
        )
        storage_path = storage_path or DEFAULT_STORAGE_PATH
        database_url = self.environ.get("PROXY_DATABASE_URL") or self.string(
            database, "database.url", "url"
        )
        database_url = database_url or f"sqlite:///{Path(storage_path) / 'proxy.db'}"
        self.database_url(database_url, "database.url")

        upstream_settings = UpstreamSettings(
            connect_timeout_s=self.duration(
                upstream, "upstream.connect_timeout", DEFAULT_CONNECT_TIMEOUT_S, positive=True
            ),
            read_timeout_s=self.duration(
                upstream, "upstream.read_timeout", DEFAULT_READ_TIMEOUT_S, positive=True
            ),
            retries=self.integer(upstream, "upstream.retries", "retries", DEFAULT_RETRIES, 0, 10),
            max_connections=self.integer(
                upstream, "upstream.max_connections", "max_connections", DEFAULT_MAX_CONNECTIONS, 1
            ),
        )
        lease_settings = LeaseSettings(
            ttl_s=self.duration(leases, "leases.ttl", DEFAULT_LEASE_TTL_S, positive=True),
            poll_interval_s=self.duration(
                leases, "leases.poll_interval", DEFAULT_LEASE_POLL_INTERVAL_S, positive=True
            ),
            retention_s=self.duration(leases, "leases.retention", DEFAULT_LEASE_RETENTION_S),
            notify=self.boolean(leases, "leases.notify", True),
        )
        if lease_settings.poll_interval_s > lease_settings.ttl_s:
            self.error("leases.poll_interval", "must not be longer than leases.ttl")
        job_settings = JobSettings(
            reclaim_interval_s=self.duration(
                jobs, "jobs.reclaim_interval", DEFAULT_RECLAIM_INTERVAL_S, positive=True
            ),
            sweep_interval_s=self.duration(
                jobs, "jobs.sweep_interval", DEFAULT_SWEEP_INTERVAL_S, positive=True
            ),
        )

        raw_repos = raw.get("repositories")
        if raw_repos is None:
            raw_repos = default_repositories()
        if not isinstance(raw_repos, list):
            self.error("repositories", "must be an array of tables ([[repositories]])")
            raw_repos = []
        repositories: list[RepositorySettings] = []
        seen: set[str] = set()
        for index, raw_repo in enumerate(raw_repos):
            repo = self.repository(raw_repo, index)
            if repo is None:
                continue
            if repo.name in seen:
                self.error(f"repositories.{repo.name}.name", "is used by two repositories")
            seen.add(repo.name)
            repositories.append(repo)

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
        )

    # -- repositories -------------------------------------------------------------

    def repository(self, raw: object, index: int) -> RepositorySettings | None:
        where = f"repositories[{index}]"
        if not isinstance(raw, dict):
            self.error(where, "must be a table")
            return None
        name = self.string(raw, f"{where}.name", "name")
        if name is None:
            self.error(f"{where}.name", "is required")
            return None
        if not _REPO_NAME_RE.match(name) or name in RESERVED_NAMES:
            self.error(
                f"{where}.name",
                f"{name!r} is not a valid repository name; use lower-case letters, digits, "
                "'.', '_' or '-' (it becomes the first path segment), not healthz/readyz/metrics",
            )
            return None
        where = f"repositories.{name}"
        fmt = self.string(raw, f"{where}.format", "format")
        if fmt not in FORMATS:
            self.error(f"{where}.format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
            return None
        allowed = _FORMAT_KEYS[fmt] | {"name", "format"}
        for key in raw:
            if key not in allowed:
                self.error(
                    f"{where}.{key}",
                    f"unknown key for format {fmt!r}; expected one of {', '.join(sorted(allowed))}",
                )
        if fmt == "gradle-build-cache":
            return self.build_cache(raw, name, where)
        upstreams = self.upstreams(raw, name, where, fmt)
        if fmt == "pypi":
            return RepositorySettings(
                name=name,
                format=fmt,
                upstreams=upstreams,
                metadata_ttl_s=self.duration(raw, f"{where}.metadata_ttl", DEFAULT_METADATA_TTL_S),
                negative_ttl_s=self.duration(raw, f"{where}.negative_ttl", DEFAULT_NEGATIVE_TTL_S),
            )
        return RepositorySettings(
            name=name,
            format=fmt,
            upstreams=upstreams,
            metadata_ttl_s=self.duration(
                raw, f"{where}.metadata_ttl", DEFAULT_MAVEN_METADATA_TTL_S
            ),
            snapshot_ttl_s=self.duration(raw, f"{where}.snapshot_ttl", DEFAULT_SNAPSHOT_TTL_S),
            negative_ttl_s=self.duration(
                raw, f"{where}.negative_ttl", DEFAULT_MAVEN_NEGATIVE_TTL_S
            ),
        )

    def upstreams(self, raw: dict[str, Any], name: str, where: str, fmt: str) -> tuple[str, ...]:
        key = f"{where}.upstream"
        value: object = raw.get("upstream")
        env_value = self.environ.get(upstream_env_var(name))
        if env_value:
            key = upstream_env_var(name)
            value = [u.strip() for u in env_value.split(",") if u.strip()]
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            self.error(key, "must be a URL or a non-empty list of URLs")
            return ()
        if fmt == "pypi" and len(value) > 1:
            self.error(key, "a pypi repository has exactly one upstream index")
            return ()
        urls: list[str] = []
        for i, item in enumerate(value):
            item_key = key if len(value) == 1 else f"{key}[{i}]"
            if not isinstance(item, str):
                self.error(item_key, f"{item!r} is not a URL")
                continue
            item = self.expand(item, item_key)
            parts = urlsplit(item)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                self.error(item_key, f"{item!r} is not an http(s) URL")
                continue
            if parts.query or parts.fragment:
                self.error(item_key, f"{item!r} must not have a query or fragment")
                continue
            urls.append(item if item.endswith("/") else item + "/")
        return tuple(urls)

    def build_cache(self, raw: dict[str, Any], name: str, where: str) -> RepositorySettings:
        anonymous = self.string(raw, f"{where}.anonymous", "anonymous") or "read"
        if anonymous not in ANONYMOUS_ACCESS:
            self.error(f"{where}.anonymous", f"{anonymous!r} is not one of none, read, write")
        users: list[User] = []
        raw_users = raw.get("users", {})
        if not isinstance(raw_users, dict):
            self.error(f"{where}.users", "must be a table of user names")
            raw_users = {}
        for user_name, raw_user in raw_users.items():
            user_key = f"{where}.users.{user_name}"
            if not isinstance(raw_user, dict):
                self.error(user_key, "must be a table with password and role")
                continue
            if ":" in user_name or not user_name:
                self.error(user_key, "a user name must not be empty or contain ':'")
            for key in raw_user:
                if key not in ("password", "role"):
                    self.error(f"{user_key}.{key}", "unknown key; expected password or role")
            password = self.string(raw_user, f"{user_key}.password", "password")
            if not password:
                self.error(f"{user_key}.password", "is required and must not be empty")
            role = self.string(raw_user, f"{user_key}.role", "role") or "read"
            if role not in ROLES:
                self.error(f"{user_key}.role", f"{role!r} is not one of read, write")
            users.append(User(name=user_name, password=password or "", role=role))
        max_entry_size = (
            self.size(raw, f"{where}.max_entry_size", DEFAULT_MAX_ENTRY_SIZE)
            or DEFAULT_MAX_ENTRY_SIZE
        )
        max_size = self.size(raw, f"{where}.max_size", None)
        if max_size is not None and max_size < max_entry_size:
            self.error(f"{where}.max_size", "must not be smaller than max_entry_size")
        return RepositorySettings(
            name=name,
            format="gradle-build-cache",
            max_entry_size=max_entry_size,
            max_size=max_size,
            anonymous=anonymous,
            users=tuple(users),
        )

    # -- scalar helpers -------------------------------------------------------------

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

    def expand(self, value: str, key: str) -> str:
        def replace(match: re.Match[str]) -> str:
            if match.group(1) == "$":
                return "$"
            var = match.group(2)
            if var not in self.environ:
                self.error(key, f"environment variable {var} is not set")
                return ""
            return self.environ[var]

        return _ENV_REF_RE.sub(replace, value)

    def string(self, raw: dict[str, Any], key: str, name: str) -> str | None:
        value = raw.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            self.error(key, f"{value!r} is not a string")
            return None
        return self.expand(value, key)

    def boolean(self, raw: dict[str, Any], key: str, default: bool) -> bool:
        value = raw.get(key.rsplit(".", 1)[-1], default)
        if not isinstance(value, bool):
            self.error(key, f"{value!r} is not true or false")
            return default
        return value

    def integer(
        self,
        raw: dict[str, Any],
        key: str,
        name: str,
        default: int,
        minimum: int = 0,
        maximum: int | None = None,
    ) -> int:
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(key, f"{value!r} is not an integer")
            return default
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            self.error(key, f"{value} is out of range; use a number {bound}")
            return default
        return value

    def duration(
        self, raw: dict[str, Any], key: str, default: float, positive: bool = False
    ) -> float:
        seconds = self._unit(raw, key, parse_duration)
        if seconds is None:
            return default
        if positive and seconds <= 0:
            self.error(key, f"{raw[key.rsplit('.', 1)[-1]]!r} must be more than 0")
            return default
        return seconds

    def size(self, raw: dict[str, Any], key: str, default: int | None) -> int | None:
        size = self._unit(raw, key, parse_size)
        if size is None:
            return default
        if size <= 0:
            self.error(key, f"{raw[key.rsplit('.', 1)[-1]]!r} must be more than 0 bytes")
            return default
        return size

    def _unit(self, raw: dict[str, Any], key: str, parse: Callable[[object], T]) -> T | None:
        """The parsed value of ``key`` (``${VAR}`` expanded); None if absent or invalid."""
        name = key.rsplit(".", 1)[-1]
        if name not in raw:
            return None
        value = raw[name]
        if isinstance(value, str):
            value = self.expand(value, key)
        try:
            return parse(value)
        except ValueError as exc:
            self.error(key, str(exc))
            return None

    def listen(self, value: str, key: str) -> tuple[str, int]:
        host, sep, port_text = value.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            self.error(key, f'{value!r} is not HOST:PORT; use e.g. "127.0.0.1:8080"')
            return "127.0.0.1", 8080
        return host, int(port_text)

    def database_url(self, value: str, key: str) -> None:
        scheme = value.split(":", 1)[0]
        if scheme == "sqlite":
            if not value.startswith("sqlite:///") or value == "sqlite:///":
                self.error(key, f"{value!r} is not sqlite:///PATH (e.g. sqlite:///./data/proxy.db)")
        elif scheme in ("postgresql", "postgres"):
            if not urlsplit(value).hostname and "host=" not in value:
                self.error(key, f"{hide_password(value)!r} has no host")
        else:
            self.error(
                key,
                f"{hide_password(value)!r}: the scheme must be sqlite:/// or postgresql://",
            )
