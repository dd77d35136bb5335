"""npm's packuments: our neutral model of an upstream packument, what it lists, its two
renderings, and questions on it (docs/architecture.md, "Index documents").

A packument is stored once, as the upstream's *full* document made neutral: every
``dist.tarball`` is ``BASE_URL_MARK`` + our path of it (each client gets its own
absolute URL, nothing stored depends on a Host header), versions we could not serve
safely are left out. The full form (``application/json``) and the abbreviated one
(``application/vnd.npm.install-v1+json``, what ``npm install`` asks for) are rendered
from it per request, leaving out what the release policy withholds: those versions,
their ``time``, and the dist-tags naming them (``latest`` moves to the newest version
left). Everything here is pure and runs in ``compute``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urljoin, urlsplit

from univers.versions import InvalidVersion, SemverVersion

from proxy.contract import (
    BASE_URL_MARK,
    KNOWN_DIGESTS,
    Digests,
    IndexModel,
    Link,
    LinkBatch,
    ListedVersion,
    Listing,
    MirrorVersions,
    View,
)

Representation = Literal["full", "abbreviated"]
# What the abbreviated form keeps of each version (the registry's "corgi" documents).
ABBREVIATED_FIELDS = (
    "name", "version", "dist", "deprecated", "dependencies", "optionalDependencies",
    "devDependencies", "bundleDependencies", "bundledDependencies", "peerDependencies",
    "peerDependenciesMeta", "acceptDependencies", "bin", "directories", "engines", "os",
    "cpu", "libc", "_hasShrinkwrap", "hasInstallScript", "funding", "license",
)  # fmt: skip
SRI_DIGESTS = {"sha1": "sha1", "sha256": "sha256", "sha384": "sha384", "sha512": "sha512"}
SRI_STRENGTH = ("sha1", "sha256", "sha384", "sha512")  # weakest first
VERSION_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,255}$")
TIME_KEYS = ("created", "modified")  # what ``time`` holds besides versions


def tarball_key(name: str, version: str) -> str:
    """``left-pad/-/left-pad-1.0.0.tgz``, ``@s/n/-/n-1.0.0.tgz``: a tarball's key."""
    return f"{name}/-/{name.rpartition('/')[2]}-{version}.tgz"


# -- the model ---------------------------------------------------------------------------


def neutral(body: bytes, page_url: str, repository: str, name: str) -> tuple[bytes, LinkBatch]:
    """Our neutral model of an upstream packument, and its tarball links (runs in
    ``ctx.compute``). ``ValueError`` if it is no packument (not JSON, nested past
    Python's recursion limit, NaN or Infinity, which npm's JSON parser refuses)."""
    try:
        return _neutral(body, page_url, repository, name)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None


def _neutral(body: bytes, page_url: str, repository: str, name: str) -> tuple[bytes, LinkBatch]:
    document = json.loads(body, parse_constant=_refuse_constant)
    if not isinstance(document, dict) or not isinstance(document.get("versions", {}), dict):
        raise ValueError("expected an object with a versions object")
    if document.get("name", name) != name:
        raise ValueError(f"it describes {document.get('name')!r}, not {name!r}")
    # A token no upstream text can hold, put where the marks go: after json.dumps (which
    # escapes every control character) it is swapped for the mark itself.
    token = "npm-proxy-" + secrets.token_hex(16)
    links = []
    versions: dict[str, Any] = {}
    for version, manifest in document.get("versions", {}).items():
        if not (
            isinstance(version, str) and VERSION_RE.match(version) and isinstance(manifest, dict)
        ):
            continue
        dist = manifest.get("dist")
        if not isinstance(dist, dict) or not isinstance(dist.get("tarball"), str):
            continue
        tarball: str = dist["tarball"]
        url = urljoin(page_url, tarball)
        if urlsplit(url).scheme not in ("http", "https"):
            continue
        key = tarball_key(name, version)
        links.append(Link(repository, key, url, dist_digests(dist)))
        versions[version] = {**manifest, "dist": {**dist, "tarball": token + key}}
    tags = document.get("dist-tags")
    tags = (
        {
            t: v
            for t, v in tags.items()
            if isinstance(t, str) and isinstance(v, str) and v in versions
        }
        if isinstance(tags, dict)
        else {}
    )
    model = {**document, "name": name, "dist-tags": tags, "versions": versions}
    text = json.dumps(model, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace(token, BASE_URL_MARK).encode("ascii"), LinkBatch.encode(links)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"it holds {name}, which is not JSON")


def dist_digests(dist: dict[str, Any]) -> Digests:
    """What a tarball must match, as npm checks it: the strongest algorithm of
    ``dist.integrity`` (Subresource Integrity: ``sha512-<base64>``, several separated by
    spaces; its first value), else ``dist.shasum`` (sha1, hex). npm checks nothing else,
    so neither do we: a stale ``shasum`` beside a right sha512 would otherwise refuse a
    tarball npm installs. A malformed value is left out (npm would not use it either)."""
    found: Digests = {}
    integrity = dist.get("integrity")
    if isinstance(integrity, str):
        for token in integrity.split():
            algorithm, _, value = token.partition("-")
            name = SRI_DIGESTS.get(algorithm.lower())
            if name is None or name not in KNOWN_DIGESTS or name in found:
                continue
            try:
                raw = base64.b64decode(value.split("?")[0], validate=True)
            except (binascii.Error, ValueError):
                continue
            if len(raw) == hashlib.new(name).digest_size:
                found[name] = raw.hex()
    if found:
        strongest = max(found, key=SRI_STRENGTH.index)
        return {strongest: found[strongest]}
    shasum = dist.get("shasum")
    if isinstance(shasum, str) and re.fullmatch(r"[0-9a-fA-F]{40}", shasum):
        return {"sha1": shasum.lower()}
    return {}


