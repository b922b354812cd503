"""Load study: slot-refilling servers at 1, 4 and 16 slots, idle to saturation, with and
without speculation, offline and on the live scheduler.

    python -m experiments.load_study.run --config=experiments/load_study/config.py
    python -m experiments.load_study.run --config=experiments/load_study/config.py:tiny   # CI size

Per slot count (`config.slots`): held-out Spec-Bench requests (chat template, greedy by default).
First the target-only server with every request at t = 0 gives the saturated rate (requests /
makespan); the offered loads are fractions of it (`config.loads`), each with Poisson and bursty
(gamma-renewal) arrival times (seeded, the same for every mode), plus every request at once.
Every mode serves every workload through `specjax.serving.Scheduler` with batch buckets (rounds
at the smallest batch holding the busy rows); adaptive ("load-aware") modes calibrate their round
times at each batch size first and pick gamma per round from the active rows' acceptance and
those times. Compilation happens before the timed runs (`Scheduler.warmup`); time in which
nothing is queued or running is skipped (the virtual clock), so low loads cost no idle wall time.
Then, at `config.live_slots`, the live scheduler (`specjax.serving.LiveScheduler`, the engine
thread of `specjax serve`, on the real clock; requests submitted by a driver thread at their
arrival times) serves the Poisson workloads at `config.live_loads`, to compare with the offline
scheduler at the same load; with transport "http" (`config.live_transports`) the same scheduler
sits behind `specjax serve`'s application (uvicorn on 127.0.0.1) and every request is a streamed
``/v1/completions`` call from an asyncio client at its arrival time, so the HTTP layer, the
server's detokenization and the client's share of this machine's cores are in the figures.

Records (JSONL, one run per file): "setup"; "capacity" per slot count; "calibration" per
(slot count, adaptive mode); "load" per (slot count, mode, arrivals, load): the scheduler's
summary (throughput, TTFT, ITL, queue delay, rounds, tokens per pass, rounds per gamma and per
batch size), how many requests got exactly target-only's tokens, and per-request rows; "live"
likewise. Then `results.md` (`report`) and the plots (`plot`) from the JSONL alone.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import time

import jax
import numpy as np

from experiments.lib import toolkit
from experiments.load_study import config as config_lib
from experiments.load_study import plot, report


def _log(msg: str):
    print(f"[load_study {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _setup(c, num_requests: int):
    """(generation config, target, params, eos ids, ``num_requests`` prompts as token-id lists,
    tokenizer, extra provenance)."""
    from specjax import build, models, specbench
    gc = toolkit.load_config(c.generate_config)
    gc.update(max_new_tokens=int(c.max_new_tokens), temperature=float(c.temperature), calibration_cache="",
              adaptive_gammas=tuple(c.adaptive_gammas))
    rng = np.random.default_rng(c.seed)
    if c.target == "tiny":
        cfg = models.ModelConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                 head_dim=16, ffn_size=128, max_position=512, scan_layers=False, fuse_projections=True)
        model = models.Llama(cfg)
        params = model.prepare_params(model.init_params(jax.random.key(c.seed)))
        # Repetitive prompts so that prompt lookup finds matches.
        prompts = [list(np.tile(rng.integers(0, 512, 4), 6)[: int(n)]) for n in rng.integers(6, 24, num_requests)]
        return gc, model, params, (), prompts, IdText(), {"model": "tiny random Llama"}
    if c.target:
        gc.target = c.target
    build.check_config(build.generate_settings(gc))
    target, params, tok = build.load_target_with_tokenizer(build.generate_settings(gc))
    from specjax import decoding
    encoded = [decoding.encode_prompt(tok, q.turns[0]) for q in specbench.load(split="held_out")]
    fits = [p for p in encoded if len(p) <= c.max_prompt_tokens]
    pick = rng.choice(len(fits), size=min(num_requests, len(fits)), replace=False)
    extra = {"model": gc.target}
    try:                                   # a registry name: its verified file and sha256
        path = models.registry.resolve(gc.target)
        extra.update(model_file=str(path), model_sha256=toolkit.sha256(path), model_notes="registry GGUF")
    except (ValueError, KeyError, FileNotFoundError):
        pass
    return gc, target, params, tuple(tok.stop_token_ids), [fits[i] for i in pick], tok, extra   # a random order


def _engine(c, gc, target, params, eos_ids, mode: str):
    from specjax import build, decoding
    kind, gamma, adaptive, *budgets = config_lib.MODES[mode]
    gm = gc.copy_and_resolve_references()
    gm.update(drafter=kind, gamma=int(gamma), adaptive_gamma=bool(adaptive))
    if budgets:      # a gamma per row: exact with the token verifier (greedy rounds verify greedily either way)
        gm.update(adaptive_budgets=tuple(budgets[0]), verifier="token")
    drafter, dparams = build.make_drafter(kind, target, params, draft_model=gm.draft_model, max_ngram=gm.max_ngram,
                                          min_ngram=gm.min_ngram, dtype=gm.dtype, scan_layers=gm.scan_layers,
                                          target_name=gm.target)
    return (decoding.Engine(target, drafter, build.generation_config(build.generate_settings(gm), eos_ids)),
            decoding.EngineParams(target=params, draft=dparams))


def workload(c, n: int, kind: str, rate: float, seed: int) -> np.ndarray:
    """Arrival times of ``n`` requests: all at once (rate 0), Poisson, or bursty (gamma gaps)."""
    from specjax import serving
    if rate == 0:
        return np.zeros(n)
    if kind == "poisson":
        return serving.poisson_arrivals(n, rate, seed)
    if kind == "bursty":
        return serving.gamma_arrivals(n, rate, float(c.burstiness), seed)
    raise ValueError(f"config.arrivals: unknown arrival kind {kind!r} (poisson, bursty)")


def round_times_per_size(engine, eparams, samp, prompts, sizes, capacity, key, pad, repeats: int) -> dict:
    """Adaptive gamma's round times at each batch size, on that many of the study's prompts
    (medians of ``repeats`` timed rounds per gamma, `specjax.decoding.Engine.round_times`)."""
    from specjax import decoding
    out = {}
    for size in sizes:
        rows = [prompts[i % len(prompts)] for i in range(size)]
        batch = decoding.make_batch(rows, engine.config, key, capacity=capacity, pad_multiple=pad)
        out[size] = tuple(engine.round_times(eparams, samp, batch, repeats=repeats))
    return out


class _Events:
    """One live request's receiver: token times (s since the run's start) and its end."""

    def __init__(self, t0: float):
        import threading
        self.t0, self.times, self.tokens, self.done = t0, [], [], None
        self.finished = threading.Event()

    def __call__(self, ev):
        now = time.perf_counter() - self.t0
        if ev["type"] == "tokens":
            self.tokens.extend(ev["ids"])
            self.times.append(now)
        else:
            self.done, self.end = ev, now
            self.finished.set()


class IdText:
    """A stand-in tokenizer for a target without one (the tiny variant): ids as text, "12 7 ",
    so that text equality over HTTP is token equality."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"{int(i)} " for i in ids)

    def incremental_decoder(self, skip_special_tokens: bool = False):
        outer = self

        class _Pieces:
            def add(self, ids) -> str:
                return outer.decode(ids)

            def finish(self) -> str:
                return ""
        return _Pieces()


