"""The bodies the simulated engine sends, as SGLang's pydantic models serialize them.

SSE chunks, usage, error objects and the engine's made-up tokens: the OpenAI-compatible
shapes (compact JSON, nulls kept), apart from the server that sends them (the playback
engine's errors take the same shape).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class _Ctx:
    chat: bool
    rid: str
    created: int
    model: str
    finish: str
    include_usage: bool


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _chunk(ctx: _Ctx, delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
    """One SSE event as SGLang's pydantic models serialize it (compact, nulls kept)."""
    if ctx.chat:
        full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
        full.update(delta or {})
        choice: dict[str, Any] = {
            "index": 0,
            "delta": full,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": None,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": (delta or {}).get("content", ""),
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": None,
        }
        obj = "text_completion"
    body = {
        "id": ctx.rid,
        "object": obj,
        "created": ctx.created,
        "model": ctx.model,
        "choices": [choice],
        "usage": None,
    }
    return b"data: " + _dumps(body) + b"\n\n"


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def _error_obj(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


def _token(i: int) -> str:
    return f"tok{i} "


def _prompt_tokens(payload: dict[str, Any]) -> int:
    messages = payload.get("messages")
    if isinstance(messages, list):
        text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    else:
        text = str(payload.get("prompt", ""))
    return max(1, len(text) // 4)
