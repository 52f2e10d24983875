"""What ``tracer bench`` sends: a synthetic request mix, or a capture's requests again.

A mix is taken in order and cycled. Synthetic prompts are distinct per request (so a
prefix cache does not flatter TTFT), made of four-character words that count as about one
token each; a capture's mix keeps each captured request's prompt and output length.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .. import events as ev
from ..capture.bodies import decode_body
from ..capture.files import CaptureError, read_events

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")

# Four characters each: one token in common BPE vocabularies, and one for the simulated
# engine (which counts characters / 4), so --prompt-len N is about N tokens on both.
_WORD_TEXT = (
    "the and for you are not was but all any can had her one our out day get has him "
    "his how man new now old see two way who boy did its let put say she too use act "
    "add age ago air arm art ask bad bag bed big box bus buy car cat cup cut dog dry "
    "ear eat egg end eye far fat few fit fly fun gas god gun hat hit hot ice job key"
)
_WORDS = tuple(f" {w}" for w in _WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the mix: where it goes, its body, the lengths it was made for."""

    path: str
    body: bytes
    prompt_len: int | None  # tokens, as captured or asked (None: unknown)
    output_len: int


@dataclass
class Mix:
    """The requests to cycle through, and how they were made (for the JSON)."""

    specs: Callable[[int], RequestSpec]  # the i-th request (i = 0, 1, 2 ...)
    describe: dict[str, Any]


def synthetic_prompt(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choices(_WORDS, k=tokens))


def _request_body(
    base: dict[str, Any], output_len: int, *, model: str | None, ignore_eos: bool
) -> bytes:
    body = dict(base)
    if model is not None:
        body["model"] = model
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    body["max_tokens"] = output_len
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return orjson.dumps(body)


def synthetic_mix(
    prompt_len: int, output_len: int, *, model: str, endpoint: str, ignore_eos: bool, seed: int = 0
) -> Mix:
    chat = endpoint == "chat"
    path = COMPLETION_PATHS[0] if chat else COMPLETION_PATHS[1]

    def spec(i: int) -> RequestSpec:
        prompt = synthetic_prompt(prompt_len, seed * 1_000_003 + i)
        base: dict[str, Any] = (
            {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        )
        body = _request_body(base, output_len, model=model, ignore_eos=ignore_eos)
        return RequestSpec(path, body, prompt_len, output_len)

    describe = {
        "source": "synthetic",
        "endpoint": endpoint,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "ignore_eos": ignore_eos,
    }
    return Mix(specs=spec, describe=describe)


def capture_mix(
    path: str, *, model: str | None, ignore_eos: bool
) -> tuple[Mix, list[str], str | None]:
    """The completion requests of a capture, with their captured lengths.

    Returns the mix, the requests left out (``"conn 3 #2: why"``), and the captured model.
    Output length: ``usage.completion_tokens`` of the captured response, else its content
    events, else the request's ``max_tokens``. Prompt: the captured body when kept, else a
    synthetic prompt of the captured ``usage.prompt_tokens``.
    """
    heads: dict[tuple[str, int, int], ev.RequestHead] = {}
    ends: dict[tuple[str, int, int], ev.RequestEnd] = {}
    responses: dict[tuple[str, int, int], ev.ResponseEnd] = {}
    content: Counter[tuple[str, int, int]] = Counter()
    try:
        for event in read_events(path):
            if isinstance(event, ev.RequestHead):
                heads[(event.tap, event.conn, event.seq)] = event
            elif isinstance(event, ev.RequestEnd):
                ends[(event.tap, event.conn, event.seq)] = event
            elif isinstance(event, ev.ResponseEnd):
                responses[(event.tap, event.conn, event.seq)] = event
            elif isinstance(event, ev.BodyData) and event.sse:
                key = (event.tap, event.conn, event.seq)
                content[key] += sum(1 for item in event.sse if item[2] == "content")
    except OSError as exc:
        raise CaptureError(f"cannot read {path}: {exc.strerror or exc}") from None
    specs: list[RequestSpec] = []
    left_out: list[str] = []
    models: Counter[str] = Counter()
    for key, head in sorted(heads.items(), key=lambda kv: kv[1].m):
        name = f"conn {key[1]} #{key[2]}" + (f" ({head.request_id})" if head.request_id else "")
        target = head.target.split("?", 1)[0]
        endpoint = next((p for p in COMPLETION_PATHS if target.endswith(p)), None)
        if head.method != "POST" or endpoint is None:
            continue
        end, response = ends.get(key), responses.get(key)
        usage = response.usage if response is not None and response.usage else {}
        output_len = as_int(usage.get("completion_tokens")) or content[key] or None
        if output_len is None and end is not None:
            output_len = end.max_tokens
        if not output_len:
            left_out.append(f"{name}: output length unknown (no usage, no content, no max_tokens)")
            continue
        prompt_len = as_int(usage.get("prompt_tokens"))
        base = _captured_body(end)
        if base is None:
            if prompt_len is None:
                left_out.append(f"{name}: body not kept and prompt length unknown")
                continue
            prompt = synthetic_prompt(prompt_len, len(specs))
            if endpoint == COMPLETION_PATHS[0]:
                base = {"messages": [{"role": "user", "content": prompt}]}
            else:
                base = {"prompt": prompt}
            if end is not None and end.model:
                base["model"] = end.model
        if isinstance(base.get("model"), str):
            models[base["model"]] += 1
        body = _request_body(base, output_len, model=model, ignore_eos=ignore_eos)
        specs.append(RequestSpec(endpoint, body, prompt_len, output_len))
    if not specs:
        why = f"; left out: {'; '.join(left_out[:5])}" if left_out else ""
        raise CaptureError(f"{path}: no completion requests to replay{why}")
    frozen = tuple(specs)
    lengths = [s.output_len for s in frozen]
    prompts = [s.prompt_len for s in frozen if s.prompt_len is not None]
    describe = {
        "source": "capture",
        "capture": str(path),
        "requests_in_mix": len(frozen),
        "left_out": len(left_out),
        "output_len": {"mean": statistics.fmean(lengths), "min": min(lengths), "max": max(lengths)},
        "prompt_len": (
            {"mean": statistics.fmean(prompts), "min": min(prompts), "max": max(prompts)}
            if prompts
            else None
        ),
        "ignore_eos": ignore_eos,
    }
    captured_model = models.most_common(1)[0][0] if models else None
    return Mix(lambda i: frozen[i % len(frozen)], describe), left_out, captured_model


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _captured_body(end: ev.RequestEnd | None) -> dict[str, Any] | None:
    if end is None or not end.body_kept or end.body is None:
        return None
    raw = decode_body(end.body, end.body_encoding)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not ("messages" in obj or "prompt" in obj):
        return None
    return obj
