"""An OpenAI-compatible HTTP API over a `LiveScheduler` (Starlette; run by uvicorn in `specjax serve`).

Routes: ``POST /v1/completions`` (a text prompt, as it is), ``POST /v1/chat/completions``
(messages through the tokenizer's chat template), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text). ``"stream": true`` answers with server-sent events, one
chunk per engine round that committed text, then a last chunk with the finish reason and
``usage``, then ``data: [DONE]``. ``usage`` has the prompt and completion tokens and specjax's
own per-request figures: target passes, drafts proposed and accepted, accepted tokens per pass.

Errors are JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed body or
a bad field (the field named in ``param``), 404 for an unknown model, 429 when the queue is
full, 503 while shutting down. A client that disconnects has its request cancelled: its slot
is free at the next round.

Sampling is the server's (``--config.temperature`` etc.): a request may repeat the server's
value of temperature, top_p or top_k, or leave it out; another value, or any seed, is a 400
naming the field (per-request sampling settings are not built yet), never silently ignored.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from specjax.serving._live import LiveScheduler, QueueFull, Stopped

# The request fields each route reads; any other field is refused by name (a 400), so a client
# never believes a setting took effect that did not.
_COMMON = {"model", "max_tokens", "max_completion_tokens", "stream", "stream_options", "temperature", "top_p",
           "top_k", "n", "user", "seed"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _sampling_echo(name: str, value, server) -> None:
    """A request's sampling field: absent/None or the server's own value, else a 400 naming it."""
    if value is None:
        return
    if name == "seed":                  # each request's key is fold_in(server key, request id)
        raise ApiError(400, f"seed={value}: per-request seeds are not supported yet (each request gets its own "
                            f"key from the server's seed); omit seed", "seed")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ApiError(400, f"{name} must be a number, got {value!r}", name)
    if float(value) != float(server):
        raise ApiError(400, f"{name}={value}: this server samples with {name}={server} for every request "
                            f"(per-request sampling settings are not supported yet); omit {name} or send {server}",
                       name)


class Api:
    """The routes' logic over one scheduler, tokenizer and model name."""

    def __init__(self, live: LiveScheduler, tokenizer, model_name: str, sampling_settings: dict):
        self.live, self.tokenizer, self.model_name = live, tokenizer, model_name
        self.sampling_settings = sampling_settings     # {"temperature": .., "top_p": .., "top_k": ..}
        self.created = int(time.time())

    # ------------------------------------------------------------------ parsing

    def parse(self, raw: bytes, fields: set[str]) -> dict:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise ApiError(400, f"unsupported field {unknown[0]!r} (this server reads: {', '.join(sorted(fields))})",
                           unknown[0])
        model = body.get("model")
        if model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", code="model_not_found")
        for name in ("temperature", "top_p", "top_k", "seed"):
            _sampling_echo(name, body.get(name), self.sampling_settings.get(name))
        if body.get("n", 1) != 1:
            raise ApiError(400, f"n={body['n']}: one choice per request", "n")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise ApiError(400, f"stream must be true or false, got {body['stream']!r}", "stream")
        return body

    def max_tokens(self, body: dict, prompt_tokens: int) -> int:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        room = self.live.room(prompt_tokens)
        if room == 0:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens: with the server's max_new_tokens="
                                f"{self.live.max_new_tokens} it does not fit the cache of {self.live.capacity} slots",
                           "messages" if "messages" in body else "prompt", code="context_length_exceeded")
        value = body.get(name)
        if value is None:
            return room
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= room:
            raise ApiError(400, f"{name}={value!r}: must be an integer from 1 to {room}", name)
        return value

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            ids = prompt
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            ids = self.tokenizer.encode(prompt[0])
        elif isinstance(prompt, str) and prompt:
            ids = self.tokenizer.encode(prompt)
        else:
            raise ApiError(400, "prompt must be a non-empty string (or one string, or a list of token ids)", "prompt")
        vocab = self.live.engine.target.config.vocab_size
        bad = [x for x in ids if not 0 <= x < vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        return list(ids)

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or \
                    not isinstance(m.get("content"), str):
                raise ApiError(400, f"messages[{i}] must be {{'role': 'system' | 'user' | 'assistant', 'content': "
                                    f"<string>}}, got {m!r}"[:300], f"messages[{i}]")
            clean.append({"role": m["role"], "content": m["content"]})
        return list(self.tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True))

    def text(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ responses

    def usage(self, done: dict) -> dict:
        return {k: v for k, v in done["usage"].items() if v is not None}

    def full(self, chat: bool, rid: str, tokens: list[int], done: dict) -> dict:
        text = self.text(tokens)
        choice = {"index": 0, "finish_reason": done["finish_reason"], "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": self.usage(done)}

    def chunk(self, chat: bool, rid: str, text: str | None, finish_reason: str | None, usage: dict | None,
              first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
               "model": self.model_name, "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    def metrics_text(self) -> str:
        s = self.live.snapshot()
        up = max(s["uptime_s"], 1e-9)
        lines = [
            "# HELP specjax_requests_total Requests accepted into the queue.", "# TYPE specjax_requests_total counter",
            f"specjax_requests_total {s['requests_total']}",
            "# TYPE specjax_requests_finished_total counter", f"specjax_requests_finished_total {s['finished_total']}",
            "# TYPE specjax_requests_cancelled_total counter", f"specjax_requests_cancelled_total {s['cancelled_total']}",
            "# HELP specjax_tokens_total Tokens committed to requests.", "# TYPE specjax_tokens_total counter",
            f"specjax_tokens_total {s['tokens_total']}",
            "# HELP specjax_tokens_per_second Committed tokens per second since start.",
            "# TYPE specjax_tokens_per_second gauge", f"specjax_tokens_per_second {s['tokens_total'] / up:.6g}",
            "# TYPE specjax_queue_depth gauge", f"specjax_queue_depth {s['queue_depth']}",
            "# TYPE specjax_active_slots gauge", f"specjax_active_slots {s['active_slots']}",
            "# TYPE specjax_slots gauge", f"specjax_slots {s['slots']}",
            "# TYPE specjax_engine_rounds_total counter", f"specjax_engine_rounds_total {s['rounds_total']}",
            "# HELP specjax_drafts_proposed_total Drafted tokens of finished requests.",
            "# TYPE specjax_drafts_proposed_total counter", f"specjax_drafts_proposed_total {s['proposed_total']}",
            "# TYPE specjax_drafts_accepted_total counter", f"specjax_drafts_accepted_total {s['accepted_total']}",
            "# HELP specjax_acceptance_at_position Accepted / verified drafts at each draft position (finished requests).",
            "# TYPE specjax_acceptance_at_position gauge"]
        for j, (a, t) in enumerate(zip(s["accepted_at"], s["tested_at"])):
            lines.append(f'specjax_acceptance_at_position{{position="{j + 1}"}} {a / t if t else float("nan"):.6g}')
        lines += ["# HELP specjax_rounds_per_gamma Engine rounds run with each configured draft length.",
                  "# TYPE specjax_rounds_per_gamma counter"]
        for g, n in zip(self.live.engine.config.gammas, s["gamma_rounds"]):
            lines.append(f'specjax_rounds_per_gamma{{gamma="{g}"}} {n}')
        return "\n".join(lines) + "\n"


def make_app(live: LiveScheduler, tokenizer, model_name: str, sampling_settings: dict):
    """The Starlette application (routes in the module docstring)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    api = Api(live, tokenizer, model_name, sampling_settings)

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def generate(request: Request, chat: bool):
        try:
            body = api.parse(await request.body(), CHAT_FIELDS if chat else COMPLETION_FIELDS)
            ids = api.chat_prompt(body) if chat else api.completion_prompt(body)
            max_tokens = api.max_tokens(body, len(ids))
        except ApiError as e:
            return error(e)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            ticket = live.submit(ids, max_tokens, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        except QueueFull as e:
            return error(ApiError(429, f"the server is busy: {e}; retry later", kind="rate_limit_error"))
        except Stopped as e:
            return error(ApiError(503, str(e), kind="server_error"))
        except ValueError as e:
            return error(ApiError(400, str(e), "max_tokens"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]

        if not body.get("stream"):
            tokens = []
            waiter = asyncio.ensure_future(events.get())
            try:
                while True:
                    done_, _ = await asyncio.wait({waiter}, timeout=0.25)
                    if not done_:
                        if await request.is_disconnected():
                            live.cancel(ticket)
                        continue
                    ev = waiter.result()
                    if ev["type"] == "tokens":
                        tokens.extend(ev["ids"])
                        waiter = asyncio.ensure_future(events.get())
                        continue
                    if ev["finish_reason"] == "error":
                        return error(ApiError(500, f"the engine failed: {ev['status']}", kind="server_error"))
                    return JSONResponse(api.full(chat, rid, tokens, ev))
            finally:
                if not waiter.done():
                    waiter.cancel()
                live.cancel(ticket)        # no-op once it finished

        async def stream():
            decoder = tokenizer.incremental_decoder(skip_special_tokens=True)
            try:
                if chat:
                    yield api.chunk(chat, rid, "", None, None, first=True)
                while True:
                    ev = await events.get()
                    if ev["type"] == "tokens":
                        piece = decoder.add(ev["ids"])
                        if piece:
                            yield api.chunk(chat, rid, piece, None, None)
                        continue
                    tail = decoder.finish()
                    if tail:
                        yield api.chunk(chat, rid, tail, None, None)
                    yield api.chunk(chat, rid, None, ev["finish_reason"], api.usage(ev))
                    yield "data: [DONE]\n\n"
                    return
            finally:
                live.cancel(ticket)        # a client gone mid-stream: its slot is freed next round

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": api.created,
                                                         "owned_by": "specjax"}]})

    async def health(request):
        s = live.snapshot()
        ok = s["running"] and s["error"] is None
        return JSONResponse({"status": "ok" if ok else "down", "error": s["error"], "queue_depth": s["queue_depth"],
                             "active_slots": s["active_slots"]}, status_code=200 if ok else 503)

    async def metrics(request):
        return PlainTextResponse(api.metrics_text(), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/health", health, methods=["GET"]),
                             Route("/metrics", metrics, methods=["GET"])])
