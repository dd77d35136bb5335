"""The SSRF policy (proxy/upstream/ssrf.py): which addresses are internal, and what a repository's
listed URLs may reach. Name resolution is real (loopback names only)."""

from __future__ import annotations

import ipaddress

import pytest

from proxy.exceptions import AddressRefused
from proxy.upstream.ssrf import AddressPolicy, address_kind

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd12::1", "private"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("100.64.0.1", "reserved"),  # shared address space (carrier NAT)
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("64:ff9b::7f00:1", "loopback"),  # NAT64 (RFC 6052) of 127.0.0.1
        ("64:ff9b::a9fe:a9fe", "cloud metadata"),
        ("64:ff9b::808:808", None),  # NAT64 of a public address: DNS64 networks need it
        ("64:ff9b:1::808:808", "private"),  # local-use NAT64 (RFC 8215)
        ("::7f00:1", "loopback"),  # IPv4-compatible ::127.0.0.1
        ("::a00:1", "private"),  # ::10.0.0.1
        ("::ffff:0:7f00:1", "loopback"),  # IPv4-translated (SIIT) ::ffff:0:127.0.0.1
        ("::ffff:0:a9fe:a9fe", "cloud metadata"),
        ("fec0::1", "site-local"),
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
    ],
)
def test_address_kinds(address: str, kind: str | None) -> None:
    assert address_kind(ipaddress.ip_address(address)) == kind


async def test_configured_upstreams_are_trusted_as_written() -> None:
    policy = AddressPolicy("r", ("http://127.0.0.1:8080/simple/",))
    target = await policy.vet("http://127.0.0.1:8080/packages/a.whl")
    assert target.url == "http://127.0.0.1:8080/packages/a.whl" and target.host_header is None
    with pytest.raises(AddressRefused, match=r"loopback.*repositories\.r\.allow_hosts"):
        await policy.vet("http://127.0.0.1:9090/secret")  # another port is another origin


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost/x",
        "http://2130706433/x",
        "http://127.1/x",
        "http://0x7f.1/x",
        "http://[::1]/x",
        "http://[::ffff:7f00:1]/x",
        "http://[64:ff9b::7f00:1]/x",
        "http://[::127.0.0.1]/x",
        "http://[::ffff:0:127.0.0.1]/x",
        "http://[fec0::1]/x",
        "ftp://example.org/x",
        "http:///x",
        "http://h:99999/x",
    ],
)
async def test_internal_or_odd_urls_are_refused(url: str) -> None:
    with pytest.raises(AddressRefused, match="refused to fetch"):
        await AddressPolicy("r", ()).vet(url)


async def test_allow_hosts_by_name_suffix_and_network() -> None:
    by_name = AddressPolicy("r", (), ("localhost",))
    target = await by_name.vet("http://localhost:8081/x")
    assert target.url == "http://127.0.0.1:8081/x" and target.host_header == "localhost:8081"
    by_suffix = AddressPolicy("r", (), ("*.localhost",))
    assert by_suffix.allowed_suffixes == [".localhost"]
    assert (await AddressPolicy("r", (), ("127.0.0.0/8",)).vet("http://127.0.0.2/x")).url
    with pytest.raises(AddressRefused):
        await AddressPolicy("r", (), ("10.0.0.0/8",)).vet("http://127.0.0.2/x")


def test_credentials_are_never_in_a_url_and_go_only_to_their_origin() -> None:
    policy = AddressPolicy("r", ("https://user:token@private.example/simple/",))
    assert policy.without_credentials("http://u:p@files.example/a") == "http://files.example/a"
    configured = "https://user:token@private.example/simple/pkg/"
    assert policy.without_credentials(configured) == "https://private.example/simple/pkg/"
    assert policy.authorization("https://private.example/packages/a.whl") == (
        "Basic dXNlcjp0b2tlbg=="
    )
    assert policy.authorization("http://private.example/packages/a.whl") is None  # scheme
    assert policy.authorization("https://files.example/a") is None
