"""Unit tests are sans-I/O: opening a network socket or starting a process fails the test
(even where the code under test would have caught the error).

The guard is installed per module, before the module's own fixtures (a module-scoped
fixture that made real traffic would otherwise slip past a per-test guard), and checked
after every test."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

NETWORK = (socket.AF_INET, socket.AF_INET6)


class NotAUnitTest(RuntimeError):
    """A unit test reached for the network or a process: it belongs in tests/integration."""


@pytest.fixture(scope="module", autouse=True)
def _sans_io_module() -> Iterator[list[str]]:
    tried: list[str] = []

    def guarded(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: socket.socket, *args: Any) -> Any:
            if self.family in NETWORK:
                tried.append(f"socket.{name}{args}")
                raise NotAUnitTest(f"a unit test opened a network socket: {name}{args}")
            return real(self, *args)

        return method

    def no_process(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        tried.append(f"process {args!r}")
        raise NotAUnitTest(f"a unit test started a process: {args!r}")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("connect", "connect_ex", "bind"):
            patch.setattr(socket.socket, name, guarded(name, getattr(socket.socket, name)))
        patch.setattr(subprocess.Popen, "_execute_child", no_process)
        yield tried


@pytest.fixture(autouse=True)
def _sans_io(_sans_io_module: list[str]) -> Iterator[None]:
    if _sans_io_module:  # a module-scoped fixture tried, before this test
        pytest.fail("not sans-I/O: " + "; ".join(_sans_io_module[:3]), pytrace=False)
    yield
    if _sans_io_module:  # also when the code under test swallowed the error
        tried = list(_sans_io_module)
        _sans_io_module.clear()
        pytest.fail("not sans-I/O: " + "; ".join(tried[:3]), pytrace=False)
