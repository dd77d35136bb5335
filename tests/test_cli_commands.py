"""The commands as a new user meets them: help, descriptions, -c everywhere, --json,
read-only commands that never create a catalog, settings a command does not read."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from tests.conftest import write_config
from tests.npm_registry import NpmRegistry, Tarball, start_registry
from tests.upstream import FakeUpstream, ProjectFile

COMMANDS = ("serve", "check-config", "migrate", "gc", "stats", "mirror", "jobs", "policy")


def run(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(Path.cwd()), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_proxy_alone_prints_help(tmp_path: Path) -> None:
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "usage: proxy" in done.stdout
    for ecosystem in ("PyPI", "Maven", "npm", "Gradle build cache", "raw files"):
        assert ecosystem in " ".join(done.stdout.split()), ecosystem
    for command in COMMANDS:
        assert command in done.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_a_description_and_c_config(tmp_path: Path, command: str) -> None:
    done = run(tmp_path, command, "--help")
    assert done.returncode == 0, done.stderr
    _usage, _, rest = done.stdout.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert len(description.split()) >= 5, f"{command} has no description: {done.stdout}"
    assert "-c FILE, --config FILE" in done.stdout


@pytest.mark.parametrize("command", [["check-config"], ["stats"], ["jobs", "--json"]])
def test_output_into_a_closed_pipe_is_no_traceback(tmp_path: Path, command: list[str]) -> None:
    """`proxy jobs --json | head -1`: the reader leaves early; the command stops
    quietly, as other Unix tools do (it printed a BrokenPipeError traceback)."""
    config = write_config(tmp_path, f'[storage]\npath = "{tmp_path / "data"}"\n')
    assert run(tmp_path, "migrate", "-c", str(config)).returncode == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the command writes a byte: every write fails
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "proxy", *command, "-c", str(config)],
            cwd=tmp_path, env={**clean, "PYTHONPATH": str(Path.cwd())},
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 1


def test_stats_never_creates_a_catalog(tmp_path: Path) -> None:
    done = run(tmp_path, "stats")
    assert done.returncode == 1
    assert "no catalog at data/proxy.db" in done.stderr and "-c/--config" in done.stderr
    assert not (tmp_path / "data").exists()
    jobs = run(tmp_path, "jobs")
    assert jobs.returncode == 1 and "no catalog" in jobs.stderr
    assert not (tmp_path / "data").exists()


def test_gc_without_a_catalog_deletes_nothing(tmp_path: Path) -> None:
    """A database.url that names no catalog (a typo, an empty Postgres database) beside
    the real store: every blob is named by no entry there. gc created that catalog and
    deleted every blob older than a day as an orphan."""
    store = tmp_path / "store"
    env = {"PROXY_STORAGE_PATH": str(store)}
    assert run(tmp_path, "migrate", env=env).returncode == 0
    sha256 = "ab" * 32
    blob = store / "blobs" / sha256[:2] / sha256[2:4] / sha256
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"a file a client downloaded last week")
    week_ago = blob.stat().st_mtime - 7 * 86400
    os.utime(blob, (week_ago, week_ago))
    typo = tmp_path / "prxy.db"
    done = run(tmp_path, "gc", env={**env, "PROXY_DATABASE_URL": f"sqlite:///{typo}"})
    assert done.returncode == 1 and "no catalog" in done.stderr, (done.stdout, done.stderr)
    assert blob.exists() and not typo.exists()
    # With its catalog, made before the blob, gc does its work (an orphan there too).
    import sqlite3

    db = sqlite3.connect(store / "proxy.db")
    db.execute("UPDATE schema_migrations SET applied_at_ms = applied_at_ms - 8 * 86400000")
    db.commit()
    db.close()
    assert run(tmp_path, "gc", env=env).returncode == 0
    assert not blob.exists()


def test_stats_and_jobs_create_no_catalog_in_an_empty_postgres_database(
    tmp_path: Path, pg_url: str
) -> None:
    """A database.url naming an empty database (a typo, the wrong server) is said to
    hold no catalog; `proxy jobs` opened the engine, which applied every migration and
    reported every job as never run."""
    env = {"PROXY_DATABASE_URL": pg_url}
    for command in ("stats", "jobs"):
        done = run(tmp_path, command, env=env)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert "no catalog" in done.stderr and "proxy migrate" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr

    async def tables() -> list[str]:
        conn = await asyncpg.connect(pg_url)
        try:
            rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        finally:
            await conn.close()
        return [row["tablename"] for row in rows]

    assert asyncio.run(tables()) == []
    assert run(tmp_path, "migrate", env=env).returncode == 0
    assert run(tmp_path, "jobs", env=env).returncode == 0
    assert run(tmp_path, "stats", env=env).returncode == 0


def test_jobs_does_not_migrate_an_older_catalog(tmp_path: Path) -> None:
    """An older catalog is read as it is: `proxy jobs` asks for `proxy migrate` instead
    of upgrading a fleet's schema behind its back; `proxy stats` still reads it."""
    config = write_config(tmp_path, f'[storage]\npath = "{tmp_path / "data"}"\n')
    assert run(tmp_path, "migrate", "-c", str(config)).returncode == 0
    import sqlite3

    db = sqlite3.connect(tmp_path / "data" / "proxy.db")
    [(newest,)] = db.execute("SELECT max(version) FROM schema_migrations").fetchall()
    db.execute("DELETE FROM schema_migrations WHERE version = ?", (newest,))
    db.commit()
    jobs = run(tmp_path, "jobs", "-c", str(config))
    assert jobs.returncode == 1 and "proxy migrate" in jobs.stderr, jobs.stderr
    assert db.execute("SELECT max(version) FROM schema_migrations").fetchall() != [(newest,)]
    db.close()
    assert run(tmp_path, "stats", "-c", str(config)).returncode == 0


