"""``tracer bench``: closed-loop streaming load per concurrency, measured as bench_serving does.

Theory of operation
-------------------
For each concurrency C, C workers each hold one keep-alive HTTP/1.1 connection and keep
one streaming request in flight on it (closed loop: the next request is written when the
previous response has ended). Requests come from a mix, taken in order and cycled: a
synthetic one (``--prompt-len``/``--output-len``, a distinct random prompt per request, so a
prefix cache does not flatter TTFT) or a capture's (each captured completion request with
its captured prompt and output length). Every request asks for ``stream: true`` with
``stream_options.include_usage`` and ``max_tokens`` = the output length, with
``ignore_eos`` (as bench_serving sends it) unless ``--disable-ignore-eos``.

* **Warm-up**: each worker first sends ``--warmup`` requests (default 1). They open the
  connections and fill the engine; they are excluded from every figure.
* **Runs**: then ``--repeats`` measured runs, back to back. A run starts all C workers
  together, keeps them busy until ``--duration`` seconds have passed (or ``--requests``
  have been started), and waits for the requests in flight to end (they count). The run's
  duration is from its start to the end of its last request, as bench_serving's ``dur``.
* **Per request** (sglang ``bench_serving``, vLLM ``benchmark_serving``; reference §5): the
  clock starts just before the request is written; TTFT is the arrival of the first SSE
  chunk with non-empty text (``delta.content``, ``reasoning_content``, ``tool_calls`` or
  ``text``); ITL are the gaps between successive such chunks; end-to-end latency runs to
  the last SSE line (``data: [DONE]``); output tokens are ``usage.completion_tokens`` when
  the server sends usage, else the number of content chunks; TPOT = (latency - TTFT) /
  (output tokens - 1) for requests with more than one token. A chunk is stamped with the
  time of the socket read that brought it. Failed requests count in ``failed`` only.
* **Aggregates**: throughputs are totals over the run's duration; TTFT, TPOT and latency
  are per-request lists, ITL is every gap pooled; each gets mean, p50, p99 (linear
  interpolation, as numpy) and std. A concurrency's headline figures pool all its runs
  (requests of every run, throughputs over the summed durations); ``runs`` keeps each
  run's figures and ``spread`` their min/max/stdev, which ``tracer compare`` uses.

The client is anyio + h11 (no HTTP library on the hot path): against the simulated engine
it costs ~14 µs of CPU per SSE event (~70k events/s per core), about half of what
httpx.AsyncClient costs (``python -m bench.loadgen_ceiling`` measures both). Each run records the load generator's own CPU use; above 80 % of a
core the figures may be the client's, and the run says so.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson

from .. import __version__
from ..errors import StartError
from ..wording import counted
from .bench_figures import figures as figures  # (re-exported: the tests')
from .bench_idle import check_idle as check_idle  # (re-exported: the tests')
from .bench_run import BenchConfig as BenchConfig  # (re-exported: bench/loadgen_ceiling)
from .bench_run import Reporter as Reporter
from .bench_run import run_bench
from .bench_run import run_level as run_level
from .streamclient import Target
from .workload import capture_mix, synthetic_mix

# The JSON document (``--json OUT``), schema ``tracer.bench/1``. Adding a field keeps the
# version; changing the meaning of one bumps it. Times in ms unless named ``_s``.
#
#   schema, tracer_version, started_at, finished_at (ISO 8601 UTC), target, model
#   workload: {source: "synthetic", endpoint, prompt_len, output_len, ignore_eos}
#           | {source: "capture", capture, requests_in_mix, left_out,
#              output_len: {mean, min, max}, prompt_len: {mean, min, max} | null, ignore_eos}
#   options: {concurrency: [..], duration, requests, repeats, warmup, timeout}
#   engine_check: null | [{url, idle: true|false|null, why, profile, source, running,
#                          queued, generated_meanwhile, forced}]
#   results: one per concurrency, in order:
#     concurrency, completed, failed, duration_s (sum over runs), input_tokens,
#     output_tokens, output_chunks, request_throughput, input_throughput,
#     output_throughput, total_throughput (per second), observed_concurrency (Little),
#     ttft_ms, itl_ms, tpot_ms, e2e_ms: {mean, median, p99, std, max},
#     warmup_requests, connections_opened, client_cpu_max (share of one core),
#     errors: {message: count}, spread: {figure: {n, min, max, mean, stdev} | null}
#     for each HEADLINE figure, runs: [the same figures for each run, + client_cpu]
#   A concurrency whose warm-up all failed has only {concurrency, warmup_failed, error}.
SCHEMA = "tracer.bench/1"
EXIT_FAILED = 1  # every request failed
EXIT_BUSY = 4  # the engine is not idle (and no --force)


# ---- output ----------------------------------------------------------------------------


def table(doc: dict[str, Any], *, width: int | None = None) -> str:
    """The results as a text table: one row per concurrency."""
    import io

    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(
        file=buf, width=width or 200, color_system=None, force_terminal=False, highlight=False
    )
    t = Table(show_edge=False, pad_edge=False, title_justify="left")
    for col in ("C", "ok", "failed", "req/s", "out tok/s", "± spread"):
        t.add_column(col, justify="right")
    for name in ("TTFT", "ITL", "TPOT", "E2E"):
        t.add_column(f"{name} ms mean/p50/p99", justify="right")
    for r in doc["results"]:
        if "warmup_failed" in r:
            t.add_row(f"C{r['concurrency']}", "0", str(r["warmup_failed"]), "-", "-", "-")
            continue
        band = r["spread"].get("output_throughput")
        t.add_row(
            f"C{r['concurrency']}",
            str(r["completed"]),
            str(r["failed"]),
            f"{r['request_throughput']:.2f}",
            f"{r['output_throughput']:,.1f}",
            _band(band),
            *(_dist(r[k]) for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")),
        )
    console.print(t)
    runs = doc["options"]["repeats"]
    console.print(
        f"target {doc['target']}  model {doc['model']}  {_describe(doc['workload'])}  "
        f"{counted(runs, 'run')} each of {_budget(doc['options'])}, warm-up excluded; "
        "± spread: half the range of output tok/s over the runs"
    )
    return buf.getvalue()


def _band(band: dict[str, float] | None) -> str:
    if not band or band["n"] < 2 or not band["mean"]:
        return "-"
    return f"{(band['max'] - band['min']) / 2 / band['mean'] * 100:.1f} %"


def _dist(d: dict[str, float | None]) -> str:
    if d["mean"] is None:
        return "-"
    return "/".join(f"{d[k]:.1f}" for k in ("mean", "median", "p99"))


def _describe(workload: dict[str, Any]) -> str:
    if workload["source"] == "synthetic":
        return f"synthetic prompt {workload['prompt_len']} / output {workload['output_len']} tokens"
    out = workload["output_len"]
    return (
        f"capture {Path(workload['capture']).name} ({workload['requests_in_mix']} requests, "
        f"output {out['min']}-{out['max']} tokens)"
    )


def _budget(options: dict[str, Any]) -> str:
    if options.get("requests") is not None:
        return f"{options['requests']} requests"
    return f"{options['duration']:g} s"


def write_doc(doc: dict[str, Any], path: str) -> None:
    data = orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n"
    tmp = Path(path + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


# ---- the command -----------------------------------------------------------------------

EPILOG = """\
examples:
  tracer bench --target http://127.0.0.1:30000 --concurrency 64,96 --engine-metrics \\
               http://127.0.0.1:30000/metrics --json before.json
  tracer bench --target http://router:8000 --concurrency 16 --from front.jsonl --requests 200
  tracer compare before.json after.json

