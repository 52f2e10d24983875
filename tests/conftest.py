"""Fixtures for every kind of test; helpers that are not fixtures are in tests/support/.

tests/unit: sans-I/O (recorded bytes, no socket, no process: its conftest makes both fail);
tests/integration: real sockets on 127.0.0.1 and real processes (the tap, the simulated
engine, mitmdump, the CLI); tests/e2e (marked ``e2e``): whole systems (the demo, the real
router's chain, nginx hops, mitmdump end to end). ``pytest -m "not e2e"`` is the quick loop.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

E2E = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # whatever lives in tests/e2e is e2e, marked in its file or not
        if E2E in item.path.parents and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port where connections are refused: bound, never listening, and held
    for the test (so no one else takes it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something else listens on, for the test's length."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def in_process() -> Iterator[None]:
    """For a test that calls the CLI's ``main`` in this process: ``main`` configures
    structlog (for capsys' stderr); put it back as it was."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
