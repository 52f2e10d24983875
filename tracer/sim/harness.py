"""A multi-round agent harness on the real openai SDK: the client of demos and tests.

S sessions run concurrently; each does R rounds of streaming chat completions whose
conversation grows with the previous answer, on its own SDK client (so its own
keep-alive pool: rounds after the first reuse the connection), with an
``x-request-id`` on every request and a deadline per round.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import openai


@dataclass
class RoundResult:
    session: int
    round: int
    request_id: str
    ok: bool
    outcome: str  # complete | timeout | error | truncated
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

    @property
    def failed(self) -> list[RoundResult]:
        return [r for r in self.rounds if not r.ok]


async def run_harness(cfg: HarnessConfig) -> HarnessReport:
    report = HarnessReport()
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
        timeout=cfg.deadline,
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
        except Exception as exc:  # any failure of the round is its outcome
            result.error = f"{type(exc).__name__}: {exc}"
    if scope.cancelled_caught:
        result.outcome, result.error = "timeout", f"no complete answer after {cfg.deadline:g}s"
    result.duration = time.monotonic() - start
    messages.append({"role": "assistant", "content": "".join(text)})
    return result