def _serve_http(live, tokenizer, temperature: float):
    """`specjax serve`'s application over ``live``, in a thread of this process
    (`serve.start_in_thread`, 127.0.0.1): (url, model name, stop function)."""
    from specjax import serve, serving
    app = serving.make_app(live, tokenizer, "study", {"temperature": temperature, "top_p": 1.0, "top_k": 0})
    url, stop = serve.start_in_thread(app)
    return url, "study", stop


def _warm_http(url: str, model: str, prompt) -> None:
    """The HTTP half of the warm-up (`_warm`): one streamed 1-token request, so that one-off
    costs of a fresh server's first request (its first streamed response, the worker thread
    pool: 30-200 ms here), which a long-running server paid long ago, are not in the timings."""
    import httpx
    body = {"model": model, "prompt": [int(x) for x in prompt], "max_tokens": 1, "stream": True}
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the study's HTTP server answered {r.status_code} to its warm-up request")
        for _ in r.iter_lines():
            pass


def _warm(live, prompt, http=None) -> dict:
    """One 1-token request through the started scheduler before the timed workload, in both
    transports alike (over HTTP when ``http`` = (url, model)): its round is the workload's
    neighbour in neither, and what it teaches the adaptive policy (one round's acceptance) both
    runs learn. Returns the scheduler's counters once it is idle again, to subtract."""
    if http is not None:
        _warm_http(*http, prompt)
    else:
        ev = _Events(time.perf_counter())
        live.submit(prompt, 1, ev)
        if not ev.finished.wait(600):
            raise RuntimeError("the warm-up request did not finish in 10 minutes")
    for _ in range(200):        # the engine thread updates its counters after it sent the request's end
        snap = live.snapshot()
        if snap["active_slots"] == 0 and snap["queue_depth"] == 0:
            time.sleep(0.1)
            return live.snapshot()
        time.sleep(0.05)
    raise RuntimeError("the scheduler did not come back to idle after the warm-up request")