def test_stats_and_jobs_print_json_and_human_sizes(tmp_path: Path) -> None:
    config = write_config(tmp_path, f'[storage]\npath = "{tmp_path / "data"}"\n')
    assert run(tmp_path, "migrate", "-c", str(config)).returncode == 0
    import sqlite3

    db = sqlite3.connect(tmp_path / "data" / "proxy.db")
    db.execute(
        "INSERT INTO entries (repository, key, kind, sha256, size, fetched_at_ms,"
        " last_access_ms) VALUES ('pypi', 'files/a/a-1.whl', 'immutable', 'x', 21028425, 1, 1)"
    )
    db.commit()
    db.close()
    table = run(tmp_path, "stats", "-c", str(config))
    assert table.returncode == 0, table.stderr
    assert "20.1 MiB" in table.stdout and "21028425" not in table.stdout
    document = json.loads(run(tmp_path, "stats", "--json", "-c", str(config)).stdout)
    [pypi] = [r for r in document["repositories"] if r["repository"] == "pypi"]
    assert pypi == {"repository": "pypi", "format": "pypi", "entries": 1, "bytes": 21028425}
    jobs = json.loads(run(tmp_path, "jobs", "--json", "-c", str(config)).stdout)
    names = {job["name"] for job in jobs["jobs"]}
    assert {"reclaim", "evict"} <= names
    assert all(job["next_due_ms"] is not None for job in jobs["jobs"])


def test_commands_need_only_the_settings_they_read(tmp_path: Path) -> None:
    """An unset ${VAR} of the build cache's password does not stop `proxy mirror` or
    `proxy stats`; `serve` and `check-config` still need it, and say so once."""
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "http://127.0.0.1:9/simple/"
        [[repositories]]
        name = "gradle-cache"
        format = "gradle-build-cache"
        [repositories.users.ci]
        password = "${{UNSET_BUILD_CACHE_PASSWORD}}"
        role = "write"
        """,
    )
    check = run(tmp_path, "check-config", "-c", str(config))
    assert check.returncode == 2
    errors = [line for line in check.stderr.splitlines() if line.startswith("  ")]
    assert errors == [
        "  repositories.gradle-cache.users.ci.password: environment variable "
        "UNSET_BUILD_CACHE_PASSWORD is not set"
    ]
    assert run(tmp_path, "migrate", "-c", str(config)).returncode == 0
    assert run(tmp_path, "stats", "-c", str(config)).returncode == 0
    # The mirror reaches its upstream (nothing listens on port 9): a failed item, not a
    # configuration error.
    mirror = run(tmp_path, "mirror", "-c", str(config), "pkg:pypi/requests@2.32.3")
    assert "configuration errors" not in mirror.stderr
    assert "1 failed" in mirror.stdout


def test_a_mirrored_section_still_needs_its_variables(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        """
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "${UNSET_PYPI_UPSTREAM}"
        """,
    )
    mirror = run(tmp_path, "mirror", "-c", str(config), "pkg:pypi/requests@2.32.3")
    assert mirror.returncode == 2
    assert "repositories.pypi.upstream" in mirror.stderr and "UNSET_PYPI_UPSTREAM" in mirror.stderr


def test_unsupported_purls_are_an_error_naming_the_supported_types(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "http://127.0.0.1:9/simple/"
        [[repositories]]
        name = "maven"
        format = "maven"
        upstream = "http://127.0.0.1:9/m2/"
        """,
    )
    done = run(tmp_path, "mirror", "-c", str(config), "pkg:npm/left-pad@1.3.0")
    assert done.returncode == 1
    assert "pkg:npm/left-pad@1.3.0" in done.stderr and "'npm'" in done.stderr
    assert "supported: pypi, maven" in done.stderr


