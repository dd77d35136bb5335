"""Settings: units, environment, defaults, and errors that name the key."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from proxy.config.load import load
from proxy.config.options import toml_string
from proxy.exceptions import ConfigError
from tests.conftest import write_config


def test_embedded_defaults_need_no_file() -> None:
    settings = load(None, {})
    assert (settings.host, settings.port) == ("127.0.0.1", 8080)
    assert settings.database_url == "sqlite:///data/proxy.db"
    assert [(r.name, r.format) for r in settings.repositories] == [
        ("pypi", "pypi"),
        ("maven", "maven"),
        ("gradle-cache", "gradle-build-cache"),
        ("npm", "npm"),
    ]
    assert all(not r.upstreams for r in settings.repositories)


def test_environment_overrides() -> None:
    env = {
        "PROXY_LISTEN": "0.0.0.0:9000",
        "PROXY_STORAGE_PATH": "/srv/proxy",
        "PROXY_UPSTREAM_PYPI": "https://upstream.example/simple",
        "PROXY_UPSTREAM_MAVEN": "https://upstream.example/maven2/,https://plugins.example/m2/",
    }
    settings = load(None, env)
    assert (settings.host, settings.port) == ("0.0.0.0", 9000)
    assert settings.database_url == "sqlite:////srv/proxy/proxy.db"
    pypi, maven = settings.repository("pypi"), settings.repository("maven")
    assert pypi is not None and pypi.upstreams == ("https://upstream.example/simple/",)
    assert maven is not None and maven.upstreams == (
        "https://upstream.example/maven2/",
        "https://plugins.example/m2/",
    )
    url = load(None, {"PROXY_DATABASE_URL": "postgresql://proxy@db:5432/proxy"}).database_url
    assert url == "postgresql://proxy@db:5432/proxy"


def test_full_file_with_env_references(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """
        [server]
        listen = "127.0.0.1:8081"
        [leases]
        ttl = "15s"
        poll_interval = "250ms"
        [[repositories]]
        name = "maven"
        format = "maven"
        upstream = ["https://upstream.example/maven2/", "https://plugins.example/m2/"]
        snapshot_ttl = "1m"
        [[repositories]]
        name = "gradle-cache"
        format = "gradle-build-cache"
        max_entry_size = "100MB"
        max_size = "10GB"
        anonymous = "none"
        [repositories.users.ci]
        password = "${GRADLE_PASSWORD}"
        role = "write"
    """,
    )
    settings = load(path, {"GRADLE_PASSWORD": "s3cret"})
    cache = settings.repository("gradle-cache")
    assert cache is not None
    assert cache.options.max_entry_size == 10**8 and cache.options.max_size == 10 * 10**9
    assert cache.options.users[0].password == "s3cret"
    assert "s3cret" not in settings.describe()
    assert settings.leases.ttl_s == 15 and settings.leases.poll_interval_s == 0.25


def _errors(tmp_path: Path, body: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(write_config(tmp_path, body), env or {})
    return info.value.errors


def test_every_bad_key_is_named_at_once(tmp_path: Path) -> None:
    errors = _errors(
        tmp_path,
        """
        [server]
        listen = "nowhere"
        workers = 0
        [leases]
        ttl = "soon"
        [storage]
        colour = "blue"
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "ftp://upstream.example/"
        metadata_ttl = "10 minutes"
        [[repositories]]
        name = "cache"
        format = "gradle-build-cache"
        max_entry_size = "huge"
        [repositories.users.ci]
        password = "${NOT_SET_ANYWHERE}"
        role = "admin"
    """,
    )
    joined = "\n".join(errors)
    for key in (
        "server.listen:",
        "server.workers:",
        "leases.ttl:",
        "storage.colour:",
        "repositories.pypi.upstream:",
        "repositories.pypi.metadata_ttl:",
        "repositories.cache.max_entry_size:",
        "repositories.cache.users.ci.password: environment variable NOT_SET_ANYWHERE is not set",
        "repositories.cache.users.ci.role:",
    ):
        assert key in joined, f"{key} missing from:\n{joined}"


def test_values_too_small_to_work_are_refused_naming_the_minimum(tmp_path: Path) -> None:
    # Issue 18: `leases.ttl = "1ms"` was accepted, and then every lease was lost at once.
    errors = _errors(
        tmp_path,
        """
        [upstream]
        connect_timeout = "1ms"
        read_timeout = "50ms"
        transfer_timeout = "500ms"
        min_rate_window = "1ms"
        parse_timeout = "1ms"
        [leases]
        ttl = "1ms"
        poll_interval = "1ms"
        [jobs]
        evict_interval = "10ms"
        reclaim_interval = "0.5s"
    """,
    )
    expected = {
        "upstream.connect_timeout": "at least 100ms",
        "upstream.read_timeout": "at least 100ms",
        "upstream.transfer_timeout": "at least 1s",
        "upstream.min_rate_window": "at least 100ms",
        "upstream.parse_timeout": "at least 100ms",
        "leases.ttl": "at least 1s",
        "leases.poll_interval": "at least 10ms",
        "jobs.evict_interval": "at least 1s",
        "jobs.reclaim_interval": "at least 1s",
    }
    for key, minimum in expected.items():
        found = [e for e in errors if e.startswith(f"{key}:")]
        assert found and minimum in found[0] and "too short" in found[0], (key, errors)
    # The smallest values that work are accepted.
    load(
        write_config(
            tmp_path,
            """
            [upstream]
            connect_timeout = "100ms"
            read_timeout = "100ms"
            transfer_timeout = "1s"
            [leases]
            ttl = "1s"
            poll_interval = "10ms"
            """,
            name="ok.toml",
        ),
        {},
    )


@pytest.mark.parametrize("listen", ["127.0.0.1:\u00b2", "127.0.0.1:\u0663", "127.0.0.1:080808"])
def test_a_port_in_other_digits_is_a_config_error(listen: str) -> None:
    """str.isdigit() takes "²" (which int() refuses: a traceback) and "٣" (which int()
    reads as 3): a port is ASCII digits."""
    with pytest.raises(ConfigError) as info:
        load(None, {"PROXY_LISTEN": listen})
    assert "server.listen" in str(info.value) and "HOST:PORT" in str(info.value)


def test_structural_errors(tmp_path: Path) -> None:
    assert any(
        "is used by two repositories" in e
        for e in _errors(
            tmp_path,
            """
        [[repositories]]
        name = "a"
        format = "pypi"
        [[repositories]]
        name = "a"
        format = "pypi"
    """,
        )
    )
    assert any(
        "not one of pypi" in e
        for e in _errors(
            tmp_path,
            """
        [[repositories]]
        name = "a"
        format = "cargo"
    """,
        )
    )
    assert any(
        "not a valid repository name" in e
        for e in _errors(
            tmp_path,
            """
        [[repositories]]
        name = "metrics"
        format = "pypi"
    """,
        )
    )
    assert _errors(
        tmp_path,
        """
        [[repositories]]
        format = "raw"
        [[mirrors]]
        name = "Bad Name"
        interval = "1h"
        [[mirrors]]
        interval = "1h"
    """,
    ) == [
        "repositories[0].name: is required",
        "mirrors[0].name: 'Bad Name' is not a valid mirror name; use lower-case letters, "
        "digits, '.', '_' or '-'",
        "mirrors[1].name: is required",
    ]
    assert any("database.url" in e for e in _errors(tmp_path, '[database]\nurl = "mysql://x"\n'))
    assert any(
        "unknown key for format 'pypi'" in e
        for e in _errors(
            tmp_path,
            """
        [[repositories]]
        name = "a"
        format = "pypi"
        max_size = "1GB"
    """,
        )
    )


def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\nlisten=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(bad, {})
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "absent.toml", {})
    # A file saved in another encoding (Latin-1, UTF-16 with its byte-order mark) is
    # a config error naming the file, not a UnicodeDecodeError traceback.
    for name, data in (("latin1.toml", '# caf\xe9\n'.encode("latin-1")),
                       ("utf16.toml", "[server]\n".encode("utf-16"))):  # fmt: skip
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=f"{name}: not UTF-8 text"):
            load(tmp_path / name, {})


def test_check_config_command(tmp_path: Path) -> None:
    good = write_config(
        tmp_path,
        """
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "https://upstream.example/simple/"
    """,
    )
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", "--config", str(good)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert 'upstream = ["https://upstream.example/simple/"]' in result.stdout
    assert 'metadata_ttl = "10m"' in result.stdout
    bad = write_config(tmp_path, '[leases]\nttl = "x"\n', name="bad.toml")
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", "--config", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "leases.ttl:" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_example_config_is_valid_and_documents_every_key() -> None:
    settings = load(
        "config.example.toml", {"GRADLE_CACHE_CI_PASSWORD": "x", "PROXY_ADMIN_PASSWORD": "y"}
    )
    assert [r.name for r in settings.repositories] == [
        "pypi",
        "maven",
        "gradle-cache",
        "tools",
        "npm",
    ]
    described = settings.describe()
    example = Path("config.example.toml").read_text()
    for line in described.splitlines():
        key = line.split("=")[0].strip()
        if key and not key.startswith(("#", "[", "users.")):
            assert f"{key} =" in example, f"{key} is not documented in config.example.toml"
    assert 'max_entry_size = "100MB"' in described


def test_check_config_output_is_toml_that_loads_back(tmp_path: Path) -> None:
    """What check-config prints loads as TOML, whatever the strings hold (quotes,
    backslashes, control characters in a path)."""
    odd_dir = tmp_path / 'sboms "q" \\ \x7f'
    odd_dir.mkdir()
    sbom = odd_dir / "line\nbreak.json"
    config = write_config(
        tmp_path,
        f"""
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "https://upstream.example/simple/"
        [[mirrors]]
        name = "team"
        interval = "1h"
        sbom = {toml_string(str(sbom))}
        """,
    )
    settings = load(config, {})
    described = tomllib.loads(settings.describe())
    assert described["mirrors"][0]["sbom"] == str(sbom)
    assert described["storage"]["low_watermark"] == "90%"


def test_object_storage_settings_are_validated_naming_the_key(tmp_path: Path) -> None:
    def errors(body: str, env: dict[str, str] | None = None) -> list[str]:
        with pytest.raises(ConfigError) as raised:
            load(write_config(tmp_path, body), env or {})
        return raised.value.errors

    assert errors('[storage]\nurl = "s3://artifacts/proxy/"\n') == [
        "storage.local_cache: is required with an s3:// storage.url: this replica's own "
        'folder for downloads in progress and its copies of blobs, e.g. "/var/cache/proxy"'
    ]
    [gs] = errors('[storage]\nurl = "gs://artifacts/"\n')
    assert gs.startswith("storage.url: 'gs://artifacts/': the scheme must be s3://")
    bad = errors(
        '[storage]\nurl = "s3://A_b/x/../y"\nlocal_cache = "/c"\nlocal_cache_max_size = "lots"\n'
        '[storage.s3]\nendpoint = "ftp://x"\naccess_key = "k"\npath_style = "yes"\n'
    )
    assert any(e.startswith("storage.url: ") and "not a bucket name" in e for e in bad)
    assert any(e.startswith("storage.url: ") and "'..' part" in e for e in bad)
    assert any(e.startswith("storage.local_cache_max_size: ") for e in bad)
    assert any(e.startswith("storage.s3.endpoint: ") for e in bad)
    assert any(
        e.startswith("storage.s3.access_key: ") and "never from the config" in e for e in bad
    )
    assert any(e.startswith("storage.s3.path_style: ") for e in bad)
    misplaced = errors('[storage]\nlocal_cache = "/c"\n[storage.s3]\nregion = "x"\n')
    assert misplaced == [
        "storage.local_cache: is only used with an s3:// storage.url",
        "storage.s3: is only used with an s3:// storage.url",
    ]
    [relay] = errors(
        '[server]\nrelay_url = "http://169.254.169.254:80/x"\n'
        '[storage]\nurl = "s3://artifacts/"\nlocal_cache = "/c"\n'
    )
    assert relay.startswith("server.relay_url: ") and "path" in relay
    [port] = errors(
        '[server]\nrelay_url = "http://10.0.0.5:9091"\n'
        '[storage]\nurl = "s3://artifacts/"\nlocal_cache = "/c"\n'
    )
    assert port.startswith("server.relay_url: needs server.relay_listen with a fixed port")
    env = {"PROXY_STORAGE_URL": "s3://from-env/p"}
    assert errors("[storage]\n", env)[0].startswith(
        "storage.local_cache: is required with an s3:// PROXY_STORAGE_URL"
    )


def test_object_storage_settings_load_describe_and_are_documented(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        """
        [server]
        relay_listen = "0.0.0.0:9091"
        relay_url = "http://10.0.0.5:9091"
        [storage]
        url = "s3://artifacts/team/proxy"
        local_cache = "cache"
        local_cache_max_size = "50GB"
        [storage.s3]
        endpoint = "http://127.0.0.1:8333/"
        region = "us-east-1"
        path_style = true
        redirect_min_size = "50MB"
        """,
    )
    settings = load(config, {})
    s3 = settings.object_storage
    assert s3 is not None
    assert (s3.bucket, s3.prefix, s3.url) == (
        "artifacts",
        "team/proxy/",
        "s3://artifacts/team/proxy/",
    )
    assert s3.local_cache == tmp_path / "cache"  # beside the config file
    assert (s3.local_cache_max_size, s3.redirect_min_size) == (50 * 10**9, 50 * 10**6)
    assert (s3.endpoint, s3.region, s3.path_style) == ("http://127.0.0.1:8333", "us-east-1", True)
    assert (settings.relay_host, settings.relay_port, settings.relay_url) == (
        "0.0.0.0", 9091, "http://10.0.0.5:9091",
    )  # fmt: skip
    described = settings.describe()
    again = load(write_config(tmp_path, described, name="again.toml"), {})
    assert again.object_storage == s3 and again.relay_url == settings.relay_url
    example = Path("config.example.toml").read_text()
    for line in described.splitlines():
        key = line.split("=")[0].strip()
        if key and not key.startswith(("#", "[", "users.")):
            assert f"{key} =" in example, f"{key} is not documented in config.example.toml"
    folder = load(write_config(tmp_path, '[storage]\nurl = "file:///srv/blobs"\n'), {})
    assert folder.object_storage is None and str(folder.storage_path) == "/srv/blobs"
    plain = load(None, {})
    assert plain.object_storage is None and str(plain.storage_path) == "data"  # make serve


def test_an_endpoint_or_region_botocore_cannot_use_is_an_error_naming_the_key(
    tmp_path: Path,
) -> None:
    """An endpoint urlsplit refuses (an unclosed IPv6 bracket), a port out of range, a
    query or fragment, or a region botocore refuses was a traceback (check-config, and
    serve at start) or 10 s of retries reported as an unreachable endpoint."""

    def errors(s3: str) -> list[str]:
        body = f'[storage]\nurl = "s3://artifacts/"\nlocal_cache = "/c"\n[storage.s3]\n{s3}\n'
        with pytest.raises(ConfigError) as raised:
            load(write_config(tmp_path, body), {})
        return raised.value.errors

    for endpoint in (
        "http://[::1",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:x",
        "http://127.0.0.1:8333/?token=t",
        "http://127.0.0.1:8333/#f",
    ):
        [error] = errors(f"endpoint = {toml_string(endpoint)}")
        assert error.startswith("storage.s3.endpoint: "), error
    for region in ("../../x", "a b", "-x", ""):
        [error] = errors(f"region = {toml_string(region)}")
        assert error.startswith("storage.s3.region: "), error
    # What botocore takes stays accepted: a path under the endpoint, an IPv6 host.
    for endpoint in ("http://[::1]:8333", "https://s3.internal.example/storage"):
        body = (
            '[storage]\nurl = "s3://artifacts/"\nlocal_cache = "/c"\n'
            f'[storage.s3]\nendpoint = {toml_string(endpoint)}\nregion = "eu-west-3"\n'
        )
        assert load(write_config(tmp_path, body), {}).object_storage is not None


def test_an_aws_profile_or_region_from_the_environment_that_is_wrong_stops_the_start_in_one_line(
    tmp_path: Path, clean_env: dict[str, str]
) -> None:
    """A missing AWS_PROFILE or an AWS_DEFAULT_REGION botocore refuses raised while the
    S3 client was made: serve and check-config's storage check died with a traceback."""
    config = write_config(
        tmp_path,
        f"""
        [storage]
        url = "s3://artifacts/proxy/"
        local_cache = "{tmp_path / "cache"}"
        [storage.s3]
        endpoint = "http://127.0.0.1:1"
        """,
    )
    nowhere = tmp_path / "no-aws-files"
    base = {k: v for k, v in clean_env.items() if not k.startswith("AWS_")}
    base.update(
        AWS_CONFIG_FILE=str(nowhere / "config"),
        AWS_SHARED_CREDENTIALS_FILE=str(nowhere / "credentials"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    keys = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    for extra, named in (
        ({"AWS_PROFILE": "nope"}, "AWS_PROFILE"),
        ({**keys, "AWS_DEFAULT_REGION": "a b"}, "AWS_DEFAULT_REGION"),
    ):
        argv = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
        argv += ["--listen", "127.0.0.1:0"]
        # In the test's folder: with no database.url the catalog is <storage.path>, by
        # default ./data, which was the checkout's own (a stale one failed later runs).
        done = subprocess.run(
            argv, capture_output=True, text=True, env={**base, **extra}, timeout=120,
            cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("cannot use the storage: ") and named in last, last
        assert "retrying" not in done.stderr, done.stderr


def test_blob_verification_settings_load_are_validated_and_described(tmp_path: Path) -> None:
    defaults = load(write_config(tmp_path, "[storage]\n"), {})
    assert defaults.storage.verify_reads is False  # off by default: it costs every hit
    assert defaults.storage.scrub_rate == 50 * 10**6
    assert defaults.jobs.scrub_interval_s == 24 * 3600
    config = write_config(
        tmp_path,
        '[storage]\nverify_reads = true\nscrub_rate = "5MiB/s"\n[jobs]\nscrub_interval = "6h"\n',
    )
    settings = load(config, {})
    assert settings.storage.verify_reads is True
    assert settings.storage.scrub_rate == 5 * 2**20
    assert settings.jobs.scrub_interval_s == 6 * 3600
    again = load(write_config(tmp_path, settings.describe(), name="again.toml"), {})
    assert again.storage == settings.storage and again.jobs == settings.jobs
    with pytest.raises(ConfigError) as raised:
        load(
            write_config(
                tmp_path,
                '[storage]\nverify_reads = "yes"\nscrub_rate = "10KiB/s"\n'
                '[jobs]\nscrub_interval = "soon"\n',
                name="bad.toml",
            ),
            {},
        )
    errors = raised.value.errors
    assert any(e.startswith("storage.verify_reads: ") for e in errors), errors
    [rate] = [e for e in errors if e.startswith("storage.scrub_rate: ")]
    assert "at least 1MiB/s" in rate
    assert any(e.startswith("jobs.scrub_interval: ") for e in errors), errors
