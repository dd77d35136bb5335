"""The architecture of docs/architecture.md, checked on the source: the layer table
(read from the document itself, so the rule is written once), the module map, the
runtime import closure of the contract and of every format, and the SQL dialects."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy import formats
from proxy.catalog import queries
from proxy.config.options import options_of
from proxy.contract import FormatPlugin, HostedContext, ProxyContext

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "proxy"
DOC = ROOT / "docs" / "architecture.md"
# Third-party packages of the engine: none may be loaded by `import proxy.contract`.
ENGINE_LIBRARIES = ("uvicorn", "starlette", "prometheus_client", "httpx", "httpcore", "asyncpg")
# Calls that load a module by its name, as an import statement does (importlib's,
# the builtin, pkgutil's "module:attribute", runpy's, and find_spec's loader).
IMPORTS_BY_NAME = frozenset(
    {"import_module", "__import__", "resolve_name", "run_module", "find_spec"}
)
# The one module allowed to import by a name read at run time: the registry, whose
# names are REGISTRY's values (test_the_registry_loads_only_formats).
REGISTRY_MODULE = "proxy.formats"
UNREADABLE = "<a module by a name the checker cannot read>"
# Layers whose modules `import proxy.contract` (and a format: its package is the
# registry, which imports only the contract) may load.
CONTRACT_CLOSURE_LAYERS = {"foundation", "config vocabulary", "contract", "formats", "registry"}


# -- the layer table -------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    name: str
    modules: frozenset[str]  # exact names, or "pkg.*" for the modules inside pkg
    may_import: frozenset[str]  # layer names (its own layer is always allowed)


def read_layers(text: str) -> list[Layer]:
    """The rows of the table under "## Layers"."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        modules = frozenset(re.findall(r"`([^`]+)`", cells[1]))
        allowed = frozenset(n.strip() for n in cells[2].split(",") if n.strip())
        layers.append(Layer(cells[0], modules, allowed))
    return layers


def layer_of(module: str, layers: list[Layer]) -> Layer | None:
    """The layer that names ``module`` exactly, else the one whose ``pkg.*`` is the
    longest package prefix of it."""
    for layer in layers:
        if module in layer.modules:
            return layer
    best: tuple[int, Layer] | None = None
    for layer in layers:
        for pattern in layer.modules:
            prefix = pattern.endswith(".*") and module.startswith(pattern[:-1])
            if prefix and (best is None or len(pattern) > best[0]):
                best = (len(pattern), layer)
    return best[1] if best else None


# -- imports, read from the source -------------------------------------------------------


def imports_in(source: str, module: str, known: set[str], is_package: bool = False) -> set[str]:
    """Every module of the package that ``source`` imports: at the top, in functions, in
    ``if TYPE_CHECKING:`` blocks (ast.walk sees them all). ``from a import b`` imports
    ``a.b`` when that is a module, else ``a``; relative imports are resolved."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "proxy")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "proxy":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
        elif isinstance(node, ast.Call) and _called_name(node.func) in IMPORTS_BY_NAME:
            argument = node.args[0] if node.args else None
            for keyword in node.keywords:
                if keyword.arg in ("name", "modname"):
                    argument = keyword.value
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                target = argument.value.partition(":")[0]  # resolve_name's "module:attr"
                if target.split(".")[0] == "proxy":
                    found.add(target)
            elif module != REGISTRY_MODULE:
                found.add(UNREADABLE)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "modules"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
            and node.slice.value.split(".")[0] == "proxy"
        ):
            found.add(node.slice.value)  # sys.modules["proxy.x"]
    found.discard(module)
    return found


def _called_name(func: ast.expr) -> str | None:
    """``f`` of ``f(...)``, ``a.f(...)``: how a call reaches it does not matter."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def violations(graph: Mapping[str, set[str]], layers: list[Layer]) -> list[str]:
    """What breaks the layer order in ``graph`` (module -> modules it imports)."""
    by_name = {layer.name: layer for layer in layers}
    problems = []
    for module in sorted(graph):
        own = layer_of(module, layers)
        if own is None:
            problems.append(f"{module} is in no layer of docs/architecture.md")
            continue
        for target in sorted(graph[module]):
            if target == UNREADABLE:
                problems.append(
                    f"{module} imports a module by a name the checker cannot read: "
                    "name it with a string literal"
                )
                continue
            theirs = layer_of(target, layers)
            if theirs is None:
                problems.append(f"{module} imports {target}, which is in no layer")
            elif theirs.name != own.name and theirs.name not in own.may_import:
                problems.append(
                    f"{module} ({own.name}) imports {target} ({theirs.name}): "
                    f"the {own.name} layer may import only "
                    f"{', '.join(sorted(own.may_import)) or 'itself'}"
                )
    for layer in layers:
        unknown = layer.may_import - by_name.keys()
        if unknown:
            problems.append(f"layer {layer.name} names unknown layers {sorted(unknown)}")
    return problems


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(p): p for p in PROXY.rglob("*.py")}
LAYERS = read_layers(DOC.read_text())


def package_graph() -> dict[str, set[str]]:
    known = set(SOURCES)
    return {
        name: imports_in(path.read_text(), name, known, path.name == "__init__.py")
        for name, path in SOURCES.items()
    }


def test_every_module_is_in_exactly_one_layer() -> None:
    assert LAYERS, "docs/architecture.md has no layer table under '## Layers'"
    for name in SOURCES:
        exact = [layer.name for layer in LAYERS if name in layer.modules]
        assert len(exact) <= 1, f"{name} is named by several layers: {exact}"
        assert layer_of(name, LAYERS) is not None, f"{name} is in no layer"
    named = {m for layer in LAYERS for m in layer.modules if not m.endswith(".*")}
    assert named <= set(SOURCES), (
        f"the table names modules that do not exist: {named - set(SOURCES)}"
    )


def test_every_import_follows_the_layer_order() -> None:
    assert violations(package_graph(), LAYERS) == []


def test_nothing_in_the_package_imports_the_test_seams() -> None:
    # proxy.testing is for tests (and format authors' tests); no layer lists it.
    for module, imported in package_graph().items():
        if not module.startswith("proxy.testing"):
            assert not any(i.startswith("proxy.testing") for i in imported), module


# -- the checker itself, on synthetic modules ---------------------------------------------


def synthetic(sources: dict[str, str]) -> list[str]:
    known = set(SOURCES) | set(sources)
    graph = {
        name: imports_in(text, name, known, name in SOURCES and SOURCES[name].name == "__init__.py")
        for name, text in sources.items()
    }
    return violations(graph, LAYERS)


def test_the_checker_refuses_the_contract_importing_the_engine() -> None:
    found = synthetic({"proxy.contract": "from proxy.http import responses\n"})
    assert found == [
        "proxy.contract (contract) imports proxy.http.responses (transfer): the contract "
        "layer may import only config vocabulary, foundation"
    ]


def test_the_checker_sees_imports_in_functions_and_type_checking_blocks() -> None:
    found = synthetic(
        {
            "proxy.catalog.base": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from proxy.cache import Cache\n"
            ),
            "proxy.storage.blobs": "def f():\n    import proxy.engine\n",
        }
    )
    assert [line.split(":")[0] for line in found] == [
        "proxy.catalog.base (backends) imports proxy.cache (services)",
        "proxy.storage.blobs (backends) imports proxy.engine (composition root)",
    ]


def test_the_checker_refuses_a_format_reaching_past_the_contract() -> None:
    found = synthetic(
        {
            "proxy.formats.npm": "from proxy.exceptions import NotFound\n",
            "proxy.formats.pypi": "from proxy.formats import simple_index\n",
        }
    )
    assert len(found) == 1 and found[0].startswith(
        "proxy.formats.npm (formats) imports proxy.exceptions (foundation)"
    )


def test_the_checker_refuses_the_engine_importing_a_format() -> None:
    found = synthetic(
        {
            "proxy.engine": "from proxy import formats\nfrom proxy.formats import maven\n",
            "proxy.cache": "from proxy import formats\n",
        }
    )
    assert [line.split(":")[0] for line in found] == [
        "proxy.cache (services) imports proxy.formats (registry)",
        "proxy.engine (composition root) imports proxy.formats.maven (formats)",
    ]


def test_the_checker_resolves_relative_imports_and_import_module() -> None:
    found = synthetic(
        {
            "proxy.runtime.tasks": "from ..catalog import Catalog\n",
            "proxy.jobs.sweep": "import importlib\nimportlib.import_module('proxy.cli')\n",
        }
    )
    assert [line.split(":")[0] for line in found] == [
        "proxy.jobs.sweep (services) imports proxy.cli (entry points)",
        "proxy.runtime.tasks (runtime) imports proxy.catalog (backends)",
    ]


def test_the_checker_sees_every_way_to_import_by_name() -> None:
    """``import_module`` however it is reached, ``__import__``, ``pkgutil.resolve_name``
    and ``sys.modules[...]`` load a module as surely as an import statement; a name the
    checker cannot read (a variable, an f-string) is refused outright, except in the
    registry, whose names are REGISTRY's (checked to be formats below)."""
    found = synthetic(
        {
            "proxy.formats.npm": (
                "from importlib import import_module\n"
                "def f():\n"
                "    import_module('proxy.http.responses')\n"
                "    __import__('proxy.engine')\n"
            ),
            "proxy.formats.raw": "import pkgutil\npkgutil.resolve_name('proxy.cli:main')\n",
            "proxy.formats.maven": "import sys\nsys.modules['proxy.cache'].Cache\n",
            "proxy.formats.pypi": (
                "import importlib\nname = 'proxy.' + 'engine'\nimportlib.import_module(name)\n"
            ),
            "proxy.formats": (
                "import importlib\nimportlib.import_module(REGISTRY[name])\nfrom .. import engine\n"
            ),
        }
    )
    assert [line.split(":")[0] for line in found] == [
        "proxy.formats (registry) imports proxy.engine (composition root)",
        "proxy.formats.maven (formats) imports proxy.cache (services)",
        "proxy.formats.npm (formats) imports proxy.engine (composition root)",
        "proxy.formats.npm (formats) imports proxy.http.responses (transfer)",
        "proxy.formats.pypi imports a module by a name the checker cannot read",
        "proxy.formats.raw (formats) imports proxy.cli (entry points)",
    ]


def test_the_registry_loads_only_formats() -> None:
    for name, module in formats.REGISTRY.items():
        layer = layer_of(module, LAYERS)
        assert layer is not None and layer.name == "formats", (name, module)


def test_the_checker_reports_a_module_of_no_layer() -> None:
    assert synthetic({"proxy.stray": ""}) == ["proxy.stray is in no layer of docs/architecture.md"]


# -- what an import really loads ------------------------------------------------------------


def loaded_by(statement: str) -> list[str]:
    """``sys.modules`` after ``statement`` in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded: list[str] = json.loads(result.stdout)
    return loaded


def _outside_the_contract(loaded: list[str]) -> list[str]:
    engine = []
    for name in loaded:
        if name.split(".")[0] in ENGINE_LIBRARIES:
            engine.append(name)
        elif name.split(".")[0] == "proxy":
            layer = layer_of(name, LAYERS)
            if layer is None or layer.name not in CONTRACT_CLOSURE_LAYERS:
                engine.append(name)
    return engine


def test_importing_the_contract_loads_nothing_of_the_engine() -> None:
    loaded = loaded_by("import proxy.contract")
    assert "proxy.contract" in loaded
    assert _outside_the_contract(loaded) == []
    assert not any(name.startswith("proxy.formats") for name in loaded)


def test_importing_every_format_loads_nothing_of_the_engine() -> None:
    statement = "\n".join(f"import {module}" for module in sorted(formats.REGISTRY.values()))
    loaded = loaded_by(statement)
    assert set(formats.REGISTRY.values()) <= set(loaded)
    assert _outside_the_contract(loaded) == []


def test_an_adapter_is_handed_no_upstream_client() -> None:
    """A format reaches the upstream only through its Origin, which the engine opens on a
    miss (single flight, lease, negative entry): the context its adapter is built with
    holds no client to ask the upstream past them (docs/architecture.md, "The request
    path of a miss")."""
    for context in (ProxyContext, HostedContext):
        held = {f.name: str(f.type) for f in dataclasses.fields(context)}
        assert not any("UpstreamClient" in kind for kind in held.values()), (context, held)


def libraries_in(source: str) -> set[str]:
    """The top-level packages other than ours that ``source`` imports anywhere (in
    functions too, by name too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and _called_name(node.func) in IMPORTS_BY_NAME
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(str(node.args[0].value).partition(":")[0].split(".")[0])
    return found - {"proxy"}


def engine_libraries_of_the_contract(sources: Mapping[str, str]) -> list[str]:
    """Modules that ``import proxy.contract`` may load, importing an engine library
    somewhere: the runtime closure test sees an import only if it runs at import time."""
    problems = []
    for module, source in sorted(sources.items()):
        layer = layer_of(module, LAYERS)
        if layer is not None and layer.name in CONTRACT_CLOSURE_LAYERS:
            for library in sorted(libraries_in(source) & set(ENGINE_LIBRARIES)):
                problems.append(f"{module} ({layer.name}) imports {library}, of the engine")
    return problems


def test_nothing_the_contract_loads_imports_an_engine_library_even_later() -> None:
    assert engine_libraries_of_the_contract({m: p.read_text() for m, p in SOURCES.items()}) == []
    hidden = {
        "proxy.types": "def f():\n    import httpx\n",
        "proxy.formats.npm": "import importlib\nimportlib.import_module('starlette.responses')\n",
        "proxy.engine": "import httpx\n",  # the engine may
    }
    assert engine_libraries_of_the_contract(hidden) == [
        "proxy.formats.npm (formats) imports starlette, of the engine",
        "proxy.types (foundation) imports httpx, of the engine",
    ]


# -- the module map ----------------------------------------------------------------------


def mapped_files(text: str) -> set[str]:
    """The files the "## Module map" block lists, as paths (``proxy/http/app.py``)."""
    block = text.split("\n## Module map\n", 1)[1].split("```", 2)[1]
    entry = re.compile(r"^( *)([A-Za-z0-9_]+(?:\.py|/))(?:\s{2,}|$)")
    stack: list[tuple[int, str]] = []
    files = set()
    for line in block.splitlines():
        match = entry.match(line)
        if match is None or len(match.group(1)) > 12:
            continue  # a description's continuation
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(part for _, part in stack) + name
        if name.endswith("/"):
            stack.append((indent, name))
        else:
            files.add(path)
    return files


