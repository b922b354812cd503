"""`specjax serve` (issue 56, part 1): the OpenAI-compatible server on the real SmolLM2, called
with the `openai` client over 127.0.0.1.

One server for the module (configs/serve.py: the default hybrid drafter, greedy; 2 slots,
max_new_tokens 24), run by uvicorn in a thread. Greedy answers equal `specjax generate`'s path
for the same chat prompt (`generate.stream_tokens` on the same engine and cache capacity),
streamed and not; concurrent requests each get their own answer; sampled requests with their
own settings and seeds run beside greedy ones (issue 56, part 2), and so do penalized ones (part
3); stop sequences end the text
before them; a client that disconnects mid-stream frees its slot; bad requests get one JSON
error each (the field named) and the server goes on serving; a full queue answers 429.
"""
import concurrent.futures
import json
import time

import httpx
import jax
import openai
import pytest

from configs import serve as serve_config
from specjax import build, config_files, decoding, generate, serve, serving

pytestmark = pytest.mark.real_model

MAX_NEW = 24
PROMPTS = ["Name three primary colors.", "What is 7 times 8?", "Write a haiku about rain.",
           "Give one synonym for 'happy'."]


@pytest.fixture(scope="module")
def server():
    c = config_files.with_drafter_keys(serve_config.get_config())
    # buckets "": every round at 2 rows (one set of programs to compile; the batch sizes are
    # tested on a tiny model in tests/test_serving_live.py and tests/test_buckets.py); scanned
    # layers: XLA compiles one layer instead of 30 (the unrolled layers and the CPU kernel of the
    # default profile: tests/test_kernels.py and tests/test_cli.py on the same model)
    c.update(port=0, slots=2, max_queue=8, max_prompt_tokens=256, max_new_tokens=MAX_NEW,
             compilation_cache_dir="", buckets="", scan_layers=True)
    job = serve.serve_job(c)
    live, app, name = serve.build_server(job)
    url, stop = serve.start_in_thread(app)
    gen = build.load_generator(job.run)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    yield {"live": live, "name": name, "client": client, "gen": gen, "job": job, "url": url}
    stop()
    live.stop(5)


def _reference(server, prompt: str, sampling=None) -> tuple[list[int], str]:
    """`specjax generate`'s tokens for this chat prompt (its own streaming path), on the server's
    engine and cache capacity, decoded as the server decodes them (``sampling``: the run's)."""
    gen, live = server["gen"], server["live"]
    ids = gen.encode(prompt)
    batch = decoding.make_batch([ids], gen.config, jax.random.key(0), pad_multiple=gen.pad_multiple,
                                capacity=live.capacity)
    tokens, _, _ = generate.stream_tokens(gen, batch, sampling or build.sampling_config(server["job"].run))
    return tokens, gen.tokenizer.decode(tokens, skip_special_tokens=True)


def _chat(server, prompt, **kw):
    return server["client"].chat.completions.create(model=server["name"], messages=[{"role": "user", "content": prompt}],
                                                    **kw)


