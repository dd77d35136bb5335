"""The Simple Repository API's pages (PEPs 503, 592, 629, 658, 691, 700, 708, 714, 740,
792): content negotiation, and parsing upstream pages (HTML or JSON) into a small model
that keeps every field. A project page is stored as our own model of it and rendered
per request (``simple_model.py``); root pages are rendered here.

Pages are parsed and rendered again, rather than edited in place, so every link we send
is one we built (relative, escaped) and either representation can be served whatever
the upstream speaks.
"""

from __future__ import annotations

import html
import json
import logging
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any
from urllib.parse import quote, urldefrag, urljoin, urlsplit

from proxy.contract import KNOWN_DIGESTS

JSON_V1 = "application/vnd.pypi.simple.v1+json"
HTML_V1 = "application/vnd.pypi.simple.v1+html"
TEXT_HTML = "text/html"
_ALIASES = {
    "application/vnd.pypi.simple.latest+json": JSON_V1,
    "application/vnd.pypi.simple.latest+html": HTML_V1,
}
# What we ask upstreams for, per representation we will render.
UPSTREAM_ACCEPT = {
    "json": f"{JSON_V1}, {HTML_V1};q=0.2, {TEXT_HTML};q=0.1",
    "html": f"{HTML_V1}, {TEXT_HTML};q=0.9, {JSON_V1};q=0.5",
}
log = logging.getLogger("proxy.pypi")

CONTENT_TYPES = {JSON_V1: JSON_V1, HTML_V1: HTML_V1, TEXT_HTML: "text/html; charset=utf-8"}

_PROJECT_NAME_RE = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$")
MAX_URL_CHARS = 8192
MAX_META_VALUES = 1000  # <meta name="pypi:..."> values kept per name (a hostile page)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_HEX_RE = re.compile(r"[0-9a-fA-F]{1,128}")  # used with fullmatch
_HASH_NAMES = ("sha256", "sha512", "sha384", "sha224", "sha1", "md5")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
# The string fields of a JSON file entry that end up in what we render or fetch.
_FILE_TEXT_FIELDS = ("filename", "url", "requires-python", "yanked", "upload-time", "provenance")
PROJECT_STATUSES = ("active", "archived", "quarantined", "deprecated")  # PEP 792


