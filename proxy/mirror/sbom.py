"""The package URLs an SBOM lists: CycloneDX JSON and SPDX JSON (2.x and 3.0).

Only the purl fields are read, with the standard library's JSON parser: the full
CycloneDX and SPDX models (cyclonedx-python-lib, spdx-tools) bring several
dependencies each and reject documents of spec versions they do not know, while a
mirror needs one field per package. Purls themselves are parsed by packageurl-python
(``proxy/mirror/purls.py``). Pure functions: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

MAX_DEPTH = 64  # nested CycloneDX components


def purls_in_sbom(data: bytes) -> list[str]:
    """Every purl the document lists, in order, without duplicates.

    ``ValueError`` (with a reason) if it is not a CycloneDX or SPDX JSON document.
    """
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:  # a hostile document: [[[[... 100,000 deep
        raise ValueError("not an SBOM: JSON nested too deeply") from None
    if not isinstance(doc, dict):
        raise ValueError("not a CycloneDX or SPDX JSON document (the top level is not an object)")
    if doc.get("bomFormat") == "CycloneDX":
        found = list(_cyclonedx(doc.get("components"), 0))
    elif isinstance(doc.get("spdxVersion"), str):
        found = list(_spdx2(doc.get("packages")))
    elif isinstance(doc.get("@graph"), list):
        found = list(_spdx3(doc["@graph"]))
    else:
        raise ValueError(
            "not a CycloneDX JSON (bomFormat) or SPDX JSON (spdxVersion, @graph) document"
        )
    return list(dict.fromkeys(found))


def _cyclonedx(components: Any, depth: int) -> Iterator[str]:
    # metadata.component is the subject of the SBOM (the application), not a dependency.
    if not isinstance(components, list) or depth > MAX_DEPTH:
        return
    for component in components:
        if not isinstance(component, dict):
            continue
        purl = component.get("purl")
        if isinstance(purl, str) and purl:
            yield purl
        yield from _cyclonedx(component.get("components"), depth + 1)


def _spdx2(packages: Any) -> Iterator[str]:
    for package in packages if isinstance(packages, list) else ():
        refs = package.get("externalRefs") if isinstance(package, dict) else None
        for ref in refs if isinstance(refs, list) else ():
            if (
                isinstance(ref, dict)
                and ref.get("referenceType") == "purl"
                and isinstance(ref.get("referenceLocator"), str)
            ):
                yield ref["referenceLocator"]


def _spdx3(graph: list[Any]) -> Iterator[str]:
    for element in graph:
        if isinstance(element, dict) and isinstance(element.get("software_packageUrl"), str):
            yield element["software_packageUrl"]
