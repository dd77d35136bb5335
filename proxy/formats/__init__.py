"""The format registry: ``format = "..."`` -> the module that implements it.

Adding a format is one new module that defines ``FORMAT = FormatPlugin(...)`` (see
``proxy/contract.py`` and docs/architecture.md, "Adding a format") and one line here.
Modules are imported on first use, so a format's code is not loaded unless configured.
"""

from __future__ import annotations

import importlib
from typing import Any

from proxy.contract import FormatPlugin

REGISTRY: dict[str, str] = {
    "pypi": "proxy.formats.pypi",
    "maven": "proxy.formats.maven",
    "gradle-build-cache": "proxy.formats.gradle_cache",
    "raw": "proxy.formats.raw",
}


def plugin(name: str) -> FormatPlugin[Any]:
    """The plugin registered as ``name``; KeyError if there is none."""
    module = importlib.import_module(REGISTRY[name])
    found: FormatPlugin[Any] = module.FORMAT
    return found