def test_greedy_chat_equals_generate_streamed_and_not(server):
    tokens, text = _reference(server, PROMPTS[0])
    r = _chat(server, PROMPTS[0])
    assert r.choices[0].message.content == text and text
    u = r.usage.model_dump()
    assert u["completion_tokens"] == len(tokens) and u["prompt_tokens"] == len(server["gen"].encode(PROMPTS[0]))
    assert u["target_passes"] >= 1 and u["accepted_tokens_per_pass"] == pytest.approx(len(tokens) / u["target_passes"],
                                                                                     abs=1e-3)
    assert r.choices[0].finish_reason in ("stop", "length")
    pieces, finish, usage = [], None, None
    for chunk in _chat(server, PROMPTS[0], stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(pieces) == text and finish == r.choices[0].finish_reason
    assert usage.completion_tokens == len(tokens)


def test_concurrent_requests_get_their_own_answers(server):
    want = {p: _reference(server, p)[1] for p in PROMPTS}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = dict(zip(PROMPTS, pool.map(lambda p: _chat(server, p).choices[0].message.content, PROMPTS)))
    assert got == want
    # the plain completions route: the text as it is (no chat template), up to max_tokens
    r = server["client"].completions.create(model=server["name"], prompt="The capital of France is", max_tokens=5)
    assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert [m.id for m in server["client"].models.list().data] == [server["name"]]


def test_a_disconnected_stream_frees_its_slot(server):
    live = server["live"]
    before = live.snapshot()["cancelled_total"]
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", timeout=60,
                      json={"model": server["name"], "stream": True,
                            "messages": [{"role": "user", "content": "Count from one to one hundred in words."}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"content": ""' not in line:
                break                                   # the first text: then the client goes away
    for _ in range(200):
        s = live.snapshot()
        if s["cancelled_total"] > before and s["active_slots"] == 0:
            break
        time.sleep(0.05)
    assert s["cancelled_total"] == before + 1 and s["active_slots"] == 0, s
    assert _chat(server, PROMPTS[1]).choices[0].message.content == _reference(server, PROMPTS[1])[1]


def test_per_request_sampling_in_one_batch(server):
    """Sampled requests (their own temperature, top-p, top-k, seed) beside greedy ones: the greedy
    answers stay `specjax generate`'s; a seeded request gives the same text alone and beside
    another request, another seed (almost surely) another text."""
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234, extra_body={"top_k": 40})
    alone = _chat(server, PROMPTS[2], **sampled).choices[0].message.content
    want = {p: _reference(server, p)[1] for p in PROMPTS[:2]}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        beside = pool.submit(lambda: _chat(server, PROMPTS[2], **sampled).choices[0].message.content)
        greedy = list(pool.map(lambda p: _chat(server, p).choices[0].message.content, PROMPTS[:2]))
    assert beside.result() == alone and alone
    assert dict(zip(PROMPTS[:2], greedy)) == want
    others = {_chat(server, PROMPTS[2], **{**sampled, "seed": s}).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {alone}) > 1


def test_logit_bias_and_min_p_apply_to_their_request(server):
    """A +100 bias on one token makes a greedy answer that token, max_tokens times; -100 on the
    greedy answer's first token bans it; min-p at 1 keeps only the most probable token, so a
    sampled answer is the greedy one; a greedy request beside them stays the reference."""
    tokens, text = _reference(server, PROMPTS[1])
    tok = server["gen"].tokenizer
    the = tok.encode(" the")[-1]
    forced = _chat(server, PROMPTS[0], max_tokens=6, logit_bias={str(the): 100})
    assert forced.choices[0].message.content == tok.decode([the] * 6, skip_special_tokens=True)
    banned = _chat(server, PROMPTS[1], logit_bias={str(tokens[0]): -100}).choices[0].message.content
    assert banned and not banned.startswith(tok.decode(tokens[:1], skip_special_tokens=True))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        top = pool.submit(lambda: _chat(server, PROMPTS[1], temperature=1.0, seed=5, extra_body={"min_p": 1.0}))
        plain = pool.submit(lambda: _chat(server, PROMPTS[1]))
    assert top.result().choices[0].message.content == text and plain.result().choices[0].message.content == text


def test_penalties_apply_to_their_request(server):
    """Greedy requests with penalties, beside a plain greedy one: each answer is `specjax
    generate`'s for its own settings (the penalized reference decodes with the same penalties
    through `SamplingConfig.make`), and the penalties change the text."""
    from specjax import sampling
    kw = dict(frequency_penalty=0.8, presence_penalty=0.4)
    want = _reference(server, PROMPTS[2], sampling.SamplingConfig.make(0.0, repetition_penalty=1.3, **kw))[1]
    plain = _reference(server, PROMPTS[2])[1]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = pool.submit(lambda: _chat(server, PROMPTS[2], extra_body={"repetition_penalty": 1.3}, **kw))
        other = pool.submit(lambda: _chat(server, PROMPTS[2]))
    assert got.result().choices[0].message.content == want and want != plain
    assert other.result().choices[0].message.content == plain


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_structured_output_with_speculation(server):
    """A JSON-schema request (greedy, and sampled beside it) and a regex request, with the
    server's default speculation on: the answers parse as JSON with the schema's fields and
    types, or match the pattern; a schema or pattern the compiler refuses and json_object get
    a 400 naming the field."""
    import re
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    prompt = "Describe a fictional person as JSON with a name and an age."
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        greedy = pool.submit(lambda: _chat(server, prompt, response_format=fmt, max_tokens=MAX_NEW))
        sampled = pool.submit(lambda: _chat(server, prompt, response_format=fmt, temperature=1.0, seed=3,
                                            max_tokens=MAX_NEW))
    for r in (greedy.result(), sampled.result()):
        text = r.choices[0].message.content
        assert r.usage.target_passes < r.usage.completion_tokens       # speculation committed > 1 token a pass
        assert r.choices[0].finish_reason == "stop", (text, r.usage)
        obj = json.loads(text)
        assert list(obj) == ["name", "age"] and isinstance(obj["name"], str) and len(obj["name"]) <= 12, text
        assert isinstance(obj["age"], int), text
    r = _chat(server, "What is 7 times 8? Answer with digits.", extra_body={"regex": "[0-9]{1,3}( is the answer)?"})
    assert re.fullmatch("[0-9]{1,3}( is the answer)?", r.choices[0].message.content), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    for body, param in (({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
                         "response_format"),
                        ({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"regex": "(unclosed"}, "regex")):
        r = httpx.post(server["url"] + "/v1/chat/completions", timeout=60,
                       json={"model": server["name"], "messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_stop_sequences_end_the_text_before_them(server):
    tokens, text = _reference(server, PROMPTS[0])
    words = text.split()
    stop = " " + words[len(words) // 2]          # a word from the middle of the greedy answer
    cut = text[:text.find(stop)]
    r = _chat(server, PROMPTS[0], stop=[stop, "@@never@@"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < len(tokens)
    pieces, finish = [], None
    for chunk in _chat(server, PROMPTS[0], stop=stop, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == cut and finish == "stop"


@pytest.mark.parametrize("body,status,param", [
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"temperature": -0.5, "messages": [{"role": "user", "content": "hi"}]}, 400, "temperature"),
    ({"top_p": 0, "messages": [{"role": "user", "content": "hi"}]}, 400, "top_p"),
    ({"top_k": 2.5, "messages": [{"role": "user", "content": "hi"}]}, 400, "top_k"),
    ({"seed": -1, "messages": [{"role": "user", "content": "hi"}]}, 400, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"], "messages": [{"role": "user", "content": "hi"}]}, 400, "stop"),
    ({"stop": ["x" * 300], "messages": [{"role": "user", "content": "hi"}]}, 400, "stop"),
    ({"stop": 7, "messages": [{"role": "user", "content": "hi"}]}, 400, "stop"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ({"max_tokens": MAX_NEW + 1, "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ({"logprobs": True, "messages": [{"role": "user", "content": "hi"}]}, 400, "logprobs"),
    ({"repetition_penalty": -1.2, "messages": [{"role": "user", "content": "hi"}]}, 400, "repetition_penalty"),
    ({"presence_penalty": 2.5, "messages": [{"role": "user", "content": "hi"}]}, 400, "presence_penalty"),
    ({"frequency_penalty": "high", "messages": [{"role": "user", "content": "hi"}]}, 400, "frequency_penalty"),
    ({"logit_bias": {"99999999": 1}, "messages": [{"role": "user", "content": "hi"}]}, 400, "logit_bias"),
    ({"logit_bias": {"5": 300}, "messages": [{"role": "user", "content": "hi"}]}, 400, "logit_bias"),
    ({"min_p": 1.5, "messages": [{"role": "user", "content": "hi"}]}, 400, "min_p"),
    ({"seed": 10 ** 400, "messages": [{"role": "user", "content": "hi"}]}, 400, "seed"),
    ({"logit_bias": {"1": 100, " 1": 100}, "messages": [{"role": "user", "content": "hi"}]}, 400, "logit_bias"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
], ids=["unknown_model", "negative_temperature", "top_p_zero", "top_k_not_integer", "negative_seed",
        "five_stops", "stop_too_long", "stop_not_text", "zero_tokens", "too_many_tokens", "unsupported_field",
        "negative_repetition_penalty", "presence_penalty_above_two", "frequency_penalty_not_number", "bias_outside_vocab",
        "bias_too_large", "min_p_above_one", "huge_seed", "bias_twice",
        "no_messages", "bad_role", "prompt_too_long"])
def test_bad_requests_get_one_json_error_each(server, body, status, param):
    body = {"model": server["name"], **body}
    r = httpx.post(server["url"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert httpx.get(server["url"] + "/health").status_code == 200      # still serving


def test_malformed_bodies_health_and_metrics(server):
    r = httpx.post(server["url"] + "/v1/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(server["url"] + "/v1/completions", json={"model": server["name"], "prompt": [10 ** 9]}, timeout=60)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"
    text = httpx.get(server["url"] + "/metrics").text
    for name in ("specjax_tokens_total", "specjax_queue_depth", "specjax_active_slots",
                 'specjax_acceptance_at_position{position="1"}', "specjax_rounds_per_gamma", "specjax_batch_rows 2",
                 "specjax_batch_resizes_total 0"):
        assert name in text, name
    tokens = [line for line in text.splitlines() if line.startswith("specjax_tokens_total")]
    assert float(tokens[0].split()[1]) > 0


def test_a_full_queue_answers_429(server):
    """A second scheduler on the same engine, not started (nothing leaves its queue): with
    max_queue=1 one request fills it, the next gets 429 through the API."""
    from starlette.testclient import TestClient
    live = server["live"]
    idle = serving.LiveScheduler(live.engine, live.params, live.sampling, slots=1, capacity=live.capacity,
                                 key=jax.random.key(0), max_queue=1)
    idle.submit([1, 2, 3], 4, lambda ev: None)
    with pytest.raises(serving.QueueFull):
        idle.submit([1, 2, 3], 4, lambda ev: None)
    app = serving.make_app(idle, server["gen"].tokenizer, "m", {"temperature": 0.0, "top_p": 1.0, "top_k": 0})
    r = TestClient(app).post("/v1/chat/completions",
                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
    assert json.loads(r.text)["error"]["message"].startswith("the server is busy")


def test_serve_config_errors_name_the_key():
    """Bad server settings are refused by key before anything loads."""
    c = config_files.with_drafter_keys(serve_config.get_config())
    assert serve._buckets(serve.serve_job(c)) == "powers"
    for key, value, match in (("buckets", "1,x", "config.buckets: 'powers'"), ("buckets", "3,1", "config.buckets: .*sorted"),
                              ("port", 70000, "config.port"), ("slots", 0, "config.slots")):
        bad = config_files.with_drafter_keys(serve_config.get_config())
        bad[key] = value
        with pytest.raises(ValueError, match=match):
            serve.serve_job(bad)
