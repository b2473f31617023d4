"""Issue 33's refusals that need no model: serve's numeric flags and listening address (before anything
loads), the service's error shape for unknown routes and methods, video seconds, generate's empty
--output and plan's --configs without --verify. The cases are those of tests/probe_reliability_cases.py."""

from __future__ import annotations

import socket

import pytest

from tests.probe_reliability_cases import probe

CASES = [
    ("serve --request_timeout nan", "clear"),
    ("serve --request_timeout inf", "clear"),
    ("serve --initialization_timeout nan", "clear"),
    ("serve --initialization_timeout inf", "clear"),
    ("serve --shutdown_grace nan", "clear"),
    ("serve --max_queue -1", "clear"),
    ("serve --host 999.1.1.1", "clear"),
    ("serve --port in use", "clear"),
    ("serve --port 70000", "clear"),
    ("generate --output ''", "clear"),
    ("plan --configs without --verify", "clear"),
    ('video "seconds": "1e308"', "clear"),
    ('video "seconds": 1e300', "clear"),
    ("GET /nowhere", "clear"),
    ("DELETE /healthz", "clear"),
    ("GET /v1/images/generations", "clear"),
]


@pytest.fixture(scope="module")
def results():
    return probe()


@pytest.mark.parametrize("name,expected", CASES)
def test_bad_input_is_refused_by_name(results, name, expected):
    kind, detail = results[name]
    assert kind == expected, f"{name}: {kind} ({detail})"


def test_a_free_port_is_released_after_the_check():
    """The start-up bind must not keep the port: uvicorn binds it again after loading."""
    from jaxdit.serve.command import check_listen

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_listen("127.0.0.1", port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
