"""tracer: a traffic-layer diagnostic proxy and connection tracer for LLM serving."""

from __future__ import annotations

import sys as _sys

TYPE_CHECKING = False  # (as typing's, without importing typing for it)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

__version__ = "0.1.0"


class _CompiledHotPath:
    """The import hook of the compiled hot path (``tracer/compiled.py``, which answers):
    loaded at the first ``tracer`` submodule imported, not for ``tracer.compiled`` itself
    (``python -m tracer.compiled build`` runs it as ``__main__``)."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None, /
    ) -> ModuleSpec | None:
        if name == "tracer.compiled" or not name.startswith(("tracer.", "tracer_hot__")):
            return None
        from . import compiled

        return compiled.find_spec(name, path, target)


# (once; and not for a copy of the package imported under another name)
if __name__ == "tracer" and not any(type(f).__name__ == "_CompiledHotPath" for f in _sys.meta_path):
    _sys.meta_path.insert(0, _CompiledHotPath())
