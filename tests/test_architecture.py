"""The seams of docs/architecture.md, checked on the source: formats import only the
contract, the engine never imports a format, both SQL dialects name the same
statements, and every registered format is a complete plugin."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from proxy import formats
from proxy.catalog import queries
from proxy.config.options import options_of
from proxy.contract import FormatPlugin

PROXY = Path(__file__).resolve().parent.parent / "proxy"
# The composition root: the only modules that look formats up in the registry.
REGISTRY_USERS = {"proxy.engine", "proxy.config.load", "proxy.formats"}
# Modules of a format that are its own helpers, not formats (pure parsing, no engine).
FORMAT_HELPERS = {"proxy.formats.simple_index"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PROXY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _proxy_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("proxy"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("proxy"))
    return found


MODULES = {_module_name(p): p for p in PROXY.rglob("*.py")}


@pytest.mark.parametrize(
    "module",
    sorted(m for m in MODULES if m.startswith("proxy.formats.") and m not in FORMAT_HELPERS),
)
def test_a_format_imports_only_the_contract(module: str) -> None:
    imports = _proxy_imports(MODULES[module])
    allowed = {"proxy.contract", "proxy.formats"} | FORMAT_HELPERS
    outside = {i for i in imports if not any(i == a or i.startswith(a + ".") for a in allowed)}
    assert not outside, f"{module} reaches past the contract: {sorted(outside)}"


@pytest.mark.parametrize("module", sorted(FORMAT_HELPERS))
def test_format_helpers_use_the_contract_at_most(module: str) -> None:
    outside = {i for i in _proxy_imports(MODULES[module]) if not i.startswith("proxy.contract")}
    assert not outside, f"{module} must not import the proxy beyond the contract: {outside}"


@pytest.mark.parametrize(
    "module",
    sorted(m for m in MODULES if not m.startswith("proxy.formats") and m not in REGISTRY_USERS),
)
def test_the_engine_never_imports_a_format(module: str) -> None:
    imports = _proxy_imports(MODULES[module])
    assert not any(i.startswith("proxy.formats") for i in imports), module


@pytest.mark.parametrize("name", sorted(formats.REGISTRY))
def test_every_registered_format_is_a_complete_plugin(name: str) -> None:
    plugin = formats.plugin(name)
    assert isinstance(plugin, FormatPlugin) and plugin.name == name
    assert dataclasses.is_dataclass(plugin.options)
    assert plugin.options.__dataclass_params__.frozen  # type: ignore[attr-defined]
    declared = {field_name for field_name, _option, _default in options_of(plugin.options)}
    assert declared == {f.name for f in dataclasses.fields(plugin.options)}, (
        "every settings field is an option(...) the config layer can fill"
    )
    plugin.options()  # every option has a default


def test_both_dialects_name_the_same_statements() -> None:
    sqlite, postgres = queries.load("sqlite"), queries.load("postgres")
    shared = sqlite.names() & postgres.names()
    assert sqlite.names() - shared == queries.DIALECT_ONLY["sqlite"]
    assert postgres.names() - shared == queries.DIALECT_ONLY["postgres"]
    for name in sorted(shared):
        sqlite_params = set(re.findall(r"\?(\d+)", sqlite[name]))
        postgres_params = set(re.findall(r"\$(\d+)", postgres[name]))
        assert sqlite_params == postgres_params, f"{name}: parameters differ between dialects"


def test_statements_live_only_in_the_sql_files() -> None:
    # No SQL text in the catalog's Python modules besides what the drivers must say
    # themselves (transaction control and the WAL pragma).
    allowed = re.compile(r"BEGIN IMMEDIATE|BEGIN EXCLUSIVE|ROLLBACK|COMMIT|PRAGMA")
    for path in (PROXY / "catalog").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.strip().upper()
                statement = (
                    r"^(SELECT\b.*\bFROM|INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE|DROP)\b"
                )
                if re.match(statement, text, re.DOTALL):
                    assert allowed.search(text), f"{path.name}: SQL outside sql/: {text[:60]}"
