"""maven's ``maven-metadata.xml``: reading it safely, and serving it as an index document
(docs/architecture.md, "Index documents").

The stored model of an artifact's metadata is the upstream's own document (of the
first upstream that has one, as for every file): served as is while the release policy
withholds nothing, so its checksums stay the upstream's. When it withholds versions,
a clean document is written from what was parsed: the versions left, ``latest`` and
``release`` recomputed by Maven's version order, ``lastUpdated`` the newest publish
time the engine knows of a version left. Everything here is pure (run in ``compute``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from xml.etree.ElementTree import Element

from defusedxml import ElementTree as SafeXml
from defusedxml.common import DefusedXmlException
from univers.versions import InvalidVersion, MavenVersion

from proxy.contract import (
    IndexModel,
    ListedVersion,
    Listing,
    MirrorVersions,
    UpstreamUnavailable,
    View,
)

SEGMENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+~-]*$")
_TIMESTAMP_RE = re.compile(r"^\d{14}$")
TIMESTAMP_FORMAT = "%Y%m%d%H%M%S"  # lastUpdated, UTC


@dataclass(frozen=True)
class ArtifactVersions:
    release: str | None
    latest: str | None
    versions: list[str]
    group_id: str | None = None
    artifact_id: str | None = None
    last_updated: str | None = None  # yyyyMMddHHmmss, UTC


def parse_metadata(body: bytes, where: str) -> ArtifactVersions:
    """The versions an artifact-level maven-metadata.xml lists (parsed safely: no
    entities, no external references); a group's metadata lists none."""
    try:
        root = SafeXml.fromstring(body)
    except (SafeXml.ParseError, DefusedXmlException, ValueError) as exc:
        raise UpstreamUnavailable(f"{where} is not valid metadata: {exc}") from exc

    def child(node: Element | None, name: str) -> Element | None:
        if node is None:
            return None
        return next((c for c in node if c.tag.rsplit("}", 1)[-1] == name), None)

    def text(node: Element | None) -> str | None:
        value = (node.text or "").strip() if node is not None else ""
        return value if value and SEGMENT_RE.match(value) else None

    versioning = child(root, "versioning")
    listed = child(versioning, "versions")
    versions = [v for v in (text(c) for c in (listed if listed is not None else [])) if v]
    updated = text(child(versioning, "lastUpdated"))
    return ArtifactVersions(
        release=text(child(versioning, "release")),
        latest=text(child(versioning, "latest")),
        versions=list(dict.fromkeys(versions)),
        group_id=text(child(root, "groupId")),
        artifact_id=text(child(root, "artifactId")),
        last_updated=updated if updated and _TIMESTAMP_RE.match(updated) else None,
    )


def select_versions(found: ArtifactVersions, versions: MirrorVersions) -> list[str]:
    """``latest``: the <release>, else the last listed non-SNAPSHOT version; ``all``:
    every listed non-SNAPSHOT version (in the order listed)."""
    releases = [v for v in found.versions if not v.endswith("-SNAPSHOT")]
    if versions == "all":
        return releases
    if found.release and not found.release.endswith("-SNAPSHOT"):
        return [found.release]
    return releases[-1:]


def newest(versions: Iterable[str]) -> str | None:
    """The highest of ``versions`` by Maven's order (one it cannot read counts lowest)."""
    best: tuple[MavenVersion | None, str] | None = None
    for version in versions:
        try:
            key: MavenVersion | None = MavenVersion(version)
        except (InvalidVersion, ValueError):
            key = None
        if best is None or _above(key, best[0]):
            best = (key, version)
    return best[1] if best is not None else None


def _above(key: MavenVersion | None, than: MavenVersion | None) -> bool:
    if key is None:
        return False
    return than is None or bool(key > than)


def pom_key(group_id: str, artifact_id: str, version: str) -> str:
    return f"{group_id.replace('.', '/')}/{artifact_id}/{version}/{artifact_id}-{version}.pom"


def is_snapshot(version: str) -> bool:
    return version.endswith("-SNAPSHOT")


def write(
    group_id: str | None,
    artifact_id: str | None,
    versions: list[str],
    latest: str | None,
    release: str | None,
    last_updated: str | None,
) -> bytes:
    """A metadata document of our own; every value was checked against ``SEGMENT_RE``
    when parsed, so none needs escaping."""
    lines = ['<?xml version="1.0" encoding="UTF-8"?>', "<metadata>"]
    if group_id:
        lines.append(f"  <groupId>{group_id}</groupId>")
    if artifact_id:
        lines.append(f"  <artifactId>{artifact_id}</artifactId>")
    lines.append("  <versioning>")
    if latest:
        lines.append(f"    <latest>{latest}</latest>")
    if release:
        lines.append(f"    <release>{release}</release>")
    lines.append("    <versions>")
    lines += [f"      <version>{v}</version>" for v in versions]
    lines.append("    </versions>")
    if last_updated:
        lines.append(f"    <lastUpdated>{last_updated}</lastUpdated>")
    lines += ["  </versioning>", "</metadata>", ""]
    return "\n".join(lines).encode()


# -- the index document ---------------------------------------------------------------------


def listing(body: bytes) -> Listing:
    """The versions listed, their poms as the files to remember first sights of, and
    ``lastUpdated``: no version was published after it."""
    found = parse_metadata(body, "maven-metadata.xml")
    updated_ms = None
    if found.last_updated:
        moment = datetime.strptime(found.last_updated, TIMESTAMP_FORMAT).replace(tzinfo=UTC)
        updated_ms = int(moment.timestamp() * 1000)
    named = found.group_id is not None and found.artifact_id is not None
    return Listing(
        tuple(
            ListedVersion(
                version,
                None,
                (pom_key(found.group_id or "", found.artifact_id or "", version),) if named else (),
            )
            for version in found.versions
        ),
        time_source="Last-Modified of its pom",
        updated_at_ms=updated_ms,
    )


def render(body: bytes, view: View, representation: str) -> bytes:
    """The upstream's document as is, unless versions are withheld: then one of our
    own with them left out and ``latest``, ``release`` and ``lastUpdated`` recomputed."""
    if not view.withheld:
        return body
    found = parse_metadata(body, "maven-metadata.xml")
    left = [v for v in found.versions if v not in view.withheld]
    known = [
        view.published[key]
        for v in left
        if found.group_id
        and found.artifact_id
        and (key := pom_key(found.group_id, found.artifact_id, v)) in view.published
    ]
    last_updated = found.last_updated
    if known:
        last_updated = datetime.fromtimestamp(max(known) / 1000, UTC).strftime(TIMESTAMP_FORMAT)
    return write(
        group_id=found.group_id,
        artifact_id=found.artifact_id,
        versions=left,
        latest=newest(left),
        release=newest(v for v in left if not is_snapshot(v)),
        last_updated=last_updated,
    )


ARTIFACT_METADATA = IndexModel(listing=listing, render=render)
