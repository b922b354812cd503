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

Sampling per request: ``temperature``, ``top_p``, ``top_k`` and ``min_p`` (extensions of the
OpenAI API), ``logit_bias`` (token id -> value in [-100, 100], at most 64), ``presence_penalty``
and ``frequency_penalty`` (in [-2, 2], generated tokens), ``repetition_penalty`` (an extension,
in [0.01, 100], prompt and generated tokens; `specjax.sampling`, "Penalties") and ``seed`` apply to
that request alone (`LiveScheduler`: one batch, each row its own
settings; omitted: the server's ``--config.temperature`` etc.); a value the sampler refuses is a
400 naming the field. ``stop``: a string or up to `MAX_STOPS` strings of at most
`MAX_STOP_CHARS` characters; the text ends before the first one found (finish reason "stop"),
and a stream holds back the last characters that could begin one until they cannot.

Structured output: ``response_format`` ``{"type": "json_schema", "json_schema": {"schema": {...}}}``
(the OpenAI API's) or ``regex`` (a pattern, an extension) makes the answer follow it, exactly
under speculation (`specjax.constraints`: compiled once per distinct text, in a worker thread);
``{"type": "text"}`` is no constraint; ``json_object`` (any JSON) is refused, as it is not a
regular language: give a schema. A schema or pattern that cannot be compiled is a 400 naming
``response_format`` or ``regex``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import uuid

from specjax import constraints
from specjax import sampling as sampling_lib
from specjax.serving._live import MAX_SEED, LiveScheduler, QueueFull, Stopped

# The request fields each route reads; any other field is refused by name (a 400), so a client
# never believes a setting took effect that did not.
_COMMON = {"model", "max_tokens", "max_completion_tokens", "stream", "stream_options", "temperature", "top_p",
           "top_k", "min_p", "logit_bias", "n", "user", "seed", "stop", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "response_format", "regex"}
MAX_CONSTRAINT_CHARS = 65_536     # the text of a schema or a pattern
MAX_STOPS = 4               # stop sequences per request (as the OpenAI API)
MAX_STOP_CHARS = 256        # characters per stop sequence
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _number(body: dict, name: str, kind: type):
    """A request's numeric field (absent or null: None), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return None
    try:                # JSON brings NaN, Infinity and integers of any size
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
        ok = ok and (kind is not int or float(value) == int(value))
    except (OverflowError, ValueError):
        ok = False
    if not ok:
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {str(value)[:40]}", name)
    return kind(value)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of them, got {stop!r}"[:300], "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: {len(stops)} sequences, at most {MAX_STOPS}", "stop")
    long = [x for x in stops if len(x) > MAX_STOP_CHARS]
    if long:
        raise ApiError(400, f"stop: a sequence of {len(long[0])} characters, at most {MAX_STOP_CHARS}", "stop")
    return tuple(stops)


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
    """(the text before the first stop sequence found, whether one was found)."""
    at = [i for i in (text.find(x) for x in stops) if i >= 0]
    return (text[:min(at)], True) if at else (text, False)


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
        if body.get("n", 1) != 1:
            raise ApiError(400, f"n={body['n']}: one choice per request", "n")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise ApiError(400, f"stream must be true or false, got {body['stream']!r}", "stream")
        return body

    def sampling(self, body: dict) -> dict:
        """The request's own sampling: ``settings`` (temperature, top_k, top_p, min_p, logit bias,
        repetition, presence and frequency penalties; the server's where absent, none for the
        rest), ``seed`` and ``stop`` (strings); a 400 naming the bad field."""
        values = {name: _number(body, name, kind) for name, kind in
                  (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float), ("seed", int),
                   ("repetition_penalty", float), ("presence_penalty", float), ("frequency_penalty", float))}
        default = dict(self.sampling_settings, min_p=0.0)
        settings = tuple(default[n] if values[n] is None else values[n]
                         for n in ("temperature", "top_k", "top_p", "min_p"))
        try:
            sampling_lib.check_settings(*settings)
        except ValueError as e:            # its message begins with the setting's name
            raise ApiError(400, str(e), str(e).split(" ")[0]) from None
        try:
            bias = sampling_lib.check_logit_bias(body.get("logit_bias"))
        except ValueError as e:
            raise ApiError(400, str(e), "logit_bias") from None
        vocab = self.live.engine.target.vocab_size
        outside = [i for i in bias if i >= vocab]
        if outside:
            raise ApiError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {vocab})",
                           "logit_bias")
        settings += (bias,)
        penalties = tuple(self.sampling_settings.get(n, off) if values[n] is None else values[n] for n, off in
                          (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)))
        try:
            settings += sampling_lib.check_penalties(*penalties)
        except ValueError as e:            # its message begins with the field's name
            raise ApiError(400, str(e), str(e).split(" ")[0]) from None
        seed = values["seed"]
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise ApiError(400, f"seed must be an integer from 0 to {MAX_SEED}, got {seed}", "seed")
        return {"settings": settings, "seed": seed, "stop": _stops(body)}

    def constraint_source(self, body: dict) -> tuple[str, str] | None:
        """("json_schema" | "regex", its text) the request asks its answer to follow, or None; a
        400 naming the field for a malformed one."""
        fmt, regex = body.get("response_format"), body.get("regex")
        if fmt is not None and regex is not None:
            raise ApiError(400, "give response_format or regex, not both", "regex")
        if regex is not None:
            if not isinstance(regex, str) or not regex or len(regex) > MAX_CONSTRAINT_CHARS:
                raise ApiError(400, f"regex must be a non-empty string of at most {MAX_CONSTRAINT_CHARS} characters",
                               "regex")
            return "regex", regex
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            raise ApiError(400, "response_format json_object (any JSON) is not supported: any JSON is not a regular "
                                "language; give a json_schema", "response_format")
        schema = fmt.get("json_schema", {}).get("schema") if kind == "json_schema" and \
            isinstance(fmt.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, 'response_format must be {"type": "text"} or {"type": "json_schema", "json_schema": '
                                '{"schema": {...}}}', "response_format")
        text = json.dumps(schema)          # the properties in the schema's order
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ApiError(400, f"response_format: the schema has more than {MAX_CONSTRAINT_CHARS} characters",
                           "response_format")
        return "json_schema", text

    def constraint(self, source: tuple[str, str] | None):
        """The compiled automaton of a `constraint_source` (cached per text), or None; a 400 naming
        the field when it cannot be compiled. Slow for a new text (seconds): run it off the loop."""
        if source is None:
            return None
        try:
            return self._compile(*source)
        except constraints.ConstraintError as e:
            raise ApiError(400, f"{'regex' if source[0] == 'regex' else 'response_format'}: {e}",
                           "regex" if source[0] == "regex" else "response_format") from None

    @functools.lru_cache(maxsize=64)
    def _compile(self, kind: str, text: str):
        token_bytes, stops = self._vocabulary
        if kind == "regex":
            return constraints.compile_regex(text, token_bytes, stops, self.live.max_constraint_states)
        return constraints.compile_json_schema(text, token_bytes, stops, self.live.max_constraint_states)

    @functools.cached_property
    def _vocabulary(self):
        return self.tokenizer.token_bytes(), self.tokenizer.stop_token_ids

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

    def full(self, chat: bool, rid: str, tokens: list[int], done: dict, stops=()) -> dict:
        text = cut_at_stop(self.text(tokens), stops)[0]
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
            "# HELP specjax_batch_rows Rows the engine's rounds run at now (a batch size of the scheduler's buckets).",
            "# TYPE specjax_batch_rows gauge", f"specjax_batch_rows {s['batch_rows']}",
            "# TYPE specjax_batch_resizes_total counter", f"specjax_batch_resizes_total {s['resizes_total']}",
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


class _StopText:
    """A stream's text with stop sequences: `add` gives the new text that can no longer be part
    of a stop sequence (the last ``longest - 1`` characters, and an unfinished character, wait),
    `finish` what is left before the first stop sequence."""

    def __init__(self, api: Api, stops):
        self.api, self.stops, self.hold = api, stops, max(len(x) for x in stops) - 1
        self.ids, self.sent = [], 0

    def add(self, ids) -> str:
        self.ids.extend(ids)
        text, found = cut_at_stop(self.api.text(self.ids), self.stops)
        end = len(text) if found else max(self.sent, len(text) - self.hold)
        while end > self.sent and text[end - 1] == "\ufffd":       # an unfinished UTF-8 character
            end -= 1
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece

    def finish(self) -> str:
        text = cut_at_stop(self.api.text(self.ids), self.stops)[0]
        return text[self.sent:]


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
            samp = api.sampling(body)
            automaton = await asyncio.to_thread(api.constraint, api.constraint_source(body))
        except ApiError as e:
            return error(e)
        stops = samp["stop"]
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            ticket = live.submit(ids, max_tokens, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                                 settings=samp["settings"], seed=samp["seed"], constraint=automaton,
                                 stop=(lambda toks: cut_at_stop(api.text(toks), stops)[1]) if stops else None)
        except QueueFull as e:
            return error(ApiError(429, f"the server is busy: {e}; retry later", kind="rate_limit_error"))
        except Stopped as e:
            return error(ApiError(503, str(e), kind="server_error"))
        except ValueError as e:
            return error(ApiError(400, str(e), "response_format" if str(e).startswith("constraint") else "max_tokens"))
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
                    return JSONResponse(api.full(chat, rid, tokens, ev, stops))
            finally:
                if not waiter.done():
                    waiter.cancel()
                live.cancel(ticket)        # no-op once it finished

        async def stream():
            decoder = tokenizer.incremental_decoder(skip_special_tokens=True) if not stops else _StopText(api, stops)
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
