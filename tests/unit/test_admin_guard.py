"""The admin endpoint refuses foreign Hosts, and state changes without the token, with an
Origin or without JSON; marks are bounded and say who sent them (issue 24). Its routes,
called in this process; over the wire: tests/integration/test_admin_guard.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tracer.proxy import admin as admin_mod
from tracer.proxy.admin import AdminServer
from tracer.proxy.relay import Tap, TapConfig

TOKEN = "t" * 24


GOOD = {"host": "127.0.0.1:9100", "authorization": f"Bearer {TOKEN}"}


JSON = {**GOOD, "content-type": "application/json"}


def server(**kw: Any) -> AdminServer:
    config = TapConfig("127.0.0.1", 0, "127.0.0.1", 9, fault_control=True)
    return AdminServer(Tap(config), "127.0.0.1", 9100, token=TOKEN, **kw)


@pytest.mark.parametrize(
    "host", ["evil.example:9100", "localhost.evil:9100", "127.0.0.1:9101", "", "127.0.0.1:x"]
)
def test_a_foreign_host_gets_nothing(host: str) -> None:
    """DNS rebinding: a page on a name that resolves to 127.0.0.1 reads nothing."""
    refused = server().guard("GET", "/status", {"host": host})
    assert refused is not None and refused[0] == 421


@pytest.mark.parametrize("host", ["127.0.0.1:9100", "localhost:9100", "[::1]:9100", "127.0.0.1"])
def test_the_admins_own_address_is_served(host: str) -> None:
    assert server().guard("GET", "/status", {"host": host}) is None


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"host": "127.0.0.1:9100", "content-type": "application/json"}, 401),  # no token
        ({**JSON, "authorization": "Bearer wrong-token-wrong-token"}, 401),
        ({**JSON, "origin": "http://evil.example"}, 403),  # a web page, even with the token
        ({**GOOD, "content-type": "text/plain"}, 415),  # what a page sends without preflight
        (GOOD, 415),
    ],
)
def test_state_changes_need_the_token_json_and_no_origin(
    headers: dict[str, str], status: int
) -> None:
    for method, path in (("POST", "/mark"), ("PUT", "/faults"), ("POST", "/faults")):
        refused = server().guard(method, path, headers)
        assert refused is not None and refused[0] == status, (method, path)
    assert server().guard("PUT", "/faults", JSON) is None
    alt = {"host": "127.0.0.1:9100", "x-tracer-token": TOKEN, "content-type": "application/json"}
    assert server().guard("POST", "/mark", alt) is None
    assert server().guard("DELETE", "/faults", GOOD) is None  # no body, no content type


def test_marks_are_bounded_in_rate_and_count(monkeypatch: pytest.MonkeyPatch) -> None:
    admin = server()
    clock = [1000.0]
    monkeypatch.setattr(admin_mod.time, "monotonic", lambda: clock[0])
    admin.peer, admin.agent = "127.0.0.1:5555", "curl/8"
    status, _, body = admin.route("POST", "/mark", b'{"note": "hung"}')
    assert status == 200 and json.loads(body) | {"marked": 0} == {
        "marked": 0,
        "note": "hung",
        "by": "127.0.0.1:5555 (curl/8)",
    }
    assert admin.route("POST", "/mark", b"{}")[0] == 429  # within MARK_INTERVAL
    for _ in range(admin_mod.MAX_MARKS - 1):
        clock[0] += admin_mod.MARK_INTERVAL
        assert admin.route("POST", "/mark", b"{}")[0] == 200
    clock[0] += admin_mod.MARK_INTERVAL
    assert admin.route("POST", "/mark", b"{}")[0] == 429  # MAX_MARKS reached