def test_mirror_json_output(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [upstream]
        retries = 0
        connect_timeout = "1s"
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "http://127.0.0.1:9/simple/"
        """,
    )
    done = run(tmp_path, "mirror", "--json", "-c", str(config), "pkg:pypi/requests@2.32.3")
    assert done.returncode == 1
    summary = json.loads(done.stdout)
    assert summary["failed"] == 1 and summary["fetched"] == 0


def test_policy_explain_prints_each_decision_and_why(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    now = time.time()
    for version, age_days in (("1.0", 30), ("2.0", 1)):
        upload = datetime.fromtimestamp(now - age_days * 86400, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        upstream.projects.setdefault("demo", []).append(
            ProjectFile(f"demo-{version}.tar.gz", b"sdist " + version.encode(), upload_time=upload)
        )
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [policy]
        cooldown = "3d"
        [[policy.rules]]
        match = "pkg:pypi/demo"
        versions = "vers:pypi/>=3"
        action = "deny"
        reason = "INC-7"
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "{upstream.base_url}/simple/"
        """,
    )
    every = run(tmp_path, "policy", "explain", "-c", str(config), "pkg:pypi/demo")
    assert every.returncode == 0, every.stderr
    lines = every.stdout.splitlines()
    assert lines[0].startswith(
        "pypi: pkg:pypi/demo@1.0 is allowed by the release policy (policy.cooldown): published "
    )
    assert lines[1].startswith("pypi: pkg:pypi/demo@2.0 is held back until ")
    assert "(upload-time); the cooldown of 3d (policy.cooldown) holds it until" in lines[1]
    assert lines[-1] == "mode: enforce"
    one = run(tmp_path, "policy", "explain", "-c", str(config), "--json", "pkg:pypi/demo@3.0")
    assert one.returncode == 0, one.stderr
    [decision] = json.loads(one.stdout)["decisions"]
    assert decision["action"] == "deny" and decision["reason"] == "INC-7"
    assert decision["setting"] == "policy.rules[0]" and decision["repository"] == "pypi"
    # Nothing was served: the page was fetched once, no file at all.
    assert upstream.count("/simple/demo/") == 1
    assert not any(path.startswith("/packages/") for _, path in upstream.requests)
    other = run(tmp_path, "policy", "explain", "-c", str(config), "pkg:gem/rails")
    assert other.returncode == 1
    assert "judges no 'gem' packages in any (it judges pypi)" in other.stderr


def test_policy_explain_judges_npm_packages_scoped_or_not(tmp_path: Path) -> None:
    registry = NpmRegistry()
    for name, version in (("left-pad", "1.0.0"), ("left-pad", "1.1.0"), ("@acme/util", "2.0.0")):
        registry.publish(Tarball(name, version, b"\x1f\x8b" + version.encode(), {}))
    yesterday = datetime.fromtimestamp(time.time() - 86400, UTC)
    registry.publish_times[("left-pad", "1.1.0")] = yesterday.strftime("%Y-%m-%dT%H:%M:%S.000Z")
    server = start_registry(registry)
    try:
        config = write_config(
            tmp_path,
            f"""
            [storage]
            path = "{tmp_path / "data"}"
            [policy]
            cooldown = "3d"
            [[policy.rules]]
            match = "pkg:npm/%40acme/util"
            action = "deny"
            reason = "INC-8"
            [[repositories]]
            name = "npm"
            format = "npm"
            upstream = "{server.url}/"
            """,
        )
        every = run(
            tmp_path, "policy", "explain", "-c", str(config), "pkg:npm/left-pad",
            "pkg:npm/%40acme/util@2.0.0",
        )  # fmt: skip
        assert every.returncode == 0, every.stderr
        lines = every.stdout.splitlines()
        assert lines[0].startswith("npm: pkg:npm/left-pad@1.0.0 is allowed by the release policy")
        assert lines[1].startswith("npm: pkg:npm/left-pad@1.1.0 is held back until ")
        assert "(time)" in lines[1]
        assert lines[2].startswith("npm: pkg:npm/%40acme/util@2.0.0 is denied")
        assert "INC-8" in lines[2]
        # Nothing was served: the packument was asked for, no tarball.
        assert not any("/-/" in path for _, path in registry.requests)
    finally:
        server.stop()
