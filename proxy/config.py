"""Settings: parsed and validated once into frozen dataclasses.

``load(path, environ)`` is the only place that reads the environment. Every error
names the key that holds the bad value, and ``load`` reports all of them at once
(the validation itself lives in ``config_parser.py``).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy.exceptions import ConfigError
from proxy.units import format_duration, format_size

DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_STORAGE_PATH = "./data"
DEFAULT_WORKERS = 1
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 2
DEFAULT_MAX_CONNECTIONS = 100
DEFAULT_METADATA_TTL_S = 600.0
DEFAULT_NEGATIVE_TTL_S = 60.0
DEFAULT_MAVEN_METADATA_TTL_S = 1800.0
DEFAULT_SNAPSHOT_TTL_S = 60.0
DEFAULT_MAVEN_NEGATIVE_TTL_S = 300.0
DEFAULT_MAX_ENTRY_SIZE = 100 * 10**6
DEFAULT_LEASE_TTL_S = 15.0
DEFAULT_LEASE_POLL_INTERVAL_S = 0.25
DEFAULT_LEASE_RETENTION_S = 24 * 3600.0
DEFAULT_RECLAIM_INTERVAL_S = 3600.0
DEFAULT_SWEEP_INTERVAL_S = 300.0


@dataclass(frozen=True)
class User:
    name: str
    password: str = field(repr=False)
    role: str


@dataclass(frozen=True)
class RepositorySettings:
    name: str
    format: str
    upstreams: tuple[str, ...] = ()
    metadata_ttl_s: float = DEFAULT_METADATA_TTL_S
    negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S
    snapshot_ttl_s: float = DEFAULT_SNAPSHOT_TTL_S
    max_entry_size: int = DEFAULT_MAX_ENTRY_SIZE
    max_size: int | None = None
    anonymous: str = "read"
    users: tuple[User, ...] = ()

    @property
    def upstream_setting(self) -> str:
        """What an operator sets to give this repository an upstream (for messages)."""
        env_var = upstream_env_var(self.name)
        return f"repositories.{self.name}.upstream (or the environment variable {env_var})"

    @property
    def is_proxy(self) -> bool:
        return self.format in ("pypi", "maven")


@dataclass(frozen=True)
class UpstreamSettings:
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    max_connections: int = DEFAULT_MAX_CONNECTIONS


@dataclass(frozen=True)
class LeaseSettings:
    ttl_s: float = DEFAULT_LEASE_TTL_S
    poll_interval_s: float = DEFAULT_LEASE_POLL_INTERVAL_S
    retention_s: float = DEFAULT_LEASE_RETENTION_S
    # LISTEN/NOTIFY wake-ups (Postgres). Turn off behind a pooler that cannot LISTEN
    # (e.g. PgBouncer in transaction mode); waiters then rely on polling alone.
    notify: bool = True


@dataclass(frozen=True)
class JobSettings:
    reclaim_interval_s: float = DEFAULT_RECLAIM_INTERVAL_S
    sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S


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
    repositories: tuple[RepositorySettings, ...]
    source: str = "embedded defaults"

    def repository(self, name: str) -> RepositorySettings | None:
        for repo in self.repositories:
            if repo.name == name:
                return repo
        return None

    def describe(self) -> str:
        """The effective settings as TOML-like text (passwords hidden), for check-config."""
        lines = [
            f"# effective settings from {self.source}",
            "[server]",
            f'listen = "{self.host}:{self.port}"',
            f"workers = {self.workers}",
            "[database]",
            f'url = "{hide_password(self.database_url)}"',
            "[storage]",
            f'path = "{self.storage_path}"',
            "[upstream]",
            f'connect_timeout = "{format_duration(self.upstream.connect_timeout_s)}"',
            f'read_timeout = "{format_duration(self.upstream.read_timeout_s)}"',
            f"retries = {self.upstream.retries}",
            f"max_connections = {self.upstream.max_connections}",
            "[leases]",
            f'ttl = "{format_duration(self.leases.ttl_s)}"',
            f'poll_interval = "{format_duration(self.leases.poll_interval_s)}"',
            f'retention = "{format_duration(self.leases.retention_s)}"',
            f"notify = {'true' if self.leases.notify else 'false'}",
            "[jobs]",
            f'reclaim_interval = "{format_duration(self.jobs.reclaim_interval_s)}"',
            f'sweep_interval = "{format_duration(self.jobs.sweep_interval_s)}"',
        ]
        for repo in self.repositories:
            lines += ["", "[[repositories]]", f'name = "{repo.name}"', f'format = "{repo.format}"']
            if repo.is_proxy:
                if repo.upstreams:
                    urls = ", ".join(f'"{u}"' for u in repo.upstreams)
                    lines.append(f"upstream = [{urls}]")
                else:
                    lines.append(f"# upstream is not set: set {repo.upstream_setting}")
                lines.append(f'metadata_ttl = "{format_duration(repo.metadata_ttl_s)}"')
                if repo.format == "maven":
                    lines.append(f'snapshot_ttl = "{format_duration(repo.snapshot_ttl_s)}"')
                lines.append(f'negative_ttl = "{format_duration(repo.negative_ttl_s)}"')
            else:
                lines.append(f'max_entry_size = "{format_size(repo.max_entry_size)}"')
                if repo.max_size is not None:
                    lines.append(f'max_size = "{format_size(repo.max_size)}"')
                lines.append(f'anonymous = "{repo.anonymous}"')
                for user in repo.users:
                    lines.append(
                        f'users.{user.name} = {{ password = "***", role = "{user.role}" }}'
                    )
        return "\n".join(lines) + "\n"


def upstream_env_var(repo_name: str) -> str:
    return "PROXY_UPSTREAM_" + re.sub(r"[^A-Za-z0-9]", "_", repo_name).upper()


def load(path: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Settings:
    """Read the TOML file (or the embedded defaults), apply the environment, validate.

    Raises ``ConfigError`` listing every bad key.
    """
    if path is None:
        path = environ.get("PROXY_CONFIG") or None
    if path is None:
        raw: dict[str, Any] = {}
        source = "embedded defaults"
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
    from proxy.config_parser import Parser  # the parser builds this module's dataclasses

    parser = Parser(environ)
    settings = parser.settings(raw, source)
    if parser.errors:
        raise ConfigError(parser.errors)
    assert settings is not None
    return settings


def hide_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def sqlite_path(database_url: str) -> Path:
    """``sqlite:///./data/proxy.db`` -> ``./data/proxy.db``; ``sqlite:////abs`` -> ``/abs``."""
    return Path(database_url[len("sqlite:///") :])
