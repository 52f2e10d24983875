"""A multi-round agent harness on the real openai SDK: the client of demos and tests.

S sessions run concurrently; each does R rounds of streaming chat completions whose
conversation grows with the previous answer, on its own SDK client (so its own
keep-alive pool: rounds after the first reuse the connection), with an
``x-request-id`` on every request and a deadline per round. A round that fails ends
its session (an agent cannot go on without the answer).

Outcomes: ``complete`` (a ``finish_reason`` arrived and the stream ended), ``hung`` (no
complete answer by the deadline), ``truncated`` (the stream started and ended early:
connection closed mid-body, or a clean end without ``finish_reason``), ``error`` (an
HTTP error, an SSE error event, a refused or empty connection).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TextIO

import anyio
import httpx
import openai


@dataclass
class RoundResult:
    session: int
    round: int
    request_id: str
    ok: bool
    outcome: str  # complete | hung | truncated | error
    ttft: float | None = None
    duration: float = 0.0
    chunks: int = 0
    error: str | None = None


@dataclass
class HarnessConfig:
    base_url: str
    sessions: int = 2
    rounds: int = 3
    think: float = 0.2  # idle gap between rounds (the keep-alive reuse gap)
    max_tokens: int = 8
    deadline: float = 30.0  # a round not finished by then counts as hung
    model: str = "sim-model"


@dataclass
class HarnessReport:
    rounds: list[RoundResult] = field(default_factory=list)
    planned: int = 0  # sessions x rounds

    @property
    def failed(self) -> list[RoundResult]:
        return [r for r in self.rounds if not r.ok]

    @property
    def not_run(self) -> int:
        return max(0, self.planned - len(self.rounds))


async def run_harness(cfg: HarnessConfig) -> HarnessReport:
    report = HarnessReport(planned=cfg.sessions * cfg.rounds)
    async with anyio.create_task_group() as tg:
        for s in range(cfg.sessions):
            tg.start_soon(_session, cfg, s + 1, report)
    report.rounds.sort(key=lambda r: (r.session, r.round))
    return report


async def _session(cfg: HarnessConfig, session: int, report: HarnessReport) -> None:
    client = openai.AsyncOpenAI(
        base_url=cfg.base_url.rstrip("/") + "/v1",
        api_key="sk-sim-harness",
        max_retries=0,
        timeout=cfg.deadline + 5.0,  # our own deadline decides, not the SDK's read timeout
    )
    messages: list[Any] = [{"role": "system", "content": "You are a coding agent."}]
    try:
        for rnd in range(1, cfg.rounds + 1):
            if rnd > 1 and cfg.think > 0:
                await anyio.sleep(cfg.think)
            messages.append({"role": "user", "content": f"session {session} round {rnd}: continue"})
            result = await _round(client, cfg, session, rnd, messages)
            report.rounds.append(result)
            if not result.ok:
                return
    finally:
        with anyio.CancelScope(shield=True):
            await client.close()


async def _round(
    client: openai.AsyncOpenAI,
    cfg: HarnessConfig,
    session: int,
    rnd: int,
    messages: list[Any],
) -> RoundResult:
    rid = f"s{session}-r{rnd}-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    result = RoundResult(session=session, round=rnd, request_id=rid, ok=False, outcome="error")
    text: list[str] = []
    finished = False
    with anyio.move_on_after(cfg.deadline) as scope:
        try:
            stream = await client.chat.completions.create(
                model=cfg.model,
                messages=messages,
                max_tokens=cfg.max_tokens,
                stream=True,
                extra_headers={"x-request-id": rid},
            )
            async for chunk in stream:
                result.chunks += 1
                for choice in chunk.choices:
                    if choice.delta.content:
                        if result.ttft is None:
                            result.ttft = time.monotonic() - start
                        text.append(choice.delta.content)
                    if choice.finish_reason:
                        finished = True
            result.ok = finished
            result.outcome = "complete" if finished else "truncated"
            if not finished:
                result.error = "the stream ended without a finish_reason"
        except openai.APITimeoutError as exc:
            result.outcome, result.error = "hung", f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # any failure of the round is its outcome
            result.error = _describe(exc)
            if result.chunks and _is_cut(exc):
                result.outcome = "truncated"
    if scope.cancelled_caught:
        result.outcome, result.error = "hung", f"no complete answer after {cfg.deadline:g}s"
    result.duration = time.monotonic() - start
    messages.append({"role": "assistant", "content": "".join(text)})
    return result


def _describe(exc: BaseException) -> str:
    """The exception, and its root cause when the SDK wraps one (e.g. httpx's)."""
    text = f"{type(exc).__name__}: {exc}"
    root, link = exc, exc.__cause__ or exc.__context__
    for _ in range(10):  # chains are short; never loop on a cycle
        if link is None:
            break
        root, link = link, link.__cause__ or link.__context__
    if root is not exc:
        text += f" ({type(root).__name__}: {root})"
    return text


def _is_cut(exc: BaseException) -> bool:
    """The connection ended inside the body (httpx's incomplete chunked read, a reset)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, httpx.RemoteProtocolError | httpx.ReadError):
            return True
        if isinstance(seen, openai.APIConnectionError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def print_report(report: HarnessReport, out: TextIO) -> None:
    """The per-round table, then the rounds that did not complete."""
    header = f"{'session':>7} {'round':>5}  {'request id':<20} {'outcome':<9} {'ttft ms':>9} {'total ms':>9} {'chunks':>6}"
    print(header, file=out)
    for r in report.rounds:
        ttft = f"{r.ttft * 1000:.1f}" if r.ttft is not None else "-"
        print(
            f"{r.session:>7} {r.round:>5}  {r.request_id:<20} {r.outcome:<9} {ttft:>9} "
            f"{r.duration * 1000:>9.1f} {r.chunks:>6}",
            file=out,
        )
    complete = sum(1 for r in report.rounds if r.ok)
    print(f"{complete}/{report.planned} rounds complete", file=out)
    for r in report.failed:
        print(
            f"NOT COMPLETE: session {r.session} round {r.round} ({r.request_id}): "
            f"{r.outcome}: {r.error or '-'}",
            file=out,
        )
    if report.not_run:
        print(f"{report.not_run} rounds not run (their session stopped at a failure)", file=out)
