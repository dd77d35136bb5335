"""The Simple Repository API's pure parts (proxy/formats/simple_index.py): negotiation,
names, parsing and rendering. No server."""

from __future__ import annotations

import json

import pytest

from proxy.contract import View
from proxy.formats import simple_index as si
from proxy.formats import simple_model as sm

PIP_ACCEPT = (
    "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html; q=0.1, "
    "text/html; q=0.01"
)


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (None, "html"),
        ("*/*", "html"),
        ("", "html"),
        (PIP_ACCEPT, "json"),
        ("text/html", "html"),
        ("application/vnd.pypi.simple.v1+json", "json"),
        ("application/vnd.pypi.simple.latest+json", "json"),
        ("application/vnd.pypi.simple.latest+html", "html"),
        ("application/*", "html"),  # a wildcard gets HTML, which every client reads
        ("text/html;q=0.5, application/vnd.pypi.simple.v1+json;q=0.4", "html"),
        # q=0 refuses text/html whatever the wildcard says; v1+html is another type.
        ("text/html;q=0, */*", "html"),
        ("application/vnd.pypi.simple.v1+json;q=0, */*;q=0.5", "html"),
        ("application/vnd.pypi.simple.v1+json;q=nan, text/html", "html"),
        ("application/vnd.pypi.simple.v1+json;q=abc, text/html;q=0.1", "html"),
        ("application/vnd.pypi.simple.v1+json;q=7", "json"),  # clamped to 1
    ],
)
def test_negotiate(accept: str | None, expected: str) -> None:
    chosen = si.negotiate(accept)
    assert chosen is not None and chosen[0] == expected


def test_negotiate_refusing_text_html_gets_the_v1_type() -> None:
    assert si.negotiate("text/html;q=0, */*") == ("html", si.HTML_V1)
    assert si.negotiate("*/*") == ("html", "text/html; charset=utf-8")


@pytest.mark.parametrize(
    "accept", ["application/json", "text/plain", "text/html;q=0", "*/*;q=0", "image/*"]
)
def test_negotiate_refuses(accept: str) -> None:
    assert si.negotiate(accept) is None


def test_names() -> None:
    assert si.normalize("Foo.Bar__baz--Qux") == "foo-bar-baz-qux"
    assert si.is_valid_project_name("a") and si.is_valid_project_name("A.b-c_9")
    for bad in ("", "-a", "a-", "a b", "a/b", "x" * 201):
        assert not si.is_valid_project_name(bad)
    assert si.is_safe_filename("pkg-1.0.tar.gz")
    for bad in ("", ".hidden", "a/b", "a\\b", "a\x00b", "a\nb", "x" * 256):
        assert not si.is_safe_filename(bad)


def test_parse_html_resolves_links_and_keeps_attributes() -> None:
    body = b"""<html><body>
    <a href="../../packages/a-1.0.tar.gz#sha256=AB" data-requires-python="&gt;=3.8"
       data-yanked="broken" data-core-metadata="sha256=cd">a-1.0.tar.gz</a>
    <a href="http://[bad/x.whl">bad</a>
    <a>no href</a>
    </body></html>"""
    page = si.parse_project(body, "text/html", "https://up.example/simple/a/", "a")
    [f] = page.files
    assert f.url == "https://up.example/packages/a-1.0.tar.gz"
    assert f.hashes == {"sha256": "ab"}
    assert f.requires_python == ">=3.8" and f.yanked == "broken"
    assert f.core_metadata == {"sha256": "cd"}


def test_parse_json_ignores_bad_fields() -> None:
    body = json.dumps(
        {
            "name": "a",
            "files": [
                {"filename": "a-1.whl", "url": "a-1.whl", "hashes": {"sha256": "00", "x": 1}},
                {"filename": 3, "url": "b.whl"},
                {"url": None},
                "garbage",
            ],
            "versions": ["1", 2],
        }
    ).encode()
    page = si.parse_project(body, si.JSON_V1, "https://up.example/simple/a/", "a")
    assert [f.url for f in page.files] == [
        "https://up.example/simple/a/a-1.whl",
        "https://up.example/simple/a/b.whl",
    ]
    assert page.files[0].hashes == {"sha256": "00"}
    assert page.files[1].filename == "b.whl"
    assert page.versions == ["1"]


@pytest.mark.parametrize("body", [b"[]", b"{", b'{"files": 3}', b"\xff"])
def test_parse_json_refuses_non_pages(body: bytes) -> None:
    with pytest.raises(si.IndexFormatError):
        si.parse_project(body, si.JSON_V1, "https://up.example/simple/a/", "a")


def test_render_round_trip() -> None:
    page = si.ProjectPage(
        "A",
        [si.FileLink("a-1.0.tar.gz", "https://x/a-1.0.tar.gz", {"sha256": "ab"}, yanked=True)],
    )
    html = sm.render(sm.dump(page, "a"), View(), "html").decode()
    assert 'href="../../files/a/a-1.0.tar.gz#sha256=ab"' in html and 'data-yanked=""' in html
    data = json.loads(sm.render(sm.dump(page, "a"), View(), "json"))
    assert data["meta"]["api-version"] == "1.0"  # no sizes: 1.1 is not promised
    assert data["files"][0]["url"] == "../../files/a/a-1.0.tar.gz"
    assert sm.file_href("a", "a b#c.whl") == "../../files/a/a%20b%23c.whl"


def test_json_text_that_is_not_unicode_text_is_dropped() -> None:
    # A lone surrogate ("\ud800") is valid JSON but no character: it can be neither
    # quoted into a URL nor encoded as UTF-8, so rendering any page holding it failed.
    files = [
        {"filename": "ok-1.0.tar.gz", "url": "/x/ok-1.0.tar.gz", "hashes": {}},
        {"filename": "bad-\ud800.tar.gz", "url": "/x/a.tar.gz", "hashes": {}},
        {"filename": "bad-2.0.tar.gz", "url": "/x/\udc00.tar.gz", "hashes": {}},
        {"filename": "bad-3.0.tar.gz", "url": "/x/b.tar.gz", "requires-python": "\ud800"},
        {"filename": "bad-4.0.tar.gz", "url": "/x/c.tar.gz", "yanked": "why \udfff"},
    ]
    body = json.dumps({"name": "\ud800", "files": files, "versions": ["1.0", "\ud800"]})
    page = si.parse_project(body.encode(), si.JSON_V1, "http://u/simple/ok/", "ok")
    assert page.name == "ok" and page.versions == ["1.0"]
    assert [f.filename for f in page.files] == ["ok-1.0.tar.gz"]
    for representation in ("json", "html"):
        assert b"ok-1.0.tar.gz" in sm.render(sm.dump(page, "ok"), View(), representation)
    root = json.dumps({"projects": [{"name": "ok"}, {"name": "\udc00x"}]}).encode()
    parsed = si.parse_root(root, si.JSON_V1)
    assert parsed.projects == ["ok"]
    for representation in ("json", "html"):
        assert b"ok" in si.render_root(parsed, representation)
