"""pypi's stored page model: a project page as the proxy keeps it, what it lists, and
its two renderings (docs/architecture.md, "Index documents").

A project page is stored once, as this model (JSON), whatever the client asked for or
the upstream spoke; HTML and JSON are rendered from it per request, so a page fetched
for one representation serves the other too, fresh or stale. The model keeps every
field of the page (PEPs 592, 658/714, 700, 708, 740, 792) and each file's version, read
once from its name. Rendering applies the engine's ``View``: the versions it withholds
are left out (files and ``versions``), a quarantined project says so (PEP 792), and files
the upstream gave no ``upload-time`` get the time the engine knows. Every function here
is pure and runs in ``compute``.
"""

from __future__ import annotations

import html
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from proxy.contract import BASE_URL_MARK, ListedVersion, Listing, View
from proxy.formats.simple_index import FileLink, IndexFormatError, ProjectPage

MODEL_VERSION = 1
# What our pages claim: PEP 792's version of the API, when the page has what PEP 700 (1.1)
# makes mandatory (versions, every file's size); otherwise 1.0 with the newer fields.
API_VERSION = "1.4"
BASE_API_VERSION = "1.0"
_HASH_NAMES = ("sha256", "sha512", "sha384", "sha224", "sha1", "md5")
METADATA_SUFFIX = ".metadata"  # PEP 658: a file's core metadata beside it
PROVENANCE_SUFFIX = ".provenance"  # PEP 740: where we serve a file's provenance


def file_version(filename: str) -> Version | None:
    """The version in a wheel or sdist file name (None if it names none we can read)."""
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        return parse_sdist_filename(filename)[1]
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None


def file_key(project: str, filename: str) -> str:
    return f"files/{project}/{filename}"


def file_href(project: str, filename: str) -> str:
    """Where a project page at ``/{repo}/simple/{project}/`` sends clients for a file."""
    return f"../../files/{project}/{quote(filename, safe='')}"


# -- storing -------------------------------------------------------------------------------


def dump(page: ProjectPage, project: str) -> bytes:
    """The model of ``page`` (as parsed from the upstream), to store."""
    files = []
    for f in page.files:
        version = file_version(f.filename)
        item: dict[str, Any] = {"filename": f.filename, "hashes": f.hashes}
        item["version"] = str(version) if version is not None else None
        if f.requires_python:
            item["requires-python"] = f.requires_python
        if f.yanked:
            item["yanked"] = f.yanked
        if f.core_metadata:
            item["core-metadata"] = f.core_metadata
        if f.gpg_sig is not None:
            item["gpg-sig"] = f.gpg_sig
        if f.size is not None:
            item["size"] = f.size
        if f.upload_time:
            item["upload-time"] = f.upload_time
        if f.provenance:
            item["provenance"] = True  # its upstream URL is a recorded link, not ours to show
        files.append(item)
    versions = page.versions
    if versions is None and page.files:
        # An HTML page states no versions (PEP 700): those of its file names are known.
        found = {v for v in map(file_version, (f.filename for f in page.files)) if v}
        versions = [str(v) for v in sorted(found)]
    model = {
        "model": MODEL_VERSION,
        "project": project,
        "name": page.name,
        "versions": versions,
        "tracks": page.tracks,
        "alternate-locations": page.alternate_locations,
        "status": page.status,
        "status-reason": page.status_reason,
        "files": files,
    }
    return json.dumps(model, ensure_ascii=True, separators=(",", ":")).encode()