def normalize(name: str) -> str:
    """PEP 503 normalized name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_valid_project_name(name: str) -> bool:
    return len(name) <= 200 and _PROJECT_NAME_RE.match(name) is not None


def is_safe_filename(name: str) -> bool:
    return (
        0 < len(name) <= 255
        and not name.startswith(".")
        and not any(c in name for c in "/\\\x00\r\n")
    )


# -- negotiation -------------------------------------------------------------------


def negotiate(accept: str | None) -> tuple[str, str] | None:
    """Pick ``(representation, content type)`` from an Accept header; None means 406.

    Explicit types win by q-value, then JSON before HTML. A bare wildcard (no Accept,
    ``*/*``) gets text/html, which every client understands.
    """
    offers = (JSON_V1, HTML_V1, TEXT_HTML)
    ranges = [(_ALIASES.get(media, media), q) for media, q in _parse_accept(accept or "*/*")]
    best: tuple[float, int, int, str] | None = None
    for offer_rank, offer in enumerate(offers):
        # The most specific range that matches an offer sets its q (RFC 9110 §12.5.1):
        # "text/html;q=0, */*" refuses text/html whatever the wildcard says.
        matches = [(_match(media, offer), q) for media, q in ranges]
        matches = [(specificity, q) for specificity, q in matches if specificity >= 0]
        if not matches:
            continue
        specificity, q = max(matches)
        if q <= 0:
            continue
        preference = (2 - offer_rank) if specificity == 2 else offer_rank
        candidate = (q, specificity, preference, offer)
        if best is None or candidate > best:
            best = candidate
    if best is None:
        return None
    chosen = best[3]
    return ("json" if chosen == JSON_V1 else "html"), CONTENT_TYPES[chosen]


def _parse_accept(header: str) -> list[tuple[str, float]]:
    parsed = []
    for part in header.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if not media:
            continue
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
                q = min(max(q, 0.0), 1.0) if q == q else 0.0  # clamp; NaN refuses
        parsed.append((media.lower(), q))
    return parsed


def _match(media: str, offer: str) -> int:
    """2 exact, 1 ``type/*``, 0 ``*/*``, -1 no match."""
    if media == offer:
        return 2
    if media == "*/*":
        return 0
    kind, _, sub = media.partition("/")
    if sub == "*" and offer.startswith(kind + "/"):
        return 1
    return -1


# -- model -------------------------------------------------------------------------


@dataclass
class FileLink:
    filename: str
    url: str  # absolute upstream URL, fragment removed
    hashes: dict[str, str] = field(default_factory=dict)
    requires_python: str | None = None
    yanked: bool | str = False
    core_metadata: bool | dict[str, str] = False
    gpg_sig: bool | None = None
    size: int | None = None
    upload_time: str | None = None
    provenance: str | None = None  # PEP 740: the absolute upstream URL of its provenance


@dataclass
class ProjectPage:
    name: str
    files: list[FileLink]
    versions: list[str] | None = None
    tracks: list[str] = field(default_factory=list)  # PEP 708
    alternate_locations: list[str] = field(default_factory=list)  # PEP 708
    status: str | None = None  # PEP 792: active, archived, quarantined, deprecated
    status_reason: str | None = None


@dataclass
class RootPage:
    projects: list[str]


class IndexFormatError(ValueError):
    """The upstream page could not be understood."""


# -- parsing -----------------------------------------------------------------------


def parse_project(body: bytes, content_type: str, page_url: str, name: str) -> ProjectPage:
    if "json" in content_type:
        return _parse_project_json(body, page_url, name)
    return _parse_project_html(body, page_url, name)


def parse_root(body: bytes, content_type: str) -> RootPage:
    """The project names of a root page. Lean on memory: a real root page lists some
    600,000 projects, so only their names are kept, never a dict per project."""
    if "json" in content_type:
        data = _load_json(body, object_pairs_hook=_project_name_or_dict)
        projects = data.get("projects")
        if not isinstance(projects, list):
            raise IndexFormatError("JSON root page has no 'projects' list")
        names: list[str] = [p for p in projects if isinstance(p, _ProjectName)]
        if len(names) < len(projects):
            log.warning(
                "dropped %d entries without a project name (or not Unicode text) from a "
                "JSON root page",
                len(projects) - len(names),
            )
        return RootPage(names)
    parser = _AnchorTextParser()
    _feed(parser, body)
    return RootPage(parser.texts)


class _ProjectName(str):
    """A project entry of a JSON root page, reduced to its name while parsing."""


def _project_name_or_dict(pairs: list[tuple[str, Any]]) -> Any:
    for key, value in pairs:
        if key == "name" and isinstance(value, str) and value and is_text(value):
            return _ProjectName(value)
    return dict(pairs)


def is_text(value: str) -> bool:
    """Is ``value`` Unicode text? JSON can carry lone surrogates ("\\ud800"), which are
    no characters: they can be neither encoded as UTF-8 nor quoted into a URL."""
    return value.isascii() or _SURROGATE_RE.search(value) is None


class _AnchorTextParser(HTMLParser):
    """The text of every ``<a>``, and nothing else."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.texts: list[str] = []
        self._text: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._text is not None:
            text = "".join(self._text).strip()
            if text:
                self.texts.append(text)
            self._text = None


def _feed(parser: HTMLParser, body: bytes) -> None:
    """Feed in slices, so no second copy of a large page is held as one string."""
    step = 1 << 20
    for start in range(0, len(body), step):
        parser.feed(body[start : start + step].decode("utf-8", errors="replace"))
    parser.close()


def _load_json(body: bytes, **options: Any) -> dict[str, Any]:
    try:
        data = json.loads(body, **options)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IndexFormatError(f"invalid JSON: {exc}") from exc
    except RecursionError:
        raise IndexFormatError("JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise IndexFormatError("JSON page is not an object")
    return data


def _parse_project_json(body: bytes, page_url: str, name: str) -> ProjectPage:
    data = _load_json(body)
    raw_files = data.get("files")
    if not isinstance(raw_files, list):
        raise IndexFormatError("JSON project page has no 'files' list")
    files = []
    not_text = 0
    for raw in raw_files:
        if not isinstance(raw, dict) or not isinstance(raw.get("url"), str):
            continue
        if not all(is_text(v) for v in map(raw.get, _FILE_TEXT_FIELDS) if isinstance(v, str)):
            not_text += 1
            continue
        resolved = _resolve(page_url, raw["url"])
        if resolved is None:
            continue
        url, fragment = resolved
        hashes = _clean_hashes(raw.get("hashes"))
        hashes = hashes or _fragment_hashes(fragment)
        core = raw.get("core-metadata", raw.get("dist-info-metadata", False))
        yanked = raw.get("yanked", False)
        filename = raw.get("filename")
        files.append(
            FileLink(
                filename=filename if isinstance(filename, str) else url.rsplit("/", 1)[-1],
                url=url,
                hashes=hashes,
                requires_python=_string(raw.get("requires-python")),
                yanked=yanked if isinstance(yanked, bool | str) else bool(yanked),
                core_metadata=_clean_core_metadata(core),
                gpg_sig=raw.get("gpg-sig") if isinstance(raw.get("gpg-sig"), bool) else None,
                size=_size(raw.get("size")),
                upload_time=_string(raw.get("upload-time")),
                provenance=_absolute(page_url, raw.get("provenance")),
            )
        )
    if not_text:
        log.warning(
            "dropped %d file links with text that is not Unicode (lone surrogates) from %s",
            not_text,
            page_url,
        )
    versions = data.get("versions")
    page_name = data.get("name")
    meta = data.get("meta")
    status = data.get("project-status")
    status = status if isinstance(status, dict) else {}
    return ProjectPage(
        name=page_name if isinstance(page_name, str) and page_name and is_text(page_name) else name,
        files=files,
        versions=[v for v in versions if isinstance(v, str) and is_text(v)]
        if isinstance(versions, list)
        else None,
        tracks=_urls(page_url, meta.get("tracks") if isinstance(meta, dict) else None),
        alternate_locations=_urls(page_url, data.get("alternate-locations")),
        status=_status(status.get("status")),
        status_reason=_text_field(status.get("reason")),
    )


def _absolute(page_url: str, value: object) -> str | None:
    """An absolute http(s) URL from a link on the page, or None."""
    if not isinstance(value, str) or not value or not is_text(value):
        return None
    resolved = _resolve(page_url, value)
    if resolved is None or urlsplit(resolved[0]).scheme not in ("http", "https"):
        return None
    return resolved[0] + (f"#{resolved[1]}" if resolved[1] else "")


def _urls(page_url: str, value: object) -> list[str]:
    """PEP 708's lists of project URLs (on another index), absolute, as the page gives
    them; anything that is not a URL is left out."""
    if not isinstance(value, list):
        return []
    return [url for url in (_absolute(page_url, v) for v in value) if url is not None]


def _status(value: object) -> str | None:
    return value if isinstance(value, str) and value in PROJECT_STATUSES else None


def _text_field(value: object) -> str | None:
    return value if isinstance(value, str) and value and is_text(value) else None


def _resolve(base: str, link: str) -> tuple[str, str] | None:
    """``(absolute URL without fragment, fragment)``; None for a link that is not a URL."""
    if len(link) > MAX_URL_CHARS or _CONTROL_RE.search(link):
        log.warning(
            "ignoring a link with control characters or over %d characters on %s",
            MAX_URL_CHARS,
            base,
        )
        return None
    try:
        url, fragment = urldefrag(urljoin(base, link))
    except ValueError:  # e.g. "http://[bad/x.whl"
        log.warning("ignoring malformed link %r on %s", link[:200], base)
        return None
    return url, fragment


def _string(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _size(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _parse_project_html(body: bytes, page_url: str, name: str) -> ProjectPage:
    parser = _AnchorParser()
    _feed(parser, body)
    base = page_url
    if parser.base_href:
        resolved_base = _resolve(page_url, parser.base_href)
        base = resolved_base[0] if resolved_base else page_url
    files = []
    for attrs, text in parser.anchors:
        href = attrs.get("href")
        if not href:
            continue
        resolved = _resolve(base, href)
        if resolved is None:
            continue
        url, fragment = resolved
        filename = text.strip() or url.rsplit("/", 1)[-1]
        yanked: bool | str = False
        if "data-yanked" in attrs:
            yanked = attrs["data-yanked"] or True
        core: bool | dict[str, str] = False
        for attr in ("data-core-metadata", "data-dist-info-metadata"):
            if attr in attrs:
                core = _core_metadata_from_attr(attrs[attr])
                break
        gpg = attrs.get("data-gpg-sig")
        files.append(
            FileLink(
                filename=filename,
                url=url,
                hashes=_fragment_hashes(fragment),
                requires_python=attrs.get("data-requires-python") or None,
                yanked=yanked,
                core_metadata=core,
                gpg_sig=None if gpg is None else gpg == "true",
                provenance=_absolute(base, attrs.get("data-provenance")),
            )
        )
    meta = parser.meta
    reasons = meta.get("pypi:project-status-reason", [])
    return ProjectPage(
        name=name,
        files=files,
        tracks=_urls(base, meta.get("pypi:tracks")),
        alternate_locations=_urls(base, meta.get("pypi:alternate-locations")),
        status=_status(next(iter(meta.get("pypi:project-status", [])), None)),
        status_reason=_text_field(reasons[0] if reasons else None),
    )


class _AnchorParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.anchors: list[tuple[dict[str, str], str]] = []
        self.base_href: str | None = None
        # <meta name="pypi:..." content="..."> values by name, in order (PEPs 708, 792).
        self.meta: dict[str, list[str]] = {}
        self._current: dict[str, str] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "base" and self.base_href is None:
            self.base_href = dict(attrs).get("href") or None
        elif tag == "meta":
            found = dict(attrs)
            name, content = found.get("name"), found.get("content")
            values = self.meta.setdefault(name, []) if name and name.startswith("pypi:") else None
            if values is not None and content is not None and len(values) < MAX_META_VALUES:
                values.append(content)
        elif tag == "a":
            self._current = {k: (v if v is not None else "") for k, v in attrs}
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._current is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._current is not None:
            self.anchors.append((self._current, "".join(self._text)))
            self._current = None


def _fragment_hashes(fragment: str) -> dict[str, str]:
    name, sep, value = fragment.partition("=")
    if sep and name.lower() in KNOWN_DIGESTS and _HEX_RE.fullmatch(value):
        return {name.lower(): value.lower()}
    return {}


def _clean_hashes(raw: object) -> dict[str, str]:
    """Hex digests under names the proxy knows; anything else is dropped, not an error."""
    if not isinstance(raw, dict):
        return {}
    return {
        str(k).lower(): v.lower()
        for k, v in raw.items()
        if str(k).lower() in KNOWN_DIGESTS and isinstance(v, str) and _HEX_RE.fullmatch(v)
    }


def _clean_core_metadata(raw: object) -> bool | dict[str, str]:
    if isinstance(raw, dict):
        return _clean_hashes(raw) or True
    return bool(raw)


def _core_metadata_from_attr(value: str) -> bool | dict[str, str]:
    if value in ("", "true"):
        return True
    hashes = _fragment_hashes(value)
    return hashes or True


# -- rendering ---------------------------------------------------------------------


def render_root(page: RootPage, representation: str) -> bytes:
    if representation == "json":
        data = {
            "meta": {"api-version": "1.0"},
            "projects": [{"name": name} for name in page.projects],
        }
        return json.dumps(data, separators=(",", ":")).encode()
    out = [
        "<!DOCTYPE html>\n<html>\n  <head>\n",
        '    <meta name="pypi:repository-version" content="1.1">\n',
        "    <title>Simple index</title>\n  </head>\n  <body>\n",
    ]
    for name in page.projects:
        href = quote(normalize(name), safe="") + "/"
        out.append(f'    <a href="{href}">{html.escape(name)}</a><br />\n')
    out.append("  </body>\n</html>\n")
    return "".join(out).encode()
