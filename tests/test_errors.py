"""The one error table (proxy/http/errors.py): every exception becomes its answer by a
lookup along its class's MRO. No server; the over-HTTP tests of each format check the
answers clients see."""

from __future__ import annotations

import inspect
import logging

import pytest

from proxy import exceptions
from proxy.exceptions import (
    BodyChanged,
    CatalogError,
    MethodNotAllowed,
    NotAcceptable,
    NotFound,
    ParseFailed,
    ProxyError,
    RetryLater,
    ShuttingDown,
    StorageError,
    TransferCut,
    Unauthorized,
    UpstreamBusy,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.http.errors import RULES, answer, rule_for
from proxy.http.responses import BodyResponse


def headers_of(response: BodyResponse) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in response.headers}


def test_a_subclass_without_a_rule_answers_as_its_nearest_parent() -> None:
    class SlowMirror(UpstreamTimeout):
        pass

    class OddLimit(RetryLater):
        pass

    assert SlowMirror not in RULES and rule_for(SlowMirror("x")).status == 504
    odd = answer(OddLimit("the queue is full; retry", retry_after_s=7))
    assert odd.status == 503 and headers_of(odd)["retry-after"] == "7"


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (UpstreamUnavailable("upstream answered 500"), 502),
        (UpstreamTimeout("no head"), 504),
        (UpstreamBusy("answered 429", retry_after_s=30), 503),
        (RetryLater("all parsers busy"), 503),
        (ParseFailed("took too long to parse"), 502),
        (TransferCut("the download by another replica failed"), 502),
        (BodyChanged("the body changed"), 502),
        (NotFound("no such project"), 404),
        (ShuttingDown("stopping"), 503),
    ],
)
def test_statuses_come_from_the_table(exc: Exception, status: int) -> None:
    assert answer(exc).status == status
    assert answer(exc).body.decode().strip() == str(exc)


def test_local_failures_keep_their_retry_after_and_are_not_upstream_failures() -> None:
    for local in (RetryLater("busy", retry_after_s=12), TransferCut("cut"), ParseFailed("x")):
        assert not isinstance(local, UpstreamError)
    assert headers_of(answer(RetryLater("busy", retry_after_s=12)))["retry-after"] == "12"
    assert headers_of(answer(RetryLater("busy")))["retry-after"] == "5"  # the default
    assert headers_of(answer(UpstreamBusy("429", retry_after_s=30)))["retry-after"] == "30"
    assert "retry-after" not in headers_of(answer(UpstreamUnavailable("500")))


def test_answers_carry_what_the_exception_says() -> None:
    allowed = answer(MethodNotAllowed("read-only", allowed=("GET", "HEAD")))
    assert (allowed.status, headers_of(allowed)["allow"]) == (405, "GET, HEAD")
    challenged = answer(Unauthorized("credentials needed", 'Basic realm="cache"'))
    assert headers_of(challenged)["www-authenticate"] == 'Basic realm="cache"'
    assert "www-authenticate" not in headers_of(answer(Unauthorized("no challenge")))
    assert headers_of(answer(NotAcceptable("no representation")))["vary"] == "Accept"
    assert headers_of(answer(NotFound("x")))["cache-control"] == "no-store"


def test_internal_failures_are_logged_and_not_told(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "proxy.errors")
    database = answer(CatalogError("postgres: password authentication failed for 'proxy'"))
    assert database.status == 503 and b"password" not in database.body
    assert "retry-after" in headers_of(database)
    assert (
        answer(StorageError("write: ENOSPC")).body
        == b"the cache storage is unavailable; try again\n"
    )
    bug = answer(KeyError("oops"), "pypi")
    assert (bug.status, bug.body) == (500, b"internal error: KeyError\n")
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)
    assert "repository=pypi" in caplog.text and "password authentication" in caplog.text


def test_every_exception_of_the_hierarchy_has_a_considered_answer() -> None:
    """Only a bug (a plain ProxyError, a config or plugin error at request time) is a 500."""
    bugs = {"ProxyError", "ConfigError", "InvalidPlugin"}
    for name, cls in inspect.getmembers(exceptions, inspect.isclass):
        if issubclass(cls, ProxyError):
            status = RULES[next(c for c in cls.__mro__ if c in RULES)].status
            assert (status == 500) == (name in bugs), f"{name} answers {status}"
