"""``tracer compare A.json B.json``: the change of each headline figure per concurrency.

Reads two ``tracer bench --json`` results (schema ``tracer.bench/1``) and prints, for every
concurrency both measured, the relative change from A to B of output tok/s, req/s, TTFT
(mean, p99), ITL, TPOT and end-to-end latency (means), e.g. ``+12.8 % output tok/s at
C64``, with the run-to-run spread of each side: half the range of that figure over the
side's runs (``--repeats``), as a share of its mean.

A change is **within noise** when the two sides' ranges over their runs overlap (some run
of A did as well as some run of B): then the runs do not tell A and B apart. With a single
run on either side the spread is unknown and the change is not judged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from .bench import SCHEMA
from .bench_figures import HEADLINE, lookup

EXIT_INPUT = 3


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = (
        "example:\n"
        "  tracer bench --target http://127.0.0.1:8000 --concurrency 1,8,64 --json direct.json\n"
        "  tracer bench --target http://127.0.0.1:8080 --concurrency 1,8,64 --json tapped.json\n"
        "  tracer compare direct.json tapped.json\n"
    )
    parser.add_argument("a", metavar="A.json", help="the baseline (tracer bench --json)")
    parser.add_argument("b", metavar="B.json", help="the run to compare with it")


def load(path: str) -> dict[str, Any]:
    """A bench result; ``ValueError`` naming what is wrong with it."""
    try:
        doc = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path} is not a tracer bench result (schema {found!r}, want {SCHEMA!r})")
    if not isinstance(doc.get("results"), list):
        raise ValueError(f"{path}: no results list")
    return doc


def _levels(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {
        int(r["concurrency"]): r
        for r in doc["results"]
        if isinstance(r, dict) and "concurrency" in r and "warmup_failed" not in r
    }


def _half_range(band: dict[str, Any] | None) -> float | None:
    """Half the range over the runs, relative to their mean; None below two runs."""
    if not band or band.get("n", 0) < 2 or not band.get("mean"):
        return None
    return float((band["max"] - band["min"]) / 2 / abs(band["mean"]))


def change_line(
    concurrency: int, key: str, label: str, better: str, a: dict[str, Any], b: dict[str, Any]
) -> str | None:
    """One figure's change at one concurrency, or None when a side lacks it."""
    va, vb = lookup(a, key), lookup(b, key)
    if va is None or vb is None:
        return None
    band_a = (a.get("spread") or {}).get(key)
    band_b = (b.get("spread") or {}).get(key)
    if va == 0:
        head = f"{label} at C{concurrency}: {_num(va)} -> {_num(vb)} (A is 0: no relative change)"
        return "  " + head
    pct = (vb - va) / abs(va) * 100
    head = f"{pct:+.1f} % {label} at C{concurrency}"
    unit = " ms" if "_ms." in key else ""
    detail = f"{_num(va)} -> {_num(vb)}{unit}"
    ha, hb = _half_range(band_a), _half_range(band_b)
    if ha is None or hb is None:
        runs = min((band_a or {}).get("n", 1), (band_b or {}).get("n", 1))
        return f"  {head:<34} {detail:<26} spread unknown ({runs} run): not judged"
    spread = f"spread A ±{ha * 100:.1f} %, B ±{hb * 100:.1f} %"
    assert band_a is not None and band_b is not None
    overlap = band_a["min"] <= band_b["max"] and band_b["min"] <= band_a["max"]
    if overlap:
        verdict = "within noise"
    else:
        improved = (vb > va) == (better == "higher")
        verdict = "better" if improved else "worse"
    return f"  {head:<34} {detail:<26} {spread:<30} {verdict}"


def _num(value: float) -> str:
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"


def _summary(name: str, path: str, doc: dict[str, Any]) -> str:
    opts = doc.get("options", {})
    budget = (
        f"{opts.get('requests')} requests"
        if opts.get("requests") is not None
        else f"{opts.get('duration')} s"
    )
    return (
        f"{name}: {path}  {doc.get('started_at', '?')}  {doc.get('target', '?')}  "
        f"model {doc.get('model', '?')}  {opts.get('repeats', '?')} run(s) of {budget}"
    )


def compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> list[str]:
    """The report's lines."""
    lines = [_summary("A", names[0], a), _summary("B", names[1], b)]
    if a.get("workload") != b.get("workload"):
        lines.append(
            f"note: the workloads differ: A {_workload(a)}; B {_workload(b)} "
            "(figures may not be comparable)"
        )
    levels_a, levels_b = _levels(a), _levels(b)
    for c in sorted(set(levels_a) | set(levels_b)):
        if c not in levels_b or c not in levels_a:
            lines.append(f"C{c}: only in {'A' if c in levels_a else 'B'}")
            continue
        lines.append(f"C{c}")
        for key, label, better in HEADLINE:
            line = change_line(c, key, label, better, levels_a[c], levels_b[c])
            if line is not None:
                lines.append(line)
        failed = (levels_a[c].get("failed", 0), levels_b[c].get("failed", 0))
        if any(failed):
            lines.append(f"  failed requests: A {failed[0]}, B {failed[1]}")
    lines.append(
        "spread: half the range of the figure over a side's runs, as a share of its mean; "
        "within noise: the two sides' ranges overlap"
    )
    return lines


def _workload(doc: dict[str, Any]) -> str:
    w = doc.get("workload") or {}
    if w.get("source") == "synthetic":
        return f"synthetic {w.get('prompt_len')}/{w.get('output_len')} tokens ({w.get('endpoint')})"
    return f"{w.get('source', '?')} {w.get('capture', '')}".strip()


def run(args: argparse.Namespace) -> int:
    try:
        a, b = load(args.a), load(args.b)
    except ValueError as exc:
        print(f"tracer: {exc}", file=sys.stderr)
        return EXIT_INPUT
    sys.stdout.write("\n".join(compare(a, b, (args.a, args.b))) + "\n")
    return 0
