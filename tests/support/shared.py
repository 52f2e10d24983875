"""What an expensive fixture makes, made once per test run however many xdist workers ask.

(pytest-xdist's ``xdist_group`` would keep a module on one worker, but with pytest 9.2 its
``--dist loadgroup`` groups nothing: pytest-dev/pytest-xdist#1386.)
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def made_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]
) -> Any:
    """``make(folder)`` once for the run: the first worker to ask makes it, in a folder the
    workers share, and writes what it returned (JSON); the others wait for it and read
    that. Without xdist, simply ``make``. The result must be read only, never changed."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's, shared by its workers
    result = root / f"made-{name}.json"
    with open(root / f"made-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if result.exists():
            return json.loads(result.read_text())
        folder = root / f"made-{name}"
        folder.mkdir()
        made = make(folder)
        result.write_text(json.dumps(made))
        return made