def _http_clients(url: str, model: str, prompts, arrival_s, max_new: int, t0: float) -> dict:
    """Each prompt streamed from ``/v1/completions`` (token ids as the prompt, the server's
    sampling defaults) at its arrival time, all from one asyncio client: per request the times of
    its text chunks, its text, finish reason, usage and the count of ``[DONE]`` lines."""
    import asyncio

    import httpx

    async def one(client, i: int):
        delay = t0 + float(arrival_s[i]) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = {"times": [], "text": [], "finish": None, "usage": None, "done": 0, "error": None}
        body = {"model": model, "prompt": [int(x) for x in prompts[i]], "max_tokens": max_new, "stream": True}
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return i, rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line[6:] == "[DONE]":
                        rec["done"] += 1
                        continue
                    now = time.perf_counter() - t0
                    chunk = json.loads(line[6:])
                    choice = chunk["choices"][0]
                    if choice.get("text"):
                        rec["times"].append(now)
                        rec["text"].append(choice["text"])
                    if choice.get("finish_reason"):
                        rec["finish"], rec["usage"], rec["end"] = choice["finish_reason"], chunk.get("usage"), now
        except httpx.HTTPError as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        return i, rec

    async def run_all():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            return dict(await asyncio.gather(*(one(client, i) for i in range(len(prompts)))))
    return asyncio.run(run_all())


