"""Which upstream URLs a repository may fetch: the SSRF policy (docs/architecture.md,
"Upstream safety").

Index pages list files on other hosts (real indexes do this), and upstreams redirect.
A listed URL or a redirect that leads to an internal address (loopback, private,
link-local, cloud metadata, anything not globally routable) is refused, unless its
origin is one of the repository's own configured upstreams or it matches the
repository's ``allow_hosts``. The address that is checked is the one we connect to:
names are resolved here and the connection is pinned to the vetted address (the Host
header and TLS name stay the original), so a name cannot resolve to a public address
when checked and to an internal one when used. Credentials written into a listed URL
are never sent; the credentials of a configured upstream (``https://user:token@host/``)
go, as an Authorization header, to every URL of that upstream's origin (scheme, host,
port: an index's files often live beside it, outside its path) and to no other.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

from proxy.exceptions import AddressRefused, UpstreamUnavailable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
DEFAULT_PORTS = {"http": 80, "https": 443}
# Addresses no upstream-listed URL may reach, however is_global judges them.
CLOUD_METADATA = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
# IPv6 forms whose last 32 bits are an IPv4 address the packets end up at: NAT64's
# well-known prefix (RFC 6052; a DNS64 network gives every IPv4 host such an address),
# IPv4-compatible (::a.b.c.d, deprecated) and IPv4-translated (::ffff:0:a.b.c.d, SIIT).
# They are judged as that IPv4 address.
EMBEDDING_IPV4_LAST = tuple(
    ipaddress.IPv6Network(n) for n in ("64:ff9b::/96", "::/96", "::ffff:0:0:0/96")
)
# Local-use NAT64 (RFC 8215): where the IPv4 address sits depends on the operator's
# prefix length, so the whole range is internal (allow_hosts can open it).
NAT64_LOCAL_USE = ipaddress.IPv6Network("64:ff9b:1::/48")


@dataclass(frozen=True)
class Target:
    """Where to send one request: the URL to connect to and the name to present."""

    url: str  # possibly with the host replaced by the vetted address
    host_header: str | None  # the original host[:port], when the URL was pinned
    sni_hostname: str | None  # the original name for TLS, when the URL was pinned


def address_kind(address: IPAddress) -> str | None:
    """Why an address is internal ("loopback", "private", ...), or None if it is public."""
    if address.is_loopback:  # ::1 first: it is also "IPv4-compatible" 0.0.0.1
        return "loopback"
    if address.is_unspecified:
        return "unspecified"
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        return address_kind(embedded)
    if address in CLOUD_METADATA:
        return "cloud metadata"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.is_private or address in NAT64_LOCAL_USE:
        return "private"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "site-local"  # fec0::/10: deprecated, but still routed inside some sites
    if not address.is_global:
        return "reserved"
    return None


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    found = address.ipv4_mapped or address.sixtofour or (address.teredo or (None, None))[1]
    if found is None and any(address in n for n in EMBEDDING_IPV4_LAST):
        found = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return found


class AddressPolicy:
    """The SSRF policy of one repository."""

    def __init__(
        self, repository: str, upstreams: tuple[str, ...], allow_hosts: tuple[str, ...] = ()
    ) -> None:
        self.repository = repository
        self.upstreams = upstreams
        self.trusted_origins = {_origin(urlsplit(u)) for u in upstreams}
        # Origin -> the Authorization value its configured upstream's user info gives.
        self.credentials: dict[tuple[str, str, int | None], str] = {}
        for upstream in upstreams:
            parts = urlsplit(upstream)
            if parts.username is not None:
                pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
                token = base64.b64encode(pair.encode()).decode("ascii")
                self.credentials.setdefault(_origin(parts), f"Basic {token}")
        self.allowed_names: set[str] = set()
        self.allowed_suffixes: list[str] = []
        self.allowed_networks: list[IPNetwork] = []
        for entry in allow_hosts:
            try:
                self.allowed_networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if entry.startswith("*."):
                    self.allowed_suffixes.append(entry[1:].lower())
                else:
                    self.allowed_names.add(entry.lower())

    def without_credentials(self, url: str) -> str:
        """``url`` minus any ``user:password@``: user info is never sent as part of a URL
        (nor shown in a message); ``authorization`` says what an origin gets instead."""
        parts = urlsplit(url)
        if "@" not in parts.netloc:
            return url
        netloc = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=netloc))

    def authorization(self, url: str) -> str | None:
        """The Authorization value for ``url``: its origin's configured credentials, if
        one of the repository's upstreams there has some; otherwise None."""
        if not self.credentials:
            return None
        try:
            return self.credentials.get(_origin(urlsplit(url)))
        except ValueError:
            return None

    async def vet(self, url: str) -> Target:
        """Check where ``url`` leads; raises ``AddressRefused`` (502) naming the rule."""
        try:
            parts = urlsplit(url)
            port = parts.port or DEFAULT_PORTS.get(parts.scheme)
        except ValueError:
            raise self._refuse(url, "it is not a valid URL") from None
        host = (parts.hostname or "").lower()
        if parts.scheme not in DEFAULT_PORTS or not host or port is None:
            raise self._refuse(url, "only http and https URLs with a host are fetched")
        if _origin(parts) in self.trusted_origins:
            return Target(url, None, None)  # the operator chose this upstream: as configured
        named_ok = host in self.allowed_names or any(
            host.endswith(s) for s in self.allowed_suffixes
        )
        addresses = await _resolve(host, port)
        for address in addresses:
            kind = address_kind(address)
            if kind is None or named_ok or any(address in n for n in self.allowed_networks):
                continue
            raise self._refuse(
                url,
                f"{host} resolves to {address}, a {kind} address (not one of this "
                f"repository's upstreams; to allow it, add the host to "
                f"repositories.{self.repository}.allow_hosts)",
            )
        pinned = addresses[0]
        literal = f"[{pinned}]" if pinned.version == 6 else str(pinned)
        netloc = f"{literal}:{port}" if parts.port else literal
        host_header = parts.netloc.rsplit("@", 1)[-1]
        return Target(
            urlunsplit(parts._replace(netloc=netloc)),
            host_header,
            host if parts.scheme == "https" else None,
        )

    def _refuse(self, url: str, why: str) -> AddressRefused:
        shown = self.without_credentials(url)
        return AddressRefused(f"refused to fetch {shown}: {why}")


