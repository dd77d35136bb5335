"""tests/upstream.py's ServerThread, which every in-process proxy and fake upstream runs
on: a server that fails to start leaves nothing open behind it."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest

from proxy.config.load import load
from proxy.http.app import create_app
from tests.conftest import write_config
from tests.upstream import ServerThread


def test_a_server_that_fails_to_start_closes_its_socket(tmp_path: Path) -> None:
    """Left open, the socket surfaced as an unraisable ResourceWarning in whichever test
    ran next (warnings are errors), far from the test that failed."""
    (tmp_path / "data").write_text("a file where the storage folder goes")
    config = write_config(tmp_path, f'[storage]\npath = "{tmp_path / "data"}"\n')
    server = ServerThread(create_app(load(config, {})))
    with pytest.raises(RuntimeError, match="failed to start"):
        server.start()
    assert server.sock.fileno() == -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del server
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
