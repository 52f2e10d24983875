"""Reading a Prometheus text: its metric families, and one spelling for every name.

Apart from the normalisation (``engines``) because it knows nothing of the servers: a
text that does not parse is named by its first bad line, whatever sent it.
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class MetricsError(ValueError):
    """A metrics text (or load JSON) that cannot be read."""


_SPELLINGS = ("sglang", "vllm", "llamacpp")


def _clip(text: str, limit: int = 80) -> str:
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def _first_bad_line(text: str, exc: Exception) -> str:
    for n, line in enumerate(text.splitlines()[:20000], 1):
        if not line.strip():
            continue
        try:
            list(text_string_to_metric_families(line + "\n"))
        except Exception as line_exc:
            return (
                f"line {n}: {_clip(line)}: {_clip(str(line_exc) or type(line_exc).__name__, 120)}"
            )
    return f"{type(exc).__name__}: {_clip(str(exc), 120)}"


def parse(text: str) -> list[Metric]:
    """The metric families of a Prometheus text; ``MetricsError`` if it does not parse.

    An empty text is valid (no families): SGLang without ``--enable-metrics`` may answer so.
    """
    try:
        return list(text_string_to_metric_families(text))
    except Exception as exc:
        raise MetricsError(_first_bad_line(text, exc)) from None


def parse_lenient(text: str) -> tuple[list[Metric], list[str]]:
    """Like ``parse``, but drop the lines that do not parse; returns (families, skipped).

    ``skipped`` describes each dropped line (``"line 3: '...': reason"``). A text that is
    all garbage gives no families and a non-empty ``skipped``.
    """
    try:
        return parse(text), []
    except MetricsError:
        pass
    kept: list[str] = []
    skipped: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            list(text_string_to_metric_families(line + "\n"))
        except Exception as exc:
            skipped.append(f"line {n}: {_clip(line)}: {_clip(str(exc) or type(exc).__name__, 120)}")
            continue
        kept.append(line)
    return parse("\n".join(kept) + "\n" if kept else ""), skipped


def canonical_name(name: str) -> str:
    """``sglang_x`` -> ``sglang:x`` (likewise ``vllm_``, ``llamacpp_``); others unchanged."""
    for prefix in _SPELLINGS:
        if name.startswith(prefix + "_"):
            return f"{prefix}:{name[len(prefix) + 1 :]}"
    return name
