"""The simulated engine's scheduler: a running batch, a waiting queue, and SGLang's metrics.

One task (``Scheduler.run``) does what an SGLang scheduler does, at the level of time:

* **admission and prefill**: waiting requests join the running batch while it holds fewer
  than ``max_running``; each prefill batch takes ``ttft + prefill_per_token x prompt
  tokens`` and yields every admitted request's first token. Decode of the batch waits
  while a prefill runs, as on a GPU.
* **decode**: one step produces one token for every running request and takes
  ``itl x (1 + batch_alpha x (running - 1))``, so time to first token grows with the
  queue and tokens/s saturate at ``1 / (itl x batch_alpha)``.
* **idle**: the task sleeps on an event (no polling) until a request arrives or the idle
  metrics refresh is due.

Tokens go to the HTTP handler through one memory stream per request (the token's index;
the stream is closed when the request finishes).

Metrics follow SGLang (``reference/llm-serving.md`` §1.3, §1.4):

* scheduler gauges (``sglang:num_running_reqs``, ``num_queue_reqs``, ``token_usage``,
  ``gen_throughput`` ...) are **sampled**: written when a prefill batch is scheduled, every
  ``decode_log_interval`` decode steps, and ``idle_refresh`` seconds after the last write
  while idle. ``/v1/loads`` reads the live values.
* tokenizer counters and histograms (``prompt_tokens_total``, ``generation_tokens_total``,
  ``num_requests_total``, ``time_to_first_token_seconds`` ...) are written when the event
  happens. With ``token_counters="finish"`` (the default, what SGLang itself does:
  ``observe_one_finished_request``) prompt and generated tokens are counted when the
  request finishes, so they stay flat while long streams decode; ``"live"`` counts prompt
  tokens at prefill and each generated token when it is produced.
  ``sglang:realtime_tokens_total{mode=...}`` moves with the gauges (every log interval).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

EngineType = Literal["unified", "prefill", "decode"]

# histogram buckets: TTFT as in SGLang's docs sample, the others SGLang's defaults
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
TTFT_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0)
ITL_BUCKETS: tuple[float, ...] = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03)
ITL_BUCKETS += (0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0)
E2E_BUCKETS += (40.0, 60.0, 80.0, 100.0, 200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0)
QUEUE_BUCKETS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0)
QUEUE_BUCKETS += (20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 200.0, 300.0, 400.0)


@dataclass
class SchedulerConfig:
    model: str = "sim-model"
    engine_type: EngineType = "unified"
    max_running: int = 64
    ttft: float = 0.02  # fixed cost of one prefill batch
    prefill_per_token: float = 0.0  # extra prefill time per prompt token
    itl: float = 0.005  # decode step time with one running request
    batch_alpha: float = 0.05  # step time = itl * (1 + batch_alpha * (running - 1))
    decode_log_interval: int = 40
    idle_refresh: float = 30.0
    max_total_tokens: int = 262144  # KV pool size, for token_usage
    token_counters: Literal["live", "finish"] = "finish"
    startup_time: float = 0.0  # reported as sglang:engine_startup_time


@dataclass(eq=False)
class SimRequest:
    """One generation in the scheduler. ``ttft``/``itl`` override the batch pacing."""

    rid: str
    prompt_tokens: int
    max_tokens: int
    ttft: float | None = None
    itl: float | None = None
    stall_after: int | None = None  # after this many tokens, no tokens for stall_for s
    stall_for: float = 0.0
    wedge_after: int | None = None  # after this many tokens, the whole scheduler stops
    wedge_for: float = 0.0
    ignore_disconnect: bool = False  # a handler that is gone does not abort it
    internal: bool = False  # health probes: not in the tokenizer metrics
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: int = 0
    due: float = 0.0  # earliest time of the next token (override pacing, stalls)
    state: Literal["new", "waiting", "running", "finished", "aborted"] = "new"
    send: MemoryObjectSendStream[int] = field(init=False, repr=False)
    receive: MemoryObjectReceiveStream[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # the buffer holds every token the request can get: the scheduler never blocks
        self.send, self.receive = anyio.create_memory_object_stream[int](self.max_tokens + 1)

    @property
    def every_step(self) -> bool:
        return self.itl is None


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


@dataclass
class Gauges:
    """The sampled scheduler gauges, as last written by a log point."""

    num_running_reqs: float = 0.0
    num_queue_reqs: float = 0.0
    num_used_tokens: float = 0.0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    written_at: float = 0.0
    writes: int = 0
    last_reason: str = "start"


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.gauges = Gauges(written_at=time.monotonic())
        self.steps = 0
        self.prefill_batches = 0
        self.last_gen_throughput = 0.0
        self._tokens_since_decode_log = 0
        self._last_decode_log = time.monotonic()
        self._last_log = time.monotonic()
        self._wedged_until = 0.0
        self._step_end: float | None = None  # when the decode step under way ends
        self._wake = anyio.Event()
        self.progress = anyio.Event()  # set (and replaced) whenever tokens are produced
        self.last_progress = 0.0
        self.unwedged = anyio.Event()
        self.unwedged.set()
        # tokenizer-side counters and histograms
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_total = 0
        self.num_aborted_requests_total = 0
        self.realtime_tokens: dict[str, int] = {"prefill_compute": 0, "decode": 0}
        self._realtime_pending: dict[str, int] = {"prefill_compute": 0, "decode": 0}
        self.ttft_hist = Histogram(TTFT_BUCKETS)
        self.itl_hist = Histogram(ITL_BUCKETS)
        self.e2e_hist = Histogram(E2E_BUCKETS)
        self.queue_hist = Histogram(QUEUE_BUCKETS)

    # ---- API for the HTTP side ------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        req.state = "waiting"
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """The client went away, or a fault ended the request: drop it from the batch."""
        if req.state in ("finished", "aborted", "new"):
            return
        if req.state == "waiting":
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        req.state = "aborted"
        req.send.close()
        if not req.internal:
            self.num_aborted_requests_total += 1
            self._count_finished(req)
        self._wake.set()

    @property
    def wedged(self) -> bool:
        return time.monotonic() < self._wedged_until

    def used_tokens(self) -> int:
        return sum(r.prompt_tokens + r.generated for r in self.running)

    def load(self) -> dict[str, Any]:
        """Live values, as SGLang's ``/v1/loads`` computes them on request."""
        used = self.used_tokens()
        usage = used / self.config.max_total_tokens
        running, waiting = len(self.running), len(self.waiting)
        return {
            "dp_rank": 0,
            "timestamp": time.time(),
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "num_used_tokens": used,
            "num_total_tokens": self.config.max_total_tokens,
            "max_total_num_tokens": self.config.max_total_tokens,
            "token_usage": round(usage, 4),
            "gen_throughput": round(self.last_gen_throughput, 3),
            "cache_hit_rate": 0.0,
            "utilization": round(usage, 4),
            "max_running_requests": self.config.max_running,
        }

    # ---- the scheduler task -----------------------------------------------------------

    async def run(self) -> None:
        while True:
            if self._wedged_until > time.monotonic():
                await self._wedge()
            if self.waiting and len(self.running) < self.config.max_running:
                await self._prefill()
            elif self.running:
                await self._decode()
            else:
                await self._idle()

    async def _wedge(self) -> None:
        self.unwedged = anyio.Event()
        try:
            await anyio.sleep(self._wedged_until - time.monotonic())
        finally:
            self.unwedged.set()

    async def _idle(self) -> None:
        cfg = self.config
        wait = self._last_log + cfg.idle_refresh - time.monotonic()
        if wait <= 0:
            self.last_gen_throughput = 0.0
            self._log("idle", gen_throughput=0.0)
            return
        self._wake = anyio.Event()
        with anyio.move_on_after(wait):
            await self._wake.wait()

    async def _prefill(self) -> None:
        cfg = self.config
        now = time.monotonic()
        batch: list[SimRequest] = []
        while self.waiting and len(self.running) < cfg.max_running:
            req = self.waiting.popleft()
            req.state = "running"
            req.admitted_at = now
            self.running.append(req)
            batch.append(req)
            if not req.internal:
                self.queue_hist.observe(now - req.arrival)
        self.prefill_batches += 1
        prompt = sum(r.prompt_tokens for r in batch)
        self._realtime_pending["prefill_compute"] += prompt
        if cfg.token_counters == "live":
            self.prompt_tokens_total += sum(r.prompt_tokens for r in batch if not r.internal)
        self._log("prefill")
        paced: list[SimRequest] = []
        for req in batch:
            if req.max_tokens <= 0:
                self._finish(req)
            elif req.stall_after == 0:
                req.due = now + req.stall_for
            elif req.ttft is not None:
                req.due = now + req.ttft
            else:
                paced.append(req)
        if not paced:
            return
        await anyio.sleep(cfg.ttft + cfg.prefill_per_token * sum(r.prompt_tokens for r in paced))
        for req in paced:
            if req.state == "running":
                self._emit(req, time.monotonic())
        self._progressed()

    async def _decode(self) -> None:
        cfg = self.config
        n = len(self.running)
        step = cfg.itl * (1.0 + cfg.batch_alpha * (n - 1))
        now = time.monotonic()
        if any(r.every_step and r.due <= now for r in self.running):
            # steps back to back keep their own clock (as a GPU's do): the next one ends a
            # step after the last one ended, however late the loop woke, so the rate is
            # the configured one; after a pause (prefill, idle) the clock starts again
            clock = anyio.current_time()
            last = self._step_end
            self._step_end = (
                last + step if last is not None and clock - last < step else clock + step
            )
            await anyio.sleep_until(self._step_end)
        else:
            # nobody is due every step: sleep to the earliest due time, but wake for arrivals
            earliest = min(r.due for r in self.running)
            self._wake = anyio.Event()
            with anyio.move_on_after(max(step, earliest - now)):
                await self._wake.wait()
                return
        now = time.monotonic()
        emitted = 0
        for req in list(self.running):
            if req.state == "running" and req.due <= now:
                self._emit(req, now)
                emitted += 1
        if not emitted:
            return
        self.steps += 1
        self._progressed()
        if self.steps % cfg.decode_log_interval == 0:
            gap = now - self._last_decode_log
            self.last_gen_throughput = self._tokens_since_decode_log / gap if gap > 0 else 0.0
            self._tokens_since_decode_log = 0
            self._last_decode_log = now
            self._log("decode", gen_throughput=self.last_gen_throughput)

    def _emit(self, req: SimRequest, now: float) -> None:
        try:
            req.send.send_nowait(req.generated)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            if not req.ignore_disconnect:
                self.abort(req)  # the handler is gone
                return
            # (``ignore-disconnect``: nobody reads it any more; it decodes on to the end)
        req.generated += 1
        self._tokens_since_decode_log += 1
        self._realtime_pending["decode"] += 1
        if not req.internal:
            if req.first_token_at is None:
                self.ttft_hist.observe(now - req.arrival)
            elif req.last_token_at is not None:
                self.itl_hist.observe(now - req.last_token_at)
            if self.config.token_counters == "live":
                self.generation_tokens_total += 1
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        if req.generated >= req.max_tokens:
            self._finish(req)
        elif req.stall_after is not None and req.generated == req.stall_after:
            req.due = now + req.stall_for
        elif req.wedge_after is not None and req.generated == req.wedge_after:
            self._wedged_until = now + req.wedge_for
            req.due = now if req.itl is None else now + req.itl
        elif req.itl is not None:
            req.due = now + req.itl

    def _finish(self, req: SimRequest) -> None:
        self.running.remove(req)
        req.state = "finished"
        req.send.close()
        if not req.internal:
            self._count_finished(req)

    def _count_finished(self, req: SimRequest) -> None:
        self.num_requests_total += 1
        self.e2e_hist.observe(time.monotonic() - req.arrival)
        if self.config.token_counters == "finish":
            self.prompt_tokens_total += req.prompt_tokens
            self.generation_tokens_total += req.generated

    def _progressed(self) -> None:
        self.last_progress = time.monotonic()
        self.progress.set()
        self.progress = anyio.Event()

    def _log(self, reason: str, *, gen_throughput: float | None = None) -> None:
        """A log point: write the sampled gauges (SGLang's ``log_stats``)."""
        used = self.used_tokens()
        g = self.gauges
        g.num_running_reqs = float(len(self.running))
        g.num_queue_reqs = float(len(self.waiting))
        g.num_used_tokens = float(used)
        g.token_usage = used / self.config.max_total_tokens
        if gen_throughput is not None:
            g.gen_throughput = gen_throughput
        g.written_at = self._last_log = time.monotonic()
        g.writes += 1
        g.last_reason = reason
        for mode, n in self._realtime_pending.items():
            self.realtime_tokens[mode] += n
            self._realtime_pending[mode] = 0

    # ---- Prometheus text --------------------------------------------------------------

    def metrics_text(self) -> str:
        cfg = self.config
        sched = {
            "engine_type": cfg.engine_type,
            "model_name": cfg.model,
            "pp_rank": "0",
            "tp_rank": "0",
        }
        tok = {"model_name": cfg.model}
        out: list[str] = []
        g = self.gauges

        def family(name: str, kind: str, doc: str) -> None:
            out.append(f"# HELP sglang:{name} {doc}")
            out.append(f"# TYPE sglang:{name} {kind}")

        def sample(name: str, labels: dict[str, str], value: float) -> None:
            body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out.append(f"sglang:{name}{{{body}}} {_num(value)}")

        gauges: list[tuple[str, str, float]] = [
            ("num_running_reqs", "The number of running requests.", g.num_running_reqs),
            (
                "num_queue_reqs",
                "The number of requests in the waiting queue.",
                g.num_queue_reqs,
            ),
            ("num_used_tokens", "The number of used tokens.", g.num_used_tokens),
            ("token_usage", "The token usage.", g.token_usage),
            ("gen_throughput", "The generation throughput (token/s).", g.gen_throughput),
            (
                "max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
                float(cfg.max_total_tokens),
            ),
            ("cache_hit_rate", "The prefix cache hit rate.", 0.0),
            ("num_grammar_queue_reqs", "The number of requests in the grammar queue.", 0.0),
            ("utilization", "The utilization.", -1.0 if cfg.engine_type == "prefill" else 0.0),
            ("engine_startup_time", "The time taken for the engine to start up.", cfg.startup_time),
            ("engine_load_weights_time", "The time taken for the engine to load weights.", 0.0),
        ]
        if cfg.engine_type == "prefill":
            gauges += [
                ("num_prefill_prealloc_queue_reqs", "Prefill bootstrap queue.", 0.0),
                ("num_prefill_inflight_queue_reqs", "Prefill transfer queue.", 0.0),
            ]
        elif cfg.engine_type == "decode":
            gauges += [
                ("num_decode_prealloc_queue_reqs", "Decode prealloc queue.", 0.0),
                ("num_decode_transfer_queue_reqs", "Decode transfer queue.", 0.0),
            ]
        for name, doc, value in gauges:
            family(name, "gauge", doc)
            sample(name, sched, value)
        family("realtime_tokens_total", "counter", "Tokens processed, updated every log interval.")
        for mode in ("prefill_compute", "decode"):
            sample("realtime_tokens_total", {**sched, "mode": mode}, self.realtime_tokens[mode])
        self._histogram(out, "queue_time_seconds", "Queueing time.", self.queue_hist, sched)
        counters = [
            (
                "prompt_tokens_total",
                "Number of prefill tokens processed.",
                self.prompt_tokens_total,
            ),
            (
                "generation_tokens_total",
                "Number of generation tokens processed.",
                self.generation_tokens_total,
            ),
            ("cached_tokens_total", "Number of cached prompt tokens.", 0),
            ("num_requests_total", "Number of requests processed.", self.num_requests_total),
            (
                "num_aborted_requests_total",
                "Number of requests aborted.",
                self.num_aborted_requests_total,
            ),
        ]
        for name, doc, count in counters:
            family(name, "counter", doc)
            sample(name, tok, float(count))
        self._histogram(
            out,
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            self.ttft_hist,
            tok,
        )
        self._histogram(
            out,
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            self.itl_hist,
            tok,
        )
        self._histogram(
            out,
            "e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            self.e2e_hist,
            tok,
        )
        return "\n".join(out) + "\n"

    @staticmethod
    def _histogram(
        out: list[str], name: str, doc: str, hist: Histogram, labels: dict[str, str]
    ) -> None:
        out.append(f"# HELP sglang:{name} {doc}")
        out.append(f"# TYPE sglang:{name} histogram")
        body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        out.append(f"sglang:{name}_sum{{{body}}} {_num(hist.sum)}")
        for bound, count in zip(hist.buckets, hist.counts, strict=True):
            out.append(f'sglang:{name}_bucket{{le="{_num(bound)}",{body}}} {_num(float(count))}')
        out.append(f'sglang:{name}_bucket{{le="+Inf",{body}}} {_num(float(hist.count))}')
        out.append(f"sglang:{name}_count{{{body}}} {_num(float(hist.count))}")


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
