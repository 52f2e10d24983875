"""A simulated SGLang engine: OpenAI-compatible HTTP, a batch scheduler, SGLang's metrics.

What a client, a router or a tap sees is shaped like SGLang (``reference/llm-serving.md``
§1.3-1.5, §2.4, §4):

* ``POST /v1/chat/completions`` and ``/v1/completions``, streaming or not. A stream is
  ``text/event-stream`` over chunked encoding, one SSE event per chunk: the role chunk,
  one content chunk per token, a chunk with ``finish_reason``, the usage chunk (``choices:
  []``) when ``stream_options.include_usage``, then ``data: [DONE]`` and the last chunk.
  As in current SGLang the response head goes out with the first token (the handler
  waits for the first output before it answers); ``early_headers`` sends it at once, as
  vLLM does.
* ``GET /health`` (503 during ``startup``), ``/health_generate`` (a 1-token probe through
  the scheduler; 200 as soon as the scheduler produces anything, 503 after
  ``health_timeout``), ``/v1/models``, ``/model_info`` and ``/get_model_info`` (without
  ``model_path``/``tokenizer_path``, so a router does not try to fetch a tokenizer),
  ``/server_info`` and ``/get_server_info``, ``/v1/loads`` (live values; it waits while
  the scheduler is wedged, since SGLang asks the scheduler), ``/get_load``, ``/metrics``.
* Idle keep-alive connections are closed after ``keepalive`` seconds (uvicorn's
  ``timeout_keep_alive``, 5 s in SGLang and vLLM).

Load behaves like load: see ``scheduler.py``.

Per-request headers: ``x-sim-tokens`` (output tokens), ``x-sim-ttft`` (this request's first
token comes that long after admission, outside the prefill batch), ``x-sim-itl`` (this
request's own token gap; at least one decode step), ``x-sim-fault`` (a fault spec, see
below, or ``none``).

Faults (``parse_fault``, ``FAULT_KINDS``, ``RULE_KEYS``): see ``engine_faults``, which says
what each one does, how it is spelled and which completions its rules choose.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import h11
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from ..errors import start_error
from ..faults.spec import FaultSpecError as FaultSpecError  # (re-exported: parse_fault's)
from .engine_faults import FAULT_KINDS as FAULT_KINDS  # (re-exported: the tests')
from .engine_faults import RULE_KEYS as RULE_KEYS
from .engine_faults import Fault as Fault
from .engine_faults import parse_fault as parse_fault
from .http1 import (
    _SOCKET_ERRORS,
    _bad_request,
    _Hangup,
    _read_request,
    _send_body,
    _send_json,
    _server_headers,
    _set_linger_zero,
    _watch_client,
)
from .openai_bodies import _chunk, _Ctx, _dumps, _error_obj, _prompt_tokens, _token, _usage
from .request_records import RecordWriter
from .scheduler import EngineType, Scheduler, SchedulerConfig, SimRequest

log = structlog.get_logger("tracer.sim.engine")

SIM_VERSION = "0.5.6"  # what /server_info and /v1/loads report as the SGLang version


@dataclass
class EngineConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    tokens: int = 16  # output tokens when the request gives no max_tokens
    ttft: float = 0.02  # prefill batch time (first token with an empty engine)
    itl: float = 0.005  # decode step with one running request
    keepalive: float = 5.0
    max_running: int = 64
    prefill_per_token: float = 0.0
    batch_alpha: float = 0.05
    decode_log_interval: int = 40
    idle_refresh: float = 30.0
    max_total_tokens: int = 262144
    context_length: int = 32768
    engine_type: EngineType = "unified"
    token_counters: Literal["live", "finish"] = "finish"
    startup: float = 0.0  # /health answers 503 this long after start
    health_timeout: float = 20.0
    early_headers: bool = False
    faults: list[Fault] = field(default_factory=list)
    # the engine's own per-request records (request_records.py): SGLang's JSONL, vLLM's
    # spans as OTLP JSON
    export_request_metrics: str | None = None
    export_spans: str | None = None

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            model=self.model,
            engine_type=self.engine_type,
            max_running=self.max_running,
            ttft=self.ttft,
            prefill_per_token=self.prefill_per_token,
            itl=self.itl,
            batch_alpha=self.batch_alpha,
            decode_log_interval=self.decode_log_interval,
            idle_refresh=self.idle_refresh,
            max_total_tokens=self.max_total_tokens,
            token_counters=self.token_counters,
            startup_time=self.startup,
        )


class SimEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config.scheduler_config())
        self.bound: tuple[str, int] | None = None
        self.requests = 0  # HTTP requests of any kind
        self.completions = 0  # completion requests (the fault rules count these)
        self._injected = [0] * len(config.faults)  # per --fault: for times=N
        self._draws = [random.Random(f.seed) for f in config.faults]  # per --fault: prob=P
        self.lost = 0  # requests held by the ``lost`` fault right now
        self.connections = 0
        self.hits: Counter[str] = Counter()  # "METHOD /path" -> requests
        self.records = RecordWriter(config.export_request_metrics, config.export_spans)
        self.started_at = time.monotonic()

    @property
    def url(self) -> str:
        assert self.bound is not None
        return f"http://{self.bound[0]}:{self.bound[1]}"

    async def serve(
        self, *, task_status: TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            listener = await anyio.create_tcp_listener(
                local_host=self.config.host, local_port=self.config.port
            )
        except OSError as exc:
            where = f"{self.config.host}:{self.config.port}"
            raise start_error(f"sim engine cannot listen on {where}", exc) from None
        first = listener.listeners[0]
        self.bound = (
            str(first.extra(SocketAttribute.local_address)[0]),
            int(first.extra(SocketAttribute.local_port)),
        )
        self.started_at = time.monotonic()
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(self.scheduler.run)
            task_status.started(self.bound)
            await listener.serve(self._handle)

    # ---- connections ------------------------------------------------------------------

    async def _handle(self, stream: SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        reset = False
        try:
            while True:
                try:
                    got = await _read_request(conn, stream, self.config.keepalive)
                except h11.RemoteProtocolError:
                    await _bad_request(conn, stream)
                    return
                if got is None:
                    return
                request, body = got
                self.requests += 1
                if request.http_version not in (b"1.0", b"1.1"):  # e.g. an HTTP/2 preface
                    self.hits[
                        f"{request.method.decode('latin-1')} HTTP/{request.http_version.decode()}"
                    ] += 1
                    await _bad_request(conn, stream)
                    return
                await self._respond(conn, stream, request, body)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except _Hangup as hangup:
            reset = hangup.reset
        except (*_SOCKET_ERRORS, h11.ProtocolError):
            return
        except Exception:  # never let one connection take the listener down
            log.exception("sim engine connection failed")
        finally:
            if reset:
                _set_linger_zero(stream)
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _respond(
        self, conn: h11.Connection, stream: SocketStream, request: h11.Request, body: bytes
    ) -> None:
        path = request.target.decode("latin-1").split("?", 1)[0]
        method = request.method.decode("latin-1")
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        self.hits[f"{method} {path}"] += 1
        getters = {
            "/health": self._health,
            "/health_generate": self._health_generate,
            "/v1/models": self._models,
            "/model_info": self._model_info,
            "/get_model_info": self._model_info,
            "/server_info": self._server_info,
            "/get_server_info": self._server_info,
            "/v1/loads": self._loads,
            "/get_load": self._get_load,
        }
        if path in getters or path == "/metrics":
            if method != "GET":
                await _send_json(conn, stream, 405, {"detail": "Method Not Allowed"})
            elif path == "/metrics":
                text = self.scheduler.metrics_text().encode()
                await _send_body(
                    conn, stream, 200, "text/plain; version=0.0.4; charset=utf-8", text
                )
            else:
                status, obj = await getters[path]()
                if obj is None:
                    await _send_body(conn, stream, status, "text/plain; charset=utf-8", b"")
                else:
                    await _send_json(conn, stream, status, obj)
        elif path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                await _send_json(conn, stream, 405, {"detail": "Method Not Allowed"})
                return
            try:
                payload = json.loads(body or b"{}")
                if not isinstance(payload, dict):
                    raise ValueError("the body is not a JSON object")
                fault = self._fault_for(hdrs)
            except ValueError as exc:
                await _send_json(conn, stream, 400, _error_obj(str(exc), "BadRequest", 400))
                return
            await self._completion(conn, stream, path, payload, hdrs, fault)
        else:
            await _send_json(conn, stream, 404, {"detail": "Not Found"})

    # ---- GET endpoints ----------------------------------------------------------------

    def _starting(self) -> bool:
        return time.monotonic() - self.started_at < self.config.startup

    async def _health(self) -> tuple[int, Any]:
        return (503 if self._starting() else 200), None

    async def _health_generate(self) -> tuple[int, Any]:
        if self._starting():
            return 503, None
        sched = self.scheduler
        tic = time.monotonic()
        probe = SimRequest(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex[:16]}",
            prompt_tokens=1,
            max_tokens=1,
            internal=True,
        )
        sched.submit(probe)
        ok = False
        with anyio.move_on_after(self.config.health_timeout):
            while not (probe.generated or sched.last_progress > tic):
                await sched.progress.wait()
            ok = True
        sched.abort(probe)
        probe.receive.close()
        return (200 if ok else 503), None

    async def _models(self) -> tuple[int, Any]:
        cfg = self.config
        card = {
            "id": cfg.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": cfg.model,
            "max_model_len": cfg.context_length,
        }
        return 200, {"object": "list", "data": [card]}

    async def _model_info(self) -> tuple[int, Any]:
        # no model_path / tokenizer_path: the SGLang router would try to load a tokenizer
        return 200, {
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }

    async def _server_info(self) -> tuple[int, Any]:
        cfg = self.config
        host, port = self.bound or (cfg.host, cfg.port)
        return 200, {
            "served_model_name": cfg.model,
            "host": host,
            "port": port,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null" if cfg.engine_type == "unified" else cfg.engine_type,
            "disaggregation_bootstrap_port": 8998,
            "context_length": cfg.context_length,
            "max_running_requests": cfg.max_running,
            "max_total_tokens": cfg.max_total_tokens,
            "max_prefill_tokens": 16384,
            "chunked_prefill_size": 8192,
            "decode_log_interval": cfg.decode_log_interval,
            "enable_metrics": True,
            "max_total_num_tokens": cfg.max_total_tokens,
            "max_req_input_len": cfg.context_length - 1,
            "internal_states": [
                {
                    "avg_spec_accept_length": None,
                    "last_gen_throughput": self.scheduler.last_gen_throughput,
                }
            ],
            "version": SIM_VERSION,
            "sim": True,
        }

    async def _loads(self) -> tuple[int, Any]:
        await self.scheduler.unwedged.wait()  # SGLang asks the scheduler process
        load = self.scheduler.load()
        load["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
        aggregate = {
            "total_running_reqs": load["num_running_reqs"],
            "total_waiting_reqs": load["num_waiting_reqs"],
            "total_reqs": load["num_total_reqs"],
            "total_used_tokens": load["num_used_tokens"],
            "total_tokens": load["num_total_tokens"],
            "avg_token_usage": load["token_usage"],
            "avg_throughput": load["gen_throughput"],
            "avg_utilization": load["utilization"],
        }
        return 200, {
            "timestamp": load["timestamp"],
            "version": SIM_VERSION,
            "dp_rank_count": 1,
            "loads": [load],
            "aggregate": aggregate,
        }

    async def _get_load(self) -> tuple[int, Any]:
        await self.scheduler.unwedged.wait()
        load = self.scheduler.load()
        return 200, [
            {
                "dp_rank": 0,
                "num_reqs": load["num_total_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"],
                "num_tokens": load["num_used_tokens"],
                "num_pending_tokens": 0,
                "ts_tic": time.time(),
            }
        ]

    # ---- completions ------------------------------------------------------------------

    def _fault_for(self, hdrs: dict[str, str]) -> Fault | None:
        self.completions += 1
        spec = hdrs.get("x-sim-fault")
        if spec is not None:
            if spec.strip().lower() in ("", "none"):
                return None
            return parse_fault(spec, rules=False)
        for i, fault in enumerate(self.config.faults):
            if not fault.matches(self.completions):
                continue
            if fault.prob is not None and self._draws[i].random() >= fault.prob:
                continue
            if fault.times is not None and self._injected[i] >= fault.times:
                continue
            self._injected[i] += 1
            return fault
        return None

    async def _completion(
        self,
        conn: h11.Connection,
        stream: SocketStream,
        path: str,
        payload: dict[str, Any],
        hdrs: dict[str, str],
        fault: Fault | None,
    ) -> None:
        cfg = self.config
        chat = path.endswith("chat/completions")
        limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
        if "x-sim-tokens" in hdrs:
            tokens = int(hdrs["x-sim-tokens"])
            finish = "length" if limit is not None and tokens >= int(limit) else "stop"
        elif limit:
            tokens, finish = int(limit), "length"
        else:
            tokens, finish = cfg.tokens, "stop"
        if cfg.engine_type == "prefill":
            tokens = min(tokens, 1)  # a prefill worker returns the first token only
        if fault is not None and fault.kind == "500":
            obj = _error_obj("Internal server error (sim fault)", "InternalServerError", 500)
            await _send_json(conn, stream, 500, obj)
            return
        if fault is not None and fault.kind == "lost":
            await self._lose(stream)
            raise _Hangup(reset=False)
        options = payload.get("stream_options")
        ctx = _Ctx(
            chat=chat,
            rid=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            created=int(time.time()),
            model=str(payload.get("model") or cfg.model),
            finish=finish,
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        )
        stall = fault if fault is not None and fault.kind == "stall" else None
        wedge = fault if fault is not None and fault.kind == "wedge" else None
        ignore = fault is not None and fault.kind == "ignore-disconnect"
        req = SimRequest(
            rid=ctx.rid,
            prompt_tokens=_prompt_tokens(payload),
            max_tokens=tokens,
            ttft=float(hdrs["x-sim-ttft"]) if "x-sim-ttft" in hdrs else None,
            itl=float(hdrs["x-sim-itl"]) if "x-sim-itl" in hdrs else None,
            stall_after=stall.after if stall else None,
            stall_for=stall.seconds if stall else 0.0,
            wedge_after=wedge.after if wedge else None,
            wedge_for=wedge.seconds if wedge else 0.0,
            ignore_disconnect=ignore,
        )
        cut = fault if fault is not None and fault.kind in ("close", "reset", "error") else None
        self.scheduler.submit(req)
        outcome = "gone"
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_client, conn, stream, tg.cancel_scope)
                try:
                    if payload.get("stream"):
                        outcome = await self._stream(conn, stream, req, ctx, cut)
                    else:
                        outcome = await self._unary(conn, stream, req, ctx, cut)
                except _SOCKET_ERRORS:
                    outcome = "gone"
                tg.cancel_scope.cancel()
        finally:
            if not (ignore and outcome == "gone"):  # ignore-disconnect: it decodes on
                self.scheduler.abort(req)  # no-op when it finished
            req.receive.close()
            if self.records.active:
                self.records.write(req, chat=chat, payload=payload, headers=hdrs, finish=finish)
        if outcome in ("close", "reset", "gone"):
            raise _Hangup(reset=outcome == "reset")

    async def _lose(self, stream: SocketStream) -> None:
        """Read and never answer, until the client gives up."""
        self.lost += 1
        try:
            while True:
                await stream.receive()
        except _SOCKET_ERRORS:
            pass
        finally:
            self.lost -= 1

    async def _stream(
        self,
        conn: h11.Connection,
        stream: SocketStream,
        req: SimRequest,
        ctx: _Ctx,
        cut: Fault | None,
    ) -> str:
        async def send(data: bytes) -> None:
            await stream.send(conn.send(h11.Data(data=data)) or b"")

        async def head() -> None:
            response = h11.Response(
                status_code=200,
                headers=[
                    *_server_headers(),
                    ("content-type", "text/event-stream; charset=utf-8"),
                ],
            )
            await stream.send(conn.send(response) or b"")

        async def cut_here() -> str:
            assert cut is not None
            self.scheduler.abort(req)
            if cut.kind != "error":
                return cut.kind
            err = _error_obj("Generation aborted (sim fault).", "INTERNAL_SERVER_ERROR", 500)
            event = b"data: " + json.dumps({"error": err}).encode() + b"\n\n"
            # the error event, [DONE] and the body's end in one write (two chunks and the
            # last one): a client that closes at the error event does not cross the rest
            # on the wire
            pieces = [h11.Data(data=event), h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage()]
            await stream.send(b"".join(conn.send(piece) or b"" for piece in pieces))
            return "error"

        head_sent = self.config.early_headers
        if head_sent:
            await head()
        delivered = 0
        role_sent = not ctx.chat
        async for index in req.receive:
            if not head_sent:
                await head()
                head_sent = True
            if cut is not None and delivered >= cut.after:
                return await cut_here()
            if not role_sent:
                await send(_chunk(ctx, {"role": "assistant", "content": ""}))
                role_sent = True
            last = not ctx.chat and index == req.max_tokens - 1
            await send(_chunk(ctx, {"content": _token(index)}, ctx.finish if last else None))
            delivered += 1
        if req.state != "finished":
            return "gone"
        if not head_sent:
            await head()
        if cut is not None:
            return await cut_here()
        if not role_sent:
            await send(_chunk(ctx, {"role": "assistant", "content": ""}))
        if ctx.chat or req.max_tokens == 0:
            await send(_chunk(ctx, None, ctx.finish))
        if ctx.include_usage:
            usage = _usage(req.prompt_tokens, req.generated)
            body: dict[str, Any] = {
                "id": ctx.rid,
                "object": "chat.completion.chunk" if ctx.chat else "text_completion",
                "created": ctx.created,
                "model": ctx.model,
                "choices": [],
                "usage": usage,
            }
            await send(b"data: " + _dumps(body) + b"\n\n")
        await send(b"data: [DONE]\n\n")
        await stream.send(conn.send(h11.EndOfMessage()) or b"")
        return "done"

    async def _unary(
        self,
        conn: h11.Connection,
        stream: SocketStream,
        req: SimRequest,
        ctx: _Ctx,
        cut: Fault | None,
    ) -> str:
        parts: list[str] = []
        cut_now = False
        async for index in req.receive:
            if cut is not None and len(parts) >= cut.after:
                cut_now = True
                break
            parts.append(_token(index))
        if not cut_now:
            if req.state != "finished":
                return "gone"
            cut_now = cut is not None  # after >= tokens: the cut comes at the end
        if cut is not None and cut_now:
            self.scheduler.abort(req)
            if cut.kind != "error":
                return cut.kind
            obj = _error_obj("Generation aborted (sim fault).", "InternalServerError", 500)
            await _send_json(conn, stream, 500, obj)
            return "error"
        text = "".join(parts)
        if ctx.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": ctx.finish,
                "matched_stop": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": ctx.finish,
                "matched_stop": None,
            }
        await _send_json(
            conn,
            stream,
            200,
            {
                "id": ctx.rid,
                "object": "chat.completion" if ctx.chat else "text_completion",
                "created": ctx.created,
                "model": ctx.model,
                "choices": [choice],
                "usage": _usage(req.prompt_tokens, req.generated),
            },
        )
        return "done"