def _files_with_code() -> Iterator[str]:
    """Every module but the package files that hold only a docstring."""
    for path in PROXY.rglob("*.py"):
        body = ast.parse(path.read_text()).body
        only_docstring = len(body) <= 1 and all(
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body
        )
        if path.name == "__init__.py" and only_docstring:
            continue
        yield str(path.relative_to(ROOT))


def test_the_module_map_lists_every_module_and_no_other() -> None:
    listed = mapped_files(DOC.read_text())
    on_disk = set(_files_with_code())
    assert sorted(on_disk - listed) == [], "modules missing from the module map"
    assert sorted(listed - on_disk) == [], "the module map lists files that do not exist"


# -- formats and SQL --------------------------------------------------------------------


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


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """Any module may be the first of the package a process imports (a spawned worker
    unpickles its target by module name): one that finds another half-initialized
    through an import cycle fails there (the hit lane's protocol once did, killing the
    page parser's child processes)."""
    modules = sorted(package_graph())
    code = (
        "import importlib, sys, traceback\n"
        "from prometheus_client import REGISTRY\n"
        f"failed = []\nfor name in {modules!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'proxy' or m.startswith('proxy.')]:\n"
        "        del sys.modules[loaded]\n"
        # proxy.runtime.metrics registers its metrics again as it is imported again
        "    for collector in list(REGISTRY._collector_to_names):\n"
        "        REGISTRY.unregister(collector)\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc().splitlines()[-1])\n"
        "print('\\n'.join(failed))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "", result.stdout
