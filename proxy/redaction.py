"""What leaves the process is redacted here, in one place (docs/architecture.md, "Secrets
never shown"): user info in URLs, secret-looking query parameters, Authorization values
and ``password=...`` pairs, before any log line, error body, page or printed setting.

Pure functions of text; no I/O. ``redact`` is cheap on text that has nothing to hide
(a substring test before any regular expression), since every log line goes through it.
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"

# Query parameters whose values are credentials (presigned URLs, tokens in links, DSNs).
SECRET_PARAMS = frozenset(
    {
        "password",
        "passwd",
        "pwd",
        "pass",
        "secret",
        "token",
        "access_token",
        "auth",
        "api_key",
        "apikey",
        "key",
        "sig",
        "signature",
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "sslpassword",
    }
)

_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
# "Authorization: Basic dXNlcjpw..." (header dumps), and a bare credential after its
# scheme name; short words after "Basic" in prose are left alone.
_AUTH_RE = re.compile(r"(?i)\b(authorization\s*[:=]\s*(?:[a-z]+\s+)?)([^\s,;'\"]+)")
_SCHEME_RE = re.compile(r"\b(Bearer|Basic|Token)\s+([A-Za-z0-9+/=._~-]{16,})")
# key = value pairs of DSNs and TOML ("password=s3cret", 'password = "s3cret"'); a key
# followed by a colon is a message about the setting, not its value, and stays.
_PAIR_RE = re.compile(
    r"(?i)\b(password(?:_sha256)?|passwd|secret|token|api_key|apikey)(\s*=\s*)"
    r"(\"[^\"]*\"|'[^']*'|[^\s,;&]+)"
)
_HINTS = ("://", "uthoriz", "earer", "asic ", "assw", "ecret", "oken", "pikey", "pi_key")


def redact_url(url: str) -> str:
    """``url`` with its user info and secret query parameters masked; other text as is."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _mask_userinfo_crudely(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        query = _redact_query(query)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit(SplitResult(parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_query(query: str) -> str:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        return query if "=" not in query else MASK
    if not any(name.lower() in SECRET_PARAMS for name, _ in pairs):
        return query
    masked = [(name, MASK if name.lower() in SECRET_PARAMS else value) for name, value in pairs]
    return urlencode(masked, safe="*")


def _mask_userinfo_crudely(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    if "@" in authority:
        authority = f"{MASK}@{authority.rsplit('@', 1)[1]}"
    return f"{scheme}{sep}{authority}{slash}{tail}"


def redact(text: str) -> str:
    """Every URL, Authorization value and ``password=...`` pair in ``text``, masked."""
    if not any(hint in text for hint in _HINTS):
        return text
    text = _URL_RE.sub(lambda m: redact_url(m.group(0)), text)
    text = _AUTH_RE.sub(lambda m: m.group(1) + MASK, text)
    text = _SCHEME_RE.sub(lambda m: f"{m.group(1)} {MASK}", text)
    return _PAIR_RE.sub(lambda m: m.group(1) + m.group(2) + _masked_value(m.group(3)), text)


def _masked_value(value: str) -> str:
    if value[:1] in "\"'" and value[-1:] == value[:1]:
        return value[0] + MASK + value[0]
    return MASK