def load(body: bytes) -> dict[str, Any]:
    """A stored model, as the JSON object ``dump`` wrote; ``IndexFormatError`` if it is
    not one (never stored by us). Listing and rendering work on its dicts as they are:
    a page of 100,000 files is read in one ``json.loads``, with no object per file."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise IndexFormatError(f"not a stored page model: {exc}") from None
    if not isinstance(data, dict) or data.get("model") != MODEL_VERSION:
        raise IndexFormatError("not a stored page model")
    return data


def load_page(body: bytes) -> ProjectPage:
    """A stored model as a ``ProjectPage`` (mirrors pick its files by version)."""
    data = load(body)
    files = [
        FileLink(
            filename=item["filename"],
            url="",
            hashes=item["hashes"],
            requires_python=item.get("requires-python"),
            yanked=item.get("yanked", False),
            core_metadata=item.get("core-metadata", False),
            gpg_sig=item.get("gpg-sig"),
            size=item.get("size"),
            upload_time=item.get("upload-time"),
        )
        for item in data["files"]
    ]
    return ProjectPage(name=data["name"], files=files, versions=data["versions"])


# -- what it lists -------------------------------------------------------------------------


def listing(body: bytes) -> Listing:
    """Each version with files, when it was published (the earliest ``upload-time`` of its
    files: the release's own date) and the files whose time the page does not state."""
    data = load(body)
    project = data["project"]
    published: dict[str, int | None] = {}
    unstated: dict[str, list[str]] = {}
    for item in data["files"]:
        version = item["version"]
        if version is None:
            continue
        at_ms = parse_upload_time(item.get("upload-time"))
        earliest = published.get(version)
        if at_ms is not None and (earliest is None or at_ms < earliest):
            published[version] = at_ms
        else:
            published.setdefault(version, None)
        if at_ms is None:
            unstated.setdefault(version, []).append(file_key(project, item["filename"]))
    return Listing(
        tuple(
            ListedVersion(version, at_ms, tuple(unstated.get(version, ())))
            for version, at_ms in published.items()
        ),
        time_source="upload-time",
    )


def parse_upload_time(text: str | None) -> int | None:
    """PEP 700's ``upload-time`` (ISO 8601, UTC) as Unix ms; None if absent or unreadable."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def format_upload_time(at_ms: int) -> str:
    """PEP 700's form: ``2026-11-01T10:00:00.000000Z``."""
    moment = datetime.fromtimestamp(at_ms / 1000, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- rendering -----------------------------------------------------------------------------


@dataclass
class _Shown:
    """What one rendering shows: the model's page fields, the files left (model dicts)
    with the upload time each is shown with, the versions, and the status."""

    page: dict[str, Any]
    files: list[dict[str, Any]]
    upload_times: list[str | None]
    versions: list[str] | None
    status: str | None
    status_reason: str | None


def _shown(data: dict[str, Any], view: View) -> _Shown:
    if view.quarantined is not None:
        # PEP 792: a quarantined project offers no file at all.
        return _Shown(data, [], [], [], "quarantined", view.quarantined)
    project, withheld, known = data["project"], view.withheld, view.published
    files = []
    times: list[str | None] = []
    for item in data["files"]:
        version = item["version"]
        if version is not None and version in withheld:
            continue
        files.append(item)
        upload_time = item.get("upload-time")
        if upload_time is None and known:
            at_ms = known.get(file_key(project, item["filename"]))
            upload_time = format_upload_time(at_ms) if at_ms is not None else None
        times.append(upload_time)
    versions = data["versions"]
    if versions is not None and withheld:
        left_out = {Version(v) for v in withheld}
        versions = [v for v in versions if _version(v) not in left_out]
    return _Shown(data, files, times, versions, data["status"], data["status-reason"])


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def render(body: bytes, view: View, representation: str) -> bytes:
    """The page as clients get it, ``representation`` "json" or "html". The URLs of
    provenance files are absolute (PEP 740), so they hold ``BASE_URL_MARK``."""
    shown = _shown(load(body), view)
    if representation == "json":
        return _render_json(shown)
    return _render_html(shown)


def _render_json(shown: _Shown) -> bytes:
    # A token no upstream text can hold goes where the marks go: json.dumps escapes
    # every control character, so the mark itself is put in afterwards.
    token = "pypi-proxy-" + secrets.token_hex(16)
    project = shown.page["project"]
    v11 = shown.versions is not None and all("size" in f for f in shown.files)
    files = []
    for f, upload_time in zip(shown.files, shown.upload_times, strict=True):
        filename = f["filename"]
        item: dict[str, Any] = {
            "filename": filename,
            "url": file_href(project, filename),
            "hashes": f["hashes"],
        }
        if "requires-python" in f:
            item["requires-python"] = f["requires-python"]
        if "core-metadata" in f:
            item["core-metadata"] = f["core-metadata"]
            item["dist-info-metadata"] = f["core-metadata"]
        if "gpg-sig" in f:
            item["gpg-sig"] = f["gpg-sig"]
        if "yanked" in f:
            item["yanked"] = f["yanked"]
        if "size" in f:
            item["size"] = f["size"]
        if upload_time:
            item["upload-time"] = upload_time
        if f.get("provenance"):
            item["provenance"] = token + _provenance_path(project, filename)
        files.append(item)
    meta: dict[str, Any] = {"api-version": API_VERSION if v11 else BASE_API_VERSION}
    page = shown.page
    if page["tracks"]:
        meta["tracks"] = page["tracks"]
    data: dict[str, Any] = {"meta": meta, "name": page["name"], "files": files}
    if shown.versions is not None:
        data["versions"] = shown.versions
    if page["alternate-locations"]:
        data["alternate-locations"] = page["alternate-locations"]
    if shown.status is not None:
        status: dict[str, str] = {"status": shown.status}
        if shown.status_reason:
            status["reason"] = shown.status_reason
        data["project-status"] = status
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    return text.replace(token, BASE_URL_MARK).encode("ascii")


def _provenance_path(project: str, filename: str) -> str:
    return f"files/{project}/{quote(filename + PROVENANCE_SUFFIX, safe='')}"


def _text(value: str) -> str:
    """Text for an HTML page: escaped, and without NUL (the base-URL mark is one)."""
    return html.escape(value.replace(BASE_URL_MARK, "\ufffd"))


def _metas(name: str, values: Iterable[str]) -> list[str]:
    return [f'    <meta name="{name}" content="{_text(v)}">\n' for v in values]


def _render_html(shown: _Shown) -> bytes:
    page, project = shown.page, shown.page["project"]
    title = _text(f"Links for {page['name']}")
    out = [
        "<!DOCTYPE html>\n<html>\n  <head>\n",
        f'    <meta name="pypi:repository-version" content="{API_VERSION}">\n',
        *_metas("pypi:tracks", page["tracks"]),
        *_metas("pypi:alternate-locations", page["alternate-locations"]),
        *_metas("pypi:project-status", [shown.status] if shown.status else []),
        *_metas("pypi:project-status-reason", [shown.status_reason] if shown.status_reason else []),
        f"    <title>{title}</title>\n  </head>\n  <body>\n    <h1>{title}</h1>\n",
    ]
    for f in shown.files:
        filename, hashes = f["filename"], f["hashes"]
        href = file_href(project, filename)
        algo = next((n for n in _HASH_NAMES if n in hashes), None)
        if algo:
            href += f"#{algo}={hashes[algo]}"
        attrs = [f'href="{_text(href)}"']
        if "requires-python" in f:
            attrs.append(f'data-requires-python="{_text(f["requires-python"])}"')
        if f.get("yanked"):
            reason = f["yanked"] if isinstance(f["yanked"], str) else ""
            attrs.append(f'data-yanked="{_text(reason)}"')
        if f.get("core-metadata"):
            value = _core_metadata_attr(f["core-metadata"])
            attrs.append(f'data-dist-info-metadata="{value}"')
            attrs.append(f'data-core-metadata="{value}"')
        if "gpg-sig" in f:
            attrs.append(f'data-gpg-sig="{"true" if f["gpg-sig"] else "false"}"')
        if f.get("provenance"):
            url = BASE_URL_MARK + html.escape(_provenance_path(project, filename))
            attrs.append(f'data-provenance="{url}"')
        out.append(f"    <a {' '.join(attrs)}>{_text(filename)}</a><br />\n")
    out.append("  </body>\n</html>\n")
    return "".join(out).encode()


def _core_metadata_attr(core: bool | dict[str, str]) -> str:
    if isinstance(core, dict):
        algo = next((n for n in _HASH_NAMES if n in core), None)
        if algo:
            return _text(f"{algo}={core[algo]}")
    return "true"