Figures as sglang's bench_serving and vLLM's benchmark_serving define them (TTFT to the first
content chunk, ITL between content chunks, TPOT = (latency - TTFT) / (output tokens - 1),
output tokens from usage). Warm-up requests are excluded. Exit codes: 0 done, 1 every request
failed, 2 usage error, 3 unreadable capture, 4 the engine is not idle (see --force).
"""


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = EPILOG
    parser.add_argument("--target", required=True, metavar="URL", help="http://HOST:PORT")
    parser.add_argument(
        "--concurrency",
        required=True,
        type=_concurrencies,
        metavar="N,M,...",
        help="requests in flight (closed loop), one level after the other",
    )
    parser.add_argument(
        "--from",
        dest="capture",
        metavar="CAPTURE",
        help="request mix from a capture: its completion requests, prompts and output lengths",
    )
    parser.add_argument(
        "--prompt-len",
        type=_positive_int,
        default=None,
        metavar="TOKENS",
        help="synthetic prompt length (default 128; about one token per word)",
    )
    parser.add_argument(
        "--output-len",
        type=_positive_int,
        default=None,
        metavar="TOKENS",
        help="synthetic output length: max_tokens, with ignore_eos (default 128)",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="length of each run: no request starts after it (default 20)",
    )
    budget.add_argument(
        "--requests", type=_positive_int, default=None, metavar="N", help="requests per run"
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        metavar="N",
        help="measured runs per concurrency, for the run-to-run spread (default 3)",
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=1,
        metavar="N",
        help="excluded requests per connection before the runs (default 1)",
    )
    parser.add_argument("--model", help="model name (default: the captured one, or /v1/models)")
    parser.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="synthetic requests to /v1/chat/completions (default) or /v1/completions",
    )
    parser.add_argument(
        "--disable-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (outputs may then end before the asked length)",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="extra request header (repeatable), e.g. 'Authorization: Bearer ...'",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        metavar="SECONDS",
        help="a request with no bytes for this long fails (default 300)",
    )
    parser.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="check first that this engine is idle (running and queued 0); repeatable",
    )
    parser.add_argument(
        "--force", action="store_true", help="run even when an engine is not idle (warn)"
    )
    parser.add_argument("--json", metavar="OUT", help=f"write the results here ({SCHEMA})")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def _concurrencies(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(
                f"{part!r} in {text!r} is not a positive integer (e.g. 64,96)"
            )
        values.append(int(part))
    return values


def _headers(items: Sequence[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip() or any(c in name for c in " \t"):
            raise ValueError(f"--header {item!r}: expected 'NAME: VALUE'")
        out.append((name.strip(), value.strip()))
    return out


def _discover_model(target: Target, headers: Sequence[tuple[str, str]]) -> str:
    url = f"{target.base}/v1/models"
    try:
        response = httpx.get(url, headers=dict(headers), timeout=10.0, trust_env=False)
        response.raise_for_status()
        models = response.json()["data"]
        return str(models[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise StartError(f"cannot learn the model from {url} ({exc}); pass --model") from None


def run(args: argparse.Namespace) -> int:
    from ..proxy.relay import loop_options

    target = Target.parse(args.target)
    headers = _headers(args.header)
    if args.capture and (args.prompt_len or args.output_len):
        raise ValueError(
            "--from takes the lengths from the capture: drop --prompt-len/--output-len"
        )
    ignore_eos = not args.disable_ignore_eos
    if args.capture:
        mix, left_out, captured_model = capture_mix(
            args.capture, model=args.model, ignore_eos=ignore_eos
        )
        for line in left_out[:10]:
            print(f"tracer bench: left out {line}", file=sys.stderr)
        if len(left_out) > 10:
            print(f"tracer bench: ... and {len(left_out) - 10} more left out", file=sys.stderr)
        if args.model is None and captured_model is None:  # bodies without a model
            model = _discover_model(target, headers)
            mix, _, _ = capture_mix(args.capture, model=model, ignore_eos=ignore_eos)
        else:
            model = args.model or captured_model or "(as captured)"
    else:
        model = args.model or _discover_model(target, headers)
        mix = synthetic_mix(
            args.prompt_len or 128,
            args.output_len or 128,
            model=model,
            endpoint=args.endpoint,
            ignore_eos=ignore_eos,
        )
    duration = None if args.requests is not None else (args.duration or 20.0)
    config = BenchConfig(
        target=target,
        concurrencies=args.concurrency,
        mix=mix,
        duration=duration,
        requests=args.requests,
        repeats=args.repeats,
        warmup=args.warmup,
        timeout=args.timeout,
        headers=headers,
    )
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "tracer_version": __version__,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "target": target.base,
        "model": model,
        "workload": mix.describe,
        "options": {
            "concurrency": args.concurrency,
            "duration": duration,
            "requests": args.requests,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "timeout": args.timeout,
        },
        "engine_check": None,
        "results": [],
    }

    async def main() -> int:
        if args.engine_metrics:
            checks = await check_idle(args.engine_metrics, timeout=5.0)
            doc["engine_check"] = checks
            not_idle = [c for c in checks if c["idle"] is not True]
            for c in not_idle:
                state = "not idle" if c["idle"] is False else "idle state unknown"
                verb = "WARNING (--force)" if args.force else "refusing to run"
                print(
                    f"tracer bench: {verb}: engine {state} at {c['url']}: {c['why']}",
                    file=sys.stderr,
                )
            if not_idle and not args.force:
                print(
                    "tracer bench: figures from a loaded window mislead; wait until the engine "
                    "is idle, or pass --force to run anyway",
                    file=sys.stderr,
                )
                return EXIT_BUSY
            for c in checks:
                c["forced"] = bool(not_idle and args.force)

        def on_level(result: dict[str, Any]) -> None:
            doc["results"].append(result)
            if args.json:
                write_doc(doc, args.json)

        with Reporter() as reporter:
            await run_bench(config, reporter, on_level)
        return 0

    code = anyio.run(main, backend_options=loop_options())
    if code:
        return int(code)
    doc["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    if args.json:
        write_doc(doc, args.json)
    sys.stdout.write(table(doc))
    failed = [r for r in doc["results"] if "warmup_failed" in r]
    for r in failed:
        print(
            f"tracer bench: C{r['concurrency']}: all {r['warmup_failed']} warm-up requests "
            f"failed: {r['error']}",
            file=sys.stderr,
        )
    for r in doc["results"]:
        for message, count in r.get("errors", {}).items():
            print(f"tracer bench: C{r['concurrency']}: {count} x {message}", file=sys.stderr)
    if failed or not any(r.get("completed") for r in doc["results"]):
        return EXIT_FAILED
    return 0