def live_run(engine, eparams, samp, slots, capacity, key, prompts, arrival_s, buckets, round_time_s, max_new, pad,
             transport: str = "engine", tokenizer=None, temperature: float = 0.0):
    """Serve ``prompts`` arriving at ``arrival_s`` through a `LiveScheduler` on the real clock,
    after one warm-up request (`_warm`): (summary, per-request rows, what each request got: token
    ids for transport "engine", text for "http"). "engine": a driver thread submits each request
    to the scheduler at its arrival time, times taken by the receivers as events arrive. "http":
    the same scheduler behind `specjax serve`'s application (uvicorn, 127.0.0.1), each request a
    streamed ``/v1/completions`` call from an asyncio client in this process, times taken as its
    text chunks arrive; a request without exactly one finish chunk and one ``[DONE]``, or that
    ends in an error, counts as lost."""
    from specjax import serving
    if transport not in ("engine", "http"):
        raise ValueError(f"config.live_transports: unknown transport {transport!r} (engine, http)")
    live = serving.LiveScheduler(engine, eparams, samp, slots=slots, capacity=capacity, key=key,
                                 max_queue=len(prompts), pad_multiple=pad, buckets=buckets, round_time_s=round_time_s)
    live.warmup(widths=sorted({-(-len(p) // pad): len(p) for p in prompts}.values()),     # one prompt per padded width
                greedy_only=samp.greedy)
    live.start()
    rows, stop = [], None
    try:
        if transport == "engine":
            before = _warm(live, prompts[0])
            order = np.argsort(arrival_s, kind="stable")
            t0 = time.perf_counter()
            got = {}
            for i in order:
                delay = t0 + float(arrival_s[i]) - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                got[int(i)] = ev = _Events(t0)
                live.submit(prompts[int(i)], max_new, ev)
            for ev in got.values():
                if not ev.finished.wait(600):
                    raise RuntimeError("a live request did not finish in 10 minutes")
            for i in sorted(got):
                ev = got[i]
                if ev.done["finish_reason"] == "error":
                    _log(f"request {i} failed: {ev.done['status']}")
                    continue
                rows.append({"id": i, "tokens": len(ev.tokens), "status": ev.done["status"], "times": ev.times,
                             "end": ev.end, "target_passes": ev.done["usage"].get("target_passes")})
            answers = {r["id"]: got[r["id"]].tokens for r in rows}
        else:
            url, model, stop = _serve_http(live, tokenizer, temperature)
            before = _warm(live, prompts[0], http=(url, model))
            got = _http_clients(url, model, prompts, arrival_s, max_new, time.perf_counter())
            for i in sorted(got):
                g = got[i]
                if g["error"] is not None or g["finish"] in (None, "error") or g["done"] != 1:
                    _log(f"request {i} lost over HTTP: {g['error'] or (g['finish'], g['done'])}")
                    continue
                rows.append({"id": i, "tokens": g["usage"]["completion_tokens"], "status": g["finish"],
                             "times": g["times"], "end": g["end"], "target_passes": g["usage"].get("target_passes")})
            answers = {r["id"]: "".join(got[r["id"]]["text"]) for r in rows}
    finally:
        try:
            if stop is not None:
                stop()
        finally:
            stats = live.snapshot()
            live.stop(5)
    stats = {**stats, "rounds_total": stats["rounds_total"] - before["rounds_total"],     # the workload's alone
             "resizes_total": stats["resizes_total"] - before["resizes_total"],
             "gamma_rounds": [a - b for a, b in zip(stats["gamma_rounds"], before["gamma_rounds"])]}
    for r in rows:
        a, times, n = float(arrival_s[r["id"]]), r.pop("times"), r["tokens"]
        first = times[0] if times else float("nan")
        r.update(arrival_s=a, ttft_s=first - a,
                 inter_token_s=(times[-1] - first) / (n - 1) if n > 1 and times else float("nan"),
                 latency_s=r["end"] - a, finished_s=r.pop("end"))
    if not rows:
        raise RuntimeError(f"live run ({transport}): no request finished")
    tokens = sum(r["tokens"] for r in rows)
    makespan = max(r["finished_s"] for r in rows) - min(r["arrival_s"] for r in rows)
    pct = lambda name, q: float(np.nanpercentile([r[name] for r in rows], q))      # noqa: E731
    summary = {"transport": transport, "requests": len(rows), "tokens": tokens, "makespan_s": makespan,
               "throughput_tok_s": tokens / makespan,
               "ttft_s_p50": pct("ttft_s", 50), "ttft_s_p90": pct("ttft_s", 90),
               "inter_token_s_p50": pct("inter_token_s", 50), "inter_token_s_p90": pct("inter_token_s", 90),
               "engine_rounds": stats["rounds_total"], "rounds_per_gamma": stats["gamma_rounds"],
               "resizes": stats["resizes_total"], "lost": len(prompts) - len(rows),
               "statuses": dict(collections.Counter(r["status"] for r in rows))}
    return summary, rows, answers


def _workloads(c, saturated: float) -> list:
    """(arrival kind, load, requests/s) of every workload at a slot count, all at once first."""
    return [("all at once", 0.0, 0.0)] + [(kind, load, load * saturated) for kind in c.arrivals for load in c.loads]


def _resumable(c) -> list[dict]:
    """The records of an unfinished run of this config (``<out>.partial``), or [] (none, or
    another config's: its setup record differs)."""
    partial = pathlib.Path(c.out + ".partial")
    if not partial.is_file():
        return []
    recs = []
    lines = partial.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{partial}: line {i + 1} is not JSON (the file is damaged, not cut off); "
                                 "move it away to start afresh") from None
            _log(f"{partial}: the last line was cut off mid-write; dropped")
    setup = next((r for r in recs if r["kind"] == "setup"), None)
    # (a partial file from before live runs went over HTTP has no live_transports: engine only)
    same = setup is not None and all(
        setup.get(k, default) == v for k, v, default in (
            ("slots", list(c.slots), None), ("num_requests", list(c.num_requests), None),
            ("loads", list(c.loads), None), ("arrivals", list(c.arrivals), None), ("modes", list(c.modes), None),
            ("burstiness", c.burstiness, None), ("buckets", c.buckets, None), ("seed", c.seed, None),
            ("max_new_tokens", c.max_new_tokens, None), ("temperature", c.temperature, None),
            ("live_slots", c.live_slots, None), ("live_loads", list(c.live_loads), None),
            ("live_modes", list(c.live_modes), None), ("live_transports", list(c.live_transports), ["engine"])))
    if not same:
        _log(f"{partial} is another config's run: starting afresh")
        return []
    return recs


def _done_groups(c, keep: list[dict], slots_list) -> set:
    """(slots, mode) whose every record is in ``keep``; ``keep`` is cut to those (and the setup,
    capacity and calibration records of finished groups), so a half-done group runs again."""
    n_workloads = 1 + len(c.arrivals) * len(c.loads)
    done = set()
    for slots in slots_list:
        for mode in c.modes:
            loads = [r for r in keep if r["kind"] == "load" and r["slots"] == slots and r["mode"] == mode]
            live = {(r.get("transport", "engine"), r["load"]) for r in keep
                    if r["kind"] == "live" and r["slots"] == slots and r["mode"] == mode}
            want_live = {(t, load) for t in c.live_transports for load in c.live_loads} \
                if slots == int(c.live_slots) and mode in c.live_modes else set()
            if len(loads) == n_workloads and live == want_live:
                done.add((slots, mode))
    kept = [r for r in keep if r["kind"] in ("setup", "capacity")
            or (r["kind"] in ("load", "live", "calibration") and (r["slots"], r["mode"]) in done)]
    keep[:] = kept
    return done


def main(c):
    from specjax import sampling, serving
    toolkit.check_output("config.out", c.out)       # before the model loads
    prov = toolkit.provenance("experiments.load_study.run")
    slots_list, counts = tuple(int(s) for s in c.slots), tuple(int(n) for n in c.num_requests)
    if len(slots_list) != len(counts):
        raise ValueError(f"config.num_requests needs one count per slot count {slots_list}, got {counts}")
    if "target-only" not in c.modes or c.modes[0] != "target-only":
        raise ValueError("config.modes must start with 'target-only' (it sets each slot count's loads)")
    gc, target, params, eos_ids, prompts_all, tokenizer, extra = _setup(c, max(counts))
    prov.update(extra)
    samp = sampling.SamplingConfig.make(temperature=float(c.temperature))
    key = jax.random.key(c.seed)
    pad = 64
    engines = {mode: _engine(c, gc, target, params, eos_ids, mode) for mode in c.modes}
    longest = max(len(p) for p in prompts_all)
    capacity = -(-max(e.config.slots_needed(longest) for e, _ in engines.values()) // pad) * pad
    keep = _resumable(c) if c.resume else []
    done = _done_groups(c, keep, slots_list)
    if keep:
        _log(f"resuming {c.out}.partial: {len(keep)} records kept, done (slots, mode): {sorted(done)}")
    out = toolkit.Jsonl(c.out, prov, keep=keep)
    if not keep:
        out.write("setup", slots=list(slots_list), num_requests=list(counts), capacity=capacity,
              prompt_tokens=[len(p) for p in prompts_all], max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                  loads=list(c.loads), arrivals=list(c.arrivals), burstiness=c.burstiness, buckets=c.buckets,
                  modes=list(c.modes), live_slots=c.live_slots, live_loads=list(c.live_loads),
                  live_modes=list(c.live_modes), live_transports=list(c.live_transports),
                  cpu_kernel=target.config.linear_op == "panels", seed=c.seed)
    for slots, n in zip(slots_list, counts):
        prompts = prompts_all[:n]
        buckets = serving.Buckets.make(slots, c.buckets)
        reference, workloads = {}, None
        cap = next((r for r in keep if r["kind"] == "capacity" and r["slots"] == slots), None)
        if cap is not None:
            workloads = _workloads(c, cap["requests_per_s"])
        for mode in c.modes:
            if (slots, mode) in done:
                continue
            jax.clear_caches()              # one process compiling every size of every mode runs out of mappings
            engine, eparams = engines[mode]
            if workloads is not None and not reference and mode != "target-only":
                # resumed after target-only: its tokens again, for 'same'
                ref = serving.Scheduler(*engines["target-only"], slots=slots, pad_multiple=pad, capacity=capacity,
                                        buckets=buckets.sizes).run(
                    [serving.Request(i, p) for i, p in enumerate(prompts)], samp, key)
                reference = {r.id: r.tokens for r in ref.results}
            round_time_s = None
            if engine.config.adaptive:
                round_time_s = round_times_per_size(engine, eparams, samp, prompts, buckets.sizes, capacity, key, pad,
                                                    int(c.calibration_repeats))
                out.write("calibration", slots=slots, mode=mode, gammas=[g if isinstance(g, int) else str(g) for g in engine.config.gammas],
                          round_time_s={str(b): list(t) for b, t in round_time_s.items()})
                _log(f"{slots} slots, {mode}: round times (ms) per size: " + "; ".join(
                    f"{b}: {[round(1e3 * t, 1) for t in ts]}" for b, ts in round_time_s.items()))
                jax.clear_caches()          # the timing programs are not the served ones
            sched = serving.Scheduler(engine, eparams, slots=slots, pad_multiple=pad, capacity=capacity,
                                      round_time_s=round_time_s, buckets=buckets.sizes)
            sched.warmup(samp, [serving.Request(i, p) for i, p in enumerate(prompts)], key)
            if workloads is None:           # target-only, all at once: the saturated rate sets the loads
                res = sched.run([serving.Request(i, p) for i, p in enumerate(prompts)], samp, key, warmup=False)
                saturated = len(prompts) / res.summary["makespan_s"]
                out.write("capacity", slots=slots, requests_per_s=saturated, tokens_per_s=res.summary["throughput_tok_s"])
                _log(f"{slots} slots: target-only saturates at {saturated:.3f} requests/s")
                workloads = _workloads(c, saturated)
            for w, (kind, load, rate) in enumerate(workloads):
                arrival = workload(c, len(prompts), kind, rate, c.seed + 1000 * slots + w)
                requests = [serving.Request(i, prompts[i], float(a)) for i, a in enumerate(arrival)]
                res = sched.run(requests, samp, key, warmup=False)
                if mode == "target-only" and kind == "all at once":
                    reference = {r.id: r.tokens for r in res.results}
                same = sum(r.tokens == reference.get(r.id) for r in res.results)
                s = res.summary
                out.write("load", mode=mode, arrivals=kind, load=load, rate=rate, **s,
                          same_tokens_as_target_only=same, per_request=[r.record() for r in res.results])
                _log(f"{slots} slots, {mode}, {kind} @ {load:g} ({rate:.3f}/s): {s['throughput_tok_s']:.1f} tok/s, "
                     f"ttft p50 {s['ttft_s_p50']:.2f}s, itl p50 {1e3 * s['inter_token_s_p50']:.1f} ms, "
                     f"tokens/pass {s['mean_accepted_tokens_per_pass']:.2f}, sizes {s['rounds_per_size']}, "
                     f"gammas {s['rounds_per_gamma']}, same {same}/{len(prompts)}")
            if slots == int(c.live_slots) and mode in c.live_modes:
                for transport in c.live_transports:
                    for load in c.live_loads:
                        w = next(i for i, x in enumerate(workloads) if x[0] == "poisson" and x[1] == load)
                        arrival = workload(c, len(prompts), "poisson", workloads[w][2], c.seed + 1000 * slots + w)
                        summary, rows, got = live_run(engine, eparams, samp, slots, capacity, key, prompts, arrival,
                                                      buckets.sizes, round_time_s, int(c.max_new_tokens), pad,
                                                      transport=transport, tokenizer=tokenizer,
                                                      temperature=float(c.temperature))
                        if transport == "http":       # text against target-only's tokens as the server decodes them
                            same = sum(got[i] == tokenizer.decode(reference.get(i, []), skip_special_tokens=True)
                                       for i in got)
                        else:
                            same = sum(got[i] == reference.get(i) for i in got)
                        out.write("live", slots=slots, mode=mode, arrivals="poisson", load=load, rate=workloads[w][2],
                                  **summary, same_tokens_as_target_only=same, per_request=rows)
                        _log(f"live ({transport}) {slots} slots, {mode}, poisson @ {load:g}: "
                             f"{summary['throughput_tok_s']:.1f} tok/s, ttft p50 {summary['ttft_s_p50']:.2f}s, "
                             f"itl p50 {1e3 * summary['inter_token_s_p50']:.1f} ms, lost {summary['lost']}, "
                             f"same {same}/{len(prompts)}")
    out.close()
    md = c.out.rsplit("/", 1)[0] + "/results.md"
    with open(md, "w") as f:
        f.write(report.render(toolkit.read_jsonl(c.out)))
    for p in plot.plot(c.out):
        _log(f"wrote {p}")


if __name__ == "__main__":
    toolkit.main_with_config(main, "experiments/load_study/config.py", "load study settings")