async def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UpstreamUnavailable(f"upstream {host} cannot be resolved: {exc}") from exc
    addresses: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise UpstreamUnavailable(f"upstream {host} has no address")
    return addresses


def _origin(parts: SplitResult) -> tuple[str, str, int | None]:
    try:
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        port = None
    return parts.scheme, (parts.hostname or "").lower(), port


# -- relays (docs/architecture.md, "Streaming across replicas on object storage") -------

_HOST_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


def relay_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a relay's address, or None if it can. A relay's URL comes
    from a lease row: a plain ``http://host:port``, never an address no relay can have
    (unspecified, multicast, link-local, cloud metadata)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme != "http":
        return "not http://"
    if parts.username is not None or parts.password is not None:
        return "has credentials"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "has a path, query or fragment"
    if port is None:
        return "has no port"
    host = parts.hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None if _HOST_RE.match(host) else f"{host!r} is not a host name"
    return _relay_address_problem(address)


async def relay_target(url: str) -> tuple[str | None, str | None]:
    """``(the URL to connect to, None)`` for a relay's ``url``, or ``(None, why not)``.
    The name is resolved here and the URL pinned to the vetted address, like an
    upstream's: a host written as a number (``2852039166``, ``0xa9fea9fe``, ``0``), which
    the resolver reads as an address, or a name that resolves to one no relay can have,
    is refused before any connection."""
    problem = relay_url_problem(url)
    if problem is not None:
        return None, problem
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 0
    try:
        addresses = await _resolve(host, port)
    except UpstreamUnavailable as exc:
        return None, str(exc)
    for address in addresses:
        problem = _relay_address_problem(address)
        if problem is not None:
            return None, f"{host} resolves to {address}: {problem}"
    pinned = addresses[0]
    literal = f"[{pinned}]" if pinned.version == 6 else str(pinned)
    return f"http://{literal}:{port}", None


def _relay_address_problem(address: IPAddress) -> str | None:
    if address.is_loopback:  # ::1 first: it is also "IPv4-compatible" 0.0.0.1
        return None
    address = _embedded_ipv4(address) or address
    if (
        address.is_unspecified
        or address.is_multicast
        or address.is_link_local
        or address in CLOUD_METADATA
        or address == ipaddress.IPv4Address("255.255.255.255")
    ):
        return f"{address} is no relay's address"
    return None
