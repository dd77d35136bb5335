"""The README and config.example.toml as a new user meets them: the example loads as
shipped (given the variables it names) and shows true defaults; every TOML snippet of
the README loads (so its keys exist); every command it shows names a real command,
option, make target or benchmark module."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from proxy.cli import build_parser
from proxy.config.load import load
from tests.conftest import write_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EXAMPLE = ROOT / "config.example.toml"
VARIABLE_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


def example_variables() -> set[str]:
    """The ${VAR}s config.example.toml uses (outside comments)."""
    lines = [line.split("#", 1)[0] for line in EXAMPLE.read_text().splitlines()]
    return set(VARIABLE_RE.findall("\n".join(lines)))


def test_the_example_loads_as_shipped_given_the_variables_it_names() -> None:
    header = "\n".join(line for line in EXAMPLE.read_text().splitlines()[:8])
    named = set(re.findall(r"\b([A-Z][A-Z0-9_]+_PASSWORD)\b", header))
    assert example_variables() == named, "the header must name every variable the file uses"
    settings = load(EXAMPLE, {name: "placeholder" for name in named})
    assert settings.admin.users and settings.repositories


def test_the_example_shows_true_defaults() -> None:
    example = load(EXAMPLE, {name: "placeholder" for name in example_variables()})
    defaults = load(None, {})
    for section in ("upstream", "leases", "jobs", "storage", "database"):
        assert getattr(example, section) == getattr(defaults, section), section
    for name in ("host", "port", "workers", "access_log", "log_format", "tls", "storage_path"):
        assert getattr(example, name) == getattr(defaults, name), name
    assert example.database_url == defaults.database_url
    assert example.admin.anonymous == defaults.admin.anonymous


@pytest.mark.parametrize("snippet", blocks("toml"), ids=lambda s: s.splitlines()[0][:40])
def test_every_readme_toml_snippet_loads(snippet: str, tmp_path: Path) -> None:
    if "[[tool." in snippet:
        return  # pyproject.toml of a client (uv), not ours
    variables = {name: "placeholder" for name in VARIABLE_RE.findall(snippet)}
    path = write_config(tmp_path, snippet.replace("/etc/proxy/proxy", str(tmp_path / "proxy")))
    if "tls_cert" in snippet:
        from tests.test_tls import make_certificate

        make_certificate(tmp_path)
    load(path, variables)  # raises ConfigError naming any key that does not exist


def test_every_readme_command_exists() -> None:
    parser = build_parser()
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.MULTILINE))
    commands = []
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line:
                commands.append(line)
    # Inline commands in backticks too: `proxy ...`, `make ...`, `python -m bench.x`.
    commands += re.findall(r"`((?:proxy|make) [^`]+)`", README)
    for module in re.findall(r"-m (bench\.[a-z_]+)", README):
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module
    seen_proxy = 0
    for command in commands:
        words = [w for w in shlex.split(command) if "=" not in w or w.startswith("-")]
        if not words:
            continue
        if words[0] == "make":
            for target in words[1:]:
                if not target.startswith("-") and "=" not in target:
                    assert target in targets, f"README: make {target} is not a target"
        elif words[0] == "proxy":
            seen_proxy += 1
            # `proxy COMMAND --help` stands for any command: take one.
            placeholders = {"COMMAND": "serve", "N": "2"}
            arguments = [placeholders.get(w, w) for w in words[1:]] or ["--help"]
            try:
                parser.parse_args(arguments)
            except SystemExit as exc:
                assert exc.code == 0, f"README: `{command}` is not a valid command"
    assert seen_proxy >= 5
