"""Package URLs (purls) -> ``PackageRef``, the value formats receive.

Parsing is packageurl-python's (it also normalizes names the way each type's spec
says, e.g. PyPI's lower case and dashes); this module only maps its result onto our
own value type, so formats never import a third-party purl library.
"""

from __future__ import annotations

from packageurl import PackageURL

from proxy.types import PackageRef


def parse_purl(text: str) -> PackageRef:
    """The package a purl names; ``ValueError`` (with a reason) if it is not a purl."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{text!r} is not a package URL; use e.g. pkg:pypi/requests@2.32.3")
    try:
        parsed = PackageURL.from_string(text.strip())
    except ValueError as exc:
        raise ValueError(
            f"{text!r} is not a package URL ({exc}); use e.g. pkg:pypi/requests@2.32.3"
        ) from None
    qualifiers = parsed.qualifiers if isinstance(parsed.qualifiers, dict) else {}
    return PackageRef(
        type=parsed.type,
        name=parsed.name,
        namespace=parsed.namespace or None,
        version=parsed.version or None,
        qualifiers=tuple(sorted((str(k), str(v)) for k, v in qualifiers.items())),
        purl=parsed.to_string(),
    )