# Our models hold their marks as raw NULs inside strings, which no escaped text holds:
# parsed with a token in their place, so what they stand for is told apart from any
# other text, and put back as marks in what is answered.


def _parse_stored(body: bytes, token: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(body.replace(BASE_URL_MARK.encode(), token.encode()))
    return document


def _dumped(document: dict[str, Any], token: str) -> bytes:
    text = json.dumps(document, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace(token, BASE_URL_MARK).encode("ascii")


# -- the index document -------------------------------------------------------------------


def listing(body: bytes) -> Listing:
    """Each version and when it was published (``time``); a version without a time has
    its tarball as the file to remember the first sight of."""
    document = _parse_stored(body, "")
    name = document["name"]
    times = document.get("time")
    times = times if isinstance(times, dict) else {}
    found = []
    for version in document["versions"]:
        at_ms = _time_ms(times.get(version))
        found.append(
            ListedVersion(
                version, at_ms, () if at_ms is not None else (tarball_key(name, version),)
            )
        )
    return Listing(tuple(found), time_source="time")


def _time_ms(value: object) -> int | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return int(moment.timestamp() * 1000)


def render(body: bytes, view: View, representation: str) -> bytes:
    """The packument as clients get it, full or abbreviated, without the versions the
    engine withholds (nor their ``time``, nor dist-tags naming them; ``latest`` moves to
    the newest version left)."""
    token = "npm-proxy-" + secrets.token_hex(16)
    document = _parse_stored(body, token)
    if view.withheld:
        document = _without(document, set(view.withheld))
    if view.published:
        document = _with_first_sights(document, view.published)
    if representation == "full":
        return _dumped(document, token)
    modified = document.get("modified")
    if modified is None and isinstance(document.get("time"), dict):
        modified = document["time"].get("modified")
    abbreviated = {
        "name": document["name"],
        **({"modified": modified} if isinstance(modified, str) else {}),
        "dist-tags": document["dist-tags"],
        "versions": {
            v: {field: m[field] for field in ABBREVIATED_FIELDS if field in m}
            for v, m in document["versions"].items()
        },
    }
    return _dumped(abbreviated, token)


def _without(document: dict[str, Any], withheld: set[str]) -> dict[str, Any]:
    versions = {v: m for v, m in document["versions"].items() if v not in withheld}
    tags = {t: v for t, v in document["dist-tags"].items() if v in versions}
    if "latest" in document["dist-tags"] and "latest" not in tags:
        newest = newest_release(versions)
        if newest is not None:
            tags["latest"] = newest
    document = {**document, "versions": versions, "dist-tags": tags}
    times = document.get("time")
    if isinstance(times, dict):
        document["time"] = {k: t for k, t in times.items() if k in TIME_KEYS or k in versions}
    return document


def _with_first_sights(document: dict[str, Any], published: Mapping[str, int]) -> dict[str, Any]:
    """``time`` given a version the upstream gave none for, when this fleet first saw
    it (its tarball's first sight): what a client's own release-age check reads."""
    times = document.get("time")
    times = dict(times) if isinstance(times, dict) else {}
    name = document["name"]
    for version in document["versions"]:
        if _time_ms(times.get(version)) is None:
            at_ms = published.get(tarball_key(name, version))
            if at_ms is not None:
                times[version] = _format_time(at_ms)
    return {**document, "time": times}


def _format_time(at_ms: int) -> str:
    """npm's form: ``2024-01-02T03:04:05.678Z``."""
    moment = datetime.fromtimestamp(at_ms / 1000, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at_ms % 1000:03d}Z"


def newest_release(versions: dict[str, Any]) -> str | None:
    """The highest version by semver that is no prerelease, else the highest of all."""
    ordered: list[tuple[SemverVersion, str]] = []
    for version in versions:
        try:
            ordered.append((SemverVersion(version), version))
        except (InvalidVersion, ValueError):
            continue
    ordered.sort()
    releases = [v for key, v in ordered if not key.value.prerelease]
    if releases:
        return releases[-1]
    return ordered[-1][1] if ordered else None


PACKUMENT = IndexModel(listing=listing, render=render)


# -- questions on a rendering (run in ``compute``) -----------------------------------------


def dist_tags_of(body: bytes) -> bytes:
    """The packument's dist-tags, as JSON."""
    return json.dumps(_parse_stored(body, "")["dist-tags"]).encode()


def versions_to_mirror(
    body: bytes, version: str | None, versions: MirrorVersions
) -> tuple[list[str], list[str]]:
    """(the versions to warm, those asked for that the packument does not list)."""
    document = _parse_stored(body, "")
    listed = list(document["versions"])
    if version is not None:
        chosen = [version]
    elif versions == "all":
        chosen = listed
    else:
        chosen = [v for v in (document["dist-tags"].get("latest"),) if v is not None]
    return chosen, [v for v in chosen if v not in document["versions"]]


def manifest_of(body: bytes, wanted: str) -> bytes | None:
    """One version's document (``wanted``: a version or a dist-tag) as JSON, its marks
    in place; None if there is no such version."""
    token = "npm-proxy-" + secrets.token_hex(16)
    document = _parse_stored(body, token)
    manifest = document["versions"].get(document["dist-tags"].get(wanted, wanted))
    if not isinstance(manifest, dict):
        return None
    return json.dumps(manifest, ensure_ascii=True).replace(token, BASE_URL_MARK).encode("ascii")
