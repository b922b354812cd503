"""A soak of `specjax serve` on 127.0.0.1: no request lost or answered twice, then a SIGTERM drain.

    python -m experiments.serve_soak.run --config=experiments/serve_soak/config.py          # ~15 min
    python -m experiments.serve_soak.run --config=experiments/serve_soak/config.py:short    # ~3 min

The server runs as its own process (`specjax serve`, configs/serve.py with the soak's slots and
lengths). ``clients`` threads each draw actions (config.MIX, a seeded draw per client) until
``duration_s`` has passed:

* greedy: a chat completion at temperature 0; the same prompt must get the same text every
  time in the soak (a row that received another row's tokens would break it);
* sampled_stream: a streamed answer with its own temperature, top-p and seed: exactly one
  finish chunk and one ``[DONE]``, the text of the chunks equal to the same request's text
  asked again without streaming (same seed: the same tokens);
* cancel: a stream dropped after its first text (the server must free the slot);
* stop: a greedy answer with a stop sequence taken from that prompt's greedy text: the text
  must be that text cut before it;
* penalized: a greedy answer with frequency, presence and repetition penalties: the same text
  every time that prompt is asked so;
* schema: an answer under a JSON schema (structured output), greedy or sampled: it must end
  with finish reason "stop" and parse as the schema's object;
* bad: one of several malformed requests: a 4xx JSON error naming the field.

Every request gets exactly one outcome; the server's own counters (`/metrics`) at the end must
account for every request it accepted (finished = accepted, nothing in the queue or a slot).
Then ``drain_requests`` long answers are started, SIGTERM is sent once they stream, and each
must still end with its finish chunk while new requests are refused; then the process ends
(uvicorn re-raises the SIGTERM it held once its graceful shutdown is over, so the exit status is
-15, killed by that signal, after the drain).

Records (``config.out``): one ``action`` record per action kind (counts, failures), ``server``
(its counters), ``drain`` and ``summary``; results/README.md has the command and the table.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

from experiments.lib import toolkit

BAD = [  # (body changes, the field the error must name)
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"seed": -3}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"1": 300}}, "logit_bias"),
    ({"frequency_penalty": 5}, "frequency_penalty"),          # outside [-2, 2]
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),          # a token id outside the vocabulary
    ({"response_format": {"type": "json_object"}}, "response_format"),     # not a regular language: give a schema
    ({"regex": "(unclosed"}, "regex"),
    ({"model": "no-such-model"}, "model"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _log(msg: str) -> None:
    print(f"[serve_soak] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(c) -> list[str]:
    from specjax import specbench
    qs = specbench.load(split="held_out")
    return [q.turns[0][:300] for q in qs[:c.prompts]]


class Soak:
    def __init__(self, c, url: str, model: str, prompts: list[str]):
        import httpx
        self.c, self.url, self.model, self.prompts = c, url, model, prompts
        self.client = httpx.Client(timeout=600)
        self.lock = threading.Lock()
        self.counts = collections.Counter()
        self.failures = collections.defaultdict(list)
        self.greedy = {}                   # (prompt index, penalties) -> the text it got first
        self.ids = set()
        self.duplicate_ids = 0

    def body(self, i: int, **kw) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": self.prompts[i]}],
                "max_tokens": self.c.max_new_tokens, **kw}

    def fail(self, action: str, why: str) -> None:
        with self.lock:
            self.failures[action].append(why[:300])

    def seen(self, rid: str) -> None:
        with self.lock:
            self.duplicate_ids += rid in self.ids
            self.ids.add(rid)

    def post(self, body: dict) -> dict:
        r = self.client.post(self.url + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        out = r.json()
        self.seen(out["id"])
        return out

    def stream(self, body: dict, drop_after_first: bool = False) -> tuple[str, list[str], int]:
        """(text, finish reasons seen, [DONE] count) of a streamed answer."""
        text, finishes, done = [], [], 0
        with self.client.stream("POST", self.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}")
            rid = None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done += 1
                    continue
                chunk = json.loads(data)
                if rid is None:
                    rid = chunk["id"]
                    self.seen(rid)
                for ch in chunk["choices"]:
                    piece = ch["delta"].get("content") or ""
                    text.append(piece)
                    if ch.get("finish_reason"):
                        finishes.append(ch["finish_reason"])
                    if drop_after_first and piece:
                        return "".join(text), finishes, done
        return "".join(text), finishes, done

    def greedy_text(self, i: int, **kw) -> str:
        """Prompt ``i``'s greedy text (with penalties ``kw``, if any): the same every time it is asked."""
        text = self.post(self.body(i, temperature=0, **kw))["choices"][0]["message"]["content"]
        with self.lock:
            first = self.greedy.setdefault((i, tuple(sorted(kw.items()))), text)
        if first != text:
            raise RuntimeError(f"prompt {i} {kw}: greedy text changed between requests")
        return text

    def act(self, action: str, rng: random.Random) -> None:
        i = rng.randrange(len(self.prompts))
        if action == "greedy":
            self.greedy_text(i)
        elif action == "sampled_stream":
            kw = dict(temperature=rng.choice([0.6, 0.9, 1.2]), top_p=rng.choice([0.8, 0.95, 1.0]),
                      seed=rng.randrange(2 ** 31))
            text, finishes, done = self.stream(self.body(i, **kw))
            if len(finishes) != 1 or done != 1:
                raise RuntimeError(f"{len(finishes)} finish chunks and {done} [DONE]")
            again = self.post(self.body(i, **kw))["choices"][0]["message"]["content"]
            if again != text:
                raise RuntimeError("the same seed gave another text without streaming")
        elif action == "cancel":
            self.stream(self.body(i, temperature=0.8, seed=rng.randrange(2 ** 31)), drop_after_first=True)
        elif action == "stop":
            text = self.greedy_text(i)
            words = text.split()
            if len(words) < 4:
                return
            stop = " " + words[len(words) // 2]
            if stop not in text:            # the word follows a newline, not a space
                return
            got = self.post(self.body(i, temperature=0, stop=[stop]))["choices"][0]
            if got["message"]["content"] != text[:text.find(stop)] or got["finish_reason"] != "stop":
                raise RuntimeError(f"stop {stop!r}: got {got['message']['content'][-40:]!r}")
        elif action == "penalized":
            self.greedy_text(i, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
        elif action == "schema":
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
            got = self.post({**self.body(i, temperature=rng.choice([0, 0.8]), seed=rng.randrange(2 ** 31),
                                         response_format=fmt),
                             "messages": [{"role": "user", "content": "Describe a fictional person as JSON with a name "
                                                                       "and an age. " + self.prompts[i][:80]}]})
            text = got["choices"][0]["message"]["content"]
            obj = json.loads(text) if got["choices"][0]["finish_reason"] == "stop" else None
            if not (isinstance(obj, dict) and list(obj) == ["name", "age"] and isinstance(obj["name"], str)
                    and len(obj["name"]) <= 12 and isinstance(obj["age"], int) and not isinstance(obj["age"], bool)):
                raise RuntimeError(f"not the schema's JSON ({got['choices'][0]['finish_reason']}): {text[:120]!r}")
        elif action == "bad":
            change, param = rng.choice(BAD)
            r = self.client.post(self.url + "/v1/chat/completions", json={**self.body(i), **change})
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            if not 400 <= r.status_code < 500 or err.get("param") != param:
                raise RuntimeError(f"{change}: HTTP {r.status_code} param {err.get('param')!r}")
        else:
            raise ValueError(action)

    def client_loop(self, k: int, deadline: float) -> None:
        rng = random.Random(self.c.seed * 1000 + k)
        actions, weights = zip(*self.c.mix)
        while time.monotonic() < deadline:
            action = rng.choices(actions, weights)[0]
            try:
                self.act(action, rng)
                with self.lock:
                    self.counts[action] += 1
            except Exception as e:  # noqa: BLE001 - every failure is recorded, the soak goes on
                self.fail(action, f"{type(e).__name__}: {e}")
            if self.c.think_s > 0:           # a pause (exponential, seeded): the load rises and falls
                time.sleep(max(0.0, min(rng.expovariate(1.0 / self.c.think_s), deadline - time.monotonic())))


def _metrics(url: str) -> dict:
    import httpx
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("specjax_") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def _drain(c, soak: Soak, proc) -> dict:
    """Start long answers, SIGTERM once all stream, and see each end with its finish chunk."""
    results, started = [None] * c.drain_requests, threading.Barrier(c.drain_requests + 1, timeout=600)

    def one(k):
        body = soak.body(k % len(soak.prompts), temperature=0.8, seed=k, max_tokens=c.max_new_tokens)
        text, finishes, done, first = [], [], 0, False
        try:
            with soak.client.stream("POST", soak.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line[6:] == "[DONE]":
                        done += 1
                        continue
                    for ch in json.loads(line[6:])["choices"]:
                        text.append(ch["delta"].get("content") or "")
                        finishes += [ch["finish_reason"]] if ch.get("finish_reason") else []
                        if not first and text[-1]:
                            first = True
                            started.wait()
            results[k] = {"finishes": finishes, "done": done, "chars": len("".join(text))}
        except Exception as e:  # noqa: BLE001
            results[k] = {"error": f"{type(e).__name__}: {e}"}
            if not first:
                started.abort()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(c.drain_requests)]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    import httpx
    try:
        r = httpx.post(soak.url + "/v1/chat/completions", json=soak.body(0), timeout=30)
        refused = f"HTTP {r.status_code}"
    except httpx.HTTPError as e:
        refused = f"refused ({type(e).__name__})"
    for t in threads:
        t.join(c.drain_s + 120)
    code = proc.wait(c.drain_s + 120)
    complete = sum(r is not None and r.get("done") == 1 and len(r.get("finishes", [])) == 1 for r in results)
    return {"in_flight": c.drain_requests, "completed": complete, "results": results, "new_request": refused,
            "exit_code": code, "exit_after_s": round(time.monotonic() - t0, 2)}


def main(c):
    prov = toolkit.provenance("experiments.serve_soak.run", with_backend=False)
    out = toolkit.Jsonl(c.out, prov)
    port = _free_port()
    cmd = [sys.executable, "-m", "specjax.cli", "serve", f"--config={c.serve_config}", f"--config.port={port}",
           f"--config.slots={c.slots}", f"--config.max_new_tokens={c.max_new_tokens}",
           f"--config.max_prompt_tokens={c.max_prompt_tokens}", f"--config.drain_s={c.drain_s}",
           f"--config.buckets={c.buckets}"]
    _log(" ".join(cmd))
    proc = subprocess.Popen(cmd, cwd=toolkit.REPO, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    import httpx
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before serving")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > c.startup_timeout_s:
            proc.kill()
            raise RuntimeError("the server did not start in time")
        time.sleep(1)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    _log(f"serving {model} after {time.monotonic() - t0:.0f} s; soaking {c.duration_s:.0f} s with {c.clients} clients")
    soak = Soak(c, url, model, _prompts(c))
    try:
        deadline = time.monotonic() + c.duration_s
        threads = [threading.Thread(target=soak.client_loop, args=(k, deadline)) for k in range(c.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in range(100):                       # dropped streams are freed at the next round
            m = _metrics(url)
            if m.get("specjax_active_slots") == 0 and m.get("specjax_queue_depth") == 0:
                break
            time.sleep(0.1)
        for action, _ in c.mix:
            out.write("action", action=action, ok=soak.counts[action], failed=len(soak.failures[action]),
                      failures=soak.failures[action][:20])
        out.write("server", **m)
        accepted = m["specjax_requests_total"]
        lost = accepted - m["specjax_requests_finished_total"]
        drain = _drain(c, soak, proc)
        out.write("drain", **drain)
        ok = sum(soak.counts.values())
        failed = sum(len(f) for f in soak.failures.values())
        summary = dict(duration_s=c.duration_s, clients=c.clients, slots=c.slots, actions_ok=ok, actions_failed=failed,
                       server_accepted=int(accepted), server_finished=int(m["specjax_requests_finished_total"]),
                       server_cancelled=int(m["specjax_requests_cancelled_total"]), lost=int(lost),
                       duplicate_response_ids=soak.duplicate_ids, greedy_prompts_repeated=len(soak.greedy),
                       batch_resizes=int(m.get("specjax_batch_resizes_total", 0)), buckets=c.buckets,
                       think_s=c.think_s,
                       drain_completed=drain["completed"], drain_in_flight=drain["in_flight"],
                       drain_exit_code=drain["exit_code"])
        out.write("summary", **summary)
        _log(json.dumps(summary))
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()


if __name__ == "__main__":
    toolkit.main_with_config(main, "experiments/serve_soak/config.py", "server soak settings")
