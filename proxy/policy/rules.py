"""``[[policy.rules]]`` compiled: which rule a package version falls under.

A rule matches a package named by a purl (packageurl-python), optionally narrowed to
a vers range (univers, which orders versions by each ecosystem's own rules: PEP 440
for PyPI, Maven's ordering, semver for npm). The first rule that matches wins
(docs/architecture.md, "Release policy"). Rules are compiled once per policy, and
indexed by package, so finding a version's rule is one dict lookup and a range check.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from packageurl import PackageURL
from packaging.utils import canonicalize_name
from univers.version_range import RANGE_CLASS_BY_SCHEMES, VersionRange

from proxy.config.settings import PolicyRule

PackageId = tuple[str, str | None, str]
"""(purl type, namespace, name), normalized as the type's spec says."""


def package_id(purl_type: str, namespace: str | None, name: str) -> PackageId:
    """One spelling per package: PyPI names are compared normalized (PEP 503), other
    types as the purl has them."""
    if purl_type == "pypi":
        return purl_type, None, canonicalize_name(name)
    return purl_type, namespace or None, name


def parse_match(text: str) -> tuple[PackageId, str]:
    """A rule's ``match``: the package it names and its canonical purl; ``ValueError``
    for anything but a purl of a package (no version, qualifiers or subpath)."""
    example = 'use e.g. "pkg:pypi/requests" or "pkg:maven/org.example/lib"'
    try:
        purl = PackageURL.from_string(text.strip())
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a package URL ({exc}); {example}") from None
    if purl.version:
        raise ValueError(
            f"{text!r} names a version; match names a package, and versions (a vers range, "
            f'e.g. "vers:{purl.type}/>=1.2|<1.3") narrows it'
        )
    if purl.qualifiers or purl.subpath:
        raise ValueError(f"{text!r} has qualifiers or a subpath; match names a package only")
    return package_id(purl.type, purl.namespace, purl.name), purl.to_string()


def parse_versions(text: str, purl_type: str) -> Any:
    """A rule's ``versions``: a vers range (univers' ``VersionRange``) in the scheme of its
    purl's type; ``ValueError``."""
    example = f'use e.g. "vers:{purl_type}/>=1.2|<1.3"'
    if purl_type not in RANGE_CLASS_BY_SCHEMES:
        raise ValueError(f"no version ranges are known for purl type {purl_type!r}")
    try:
        versions = VersionRange.from_string(text.strip())  # type: ignore[no-untyped-call]
    except Exception as exc:  # univers raises ValueError and its own InvalidVersion
        raise ValueError(f"{text!r} is not a version range ({exc}); {example}") from None
    scheme = text.strip().removeprefix("vers:").split("/", 1)[0]
    if scheme != purl_type:
        raise ValueError(
            f"{text!r} orders versions as {scheme!r}, but the rule matches {purl_type!r} "
            f"packages; {example}"
        )
    return versions


@dataclass(frozen=True)
class CompiledRule:
    rule: PolicyRule
    versions: Any  # a univers VersionRange (untyped), or None: every version

    def covers(self, version: str | None) -> bool:
        """Does the rule hold for ``version``? Every version when it has no range; a
        version its ecosystem cannot order (or none) is outside any range."""
        if self.versions is None:
            return True
        if version is None:
            return False
        try:
            return bool(self.versions.version_class(version) in self.versions)
        except Exception:  # a version string the scheme cannot parse
            return False


class Rules:
    """The rules of one policy, by package, in the order they were written."""

    def __init__(self, rules: Iterable[PolicyRule]) -> None:
        self._by_package: dict[PackageId, list[CompiledRule]] = {}
        for rule in rules:
            package, _ = parse_match(rule.match)
            versions = parse_versions(rule.versions, package[0]) if rule.versions else None
            self._by_package.setdefault(package, []).append(CompiledRule(rule, versions))

    def __bool__(self) -> bool:
        return bool(self._by_package)

    def first(self, package: PackageId, version: str | None) -> PolicyRule | None:
        """The first rule for ``package`` that covers ``version``, or None."""
        for compiled in self._by_package.get(package, ()):
            if compiled.covers(version):
                return compiled.rule
        return None

    def names_any_version(self, package: PackageId) -> bool:
        """Could a rule apply to some version of ``package``?"""
        return package in self._by_package
