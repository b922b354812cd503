"""`specjax serve`: an OpenAI-compatible HTTP server over the slot scheduler (`specjax.serving`).

`serve_job` types the command's config once (`ServeJob`: the generation settings, which load the
target and the drafter as `specjax generate` does, and the server's own keys); `main` loads the
model, sizes every row's cache for ``max_prompt_tokens`` plus the generation's
``max_new_tokens``, compiles the engine's programs, starts the engine thread and runs uvicorn
until SIGINT/SIGTERM, then drains: no new request is taken and those in flight get up to
``drain_s`` to finish.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from specjax import build
from specjax.settings import Settings, field_types, typed_value


@dataclasses.dataclass(frozen=True)
class ServeJob(Settings):
    """`specjax serve`'s settings: the generation settings and the server's own keys."""
    run: build.GenerateSettings = build.GenerateSettings()
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 4                       # rows decoded together (continuous batching)
    buckets: str = "powers"              # batch sizes rounds run at: 'powers' (1, 2, 4, .. slots), '' (slots), '1,4'
    max_queue: int = 64                  # waiting requests beyond which a request gets 429
    max_prompt_tokens: int = 1024        # the longest prompt a request may send (sizes the caches)
    model_name: str = ""                 # the name clients send as "model" ("" = the target's name)
    seed: int = 0                        # the key every request's key is folded from
    drain_s: float = 30.0                # at shutdown, the time in-flight requests get to finish
    log_level: str = "warning"           # uvicorn's log level
    compilation_cache_dir: str = "~/.cache/specjax/xla"


def serve_job(c: Any) -> ServeJob:
    """`ServeJob` of a serve config, typed once (as `generate.generate_job`)."""
    values = c.to_dict() if hasattr(c, "to_dict") else dict(c)
    hints = field_types(ServeJob)
    own = {f.name: typed_value(f.name, hints[f.name], values[f.name]) for f in dataclasses.fields(ServeJob)
           if f.name != "run" and f.name in values}
    job = ServeJob(run=build.generate_settings(values), **own)
    for name in ("slots", "max_queue", "max_prompt_tokens"):
        if getattr(job, name) < 1:
            raise ValueError(f"config.{name}: must be >= 1, got {getattr(job, name)}")
    _buckets(job)
    if not 0 <= job.port < 65536:
        raise ValueError(f"config.port: {job.port} is not a TCP port (0 picks a free one)")
    return job


def _buckets(job: ServeJob):
    """The ``buckets`` setting as `specjax.serving.Buckets.make` takes it; ValueError naming it."""
    text = job.buckets.strip()
    if text in ("", "powers"):
        return text or ()
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"config.buckets: 'powers', '' or comma-separated batch sizes, got {job.buckets!r}") from None
    from specjax import serving
    try:
        serving.Buckets.make(job.slots, sizes)
    except ValueError as e:
        raise ValueError(f"config.buckets: {e}") from None
    return sizes


def round_times_per_size(gen, samp, sizes, capacity: int, repeats: int = 3) -> dict:
    """Adaptive gamma's round times measured at each batch size (`Engine.round_times` on rows of a
    placeholder prompt): what `specjax.serving.Buckets` prices each size's rounds with."""
    import jax

    from specjax import decoding
    out = {}
    for size in sizes:
        batch = decoding.make_batch([[1] * 16] * size, gen.config, jax.random.key(0), pad_multiple=gen.pad_multiple,
                                    capacity=capacity)
        out[size] = gen.engine.round_times(gen.params, samp, batch, repeats=repeats)
    return out


def build_server(job: ServeJob):
    """(the live scheduler, the ASGI app, the model name): the model loaded, compiled, started."""
    import jax

    from specjax import serving
    s = job.run
    gen = build.load_generator(s)
    if gen.engine.mesh is not None:
        raise ValueError("specjax serve runs on one device for now (mesh settings name several)")
    samp = build.sampling_config(s)
    capacity = gen.config.slots_needed(-(-job.max_prompt_tokens // gen.pad_multiple) * gen.pad_multiple)
    buckets = serving.Buckets.make(job.slots, _buckets(job))
    round_time_s = None
    if gen.config.adaptive:
        round_time_s = round_times_per_size(gen, samp, buckets.sizes, capacity)
        print("[specjax] round times (ms) per batch size and gamma: " + "; ".join(
            f"{b}: " + ", ".join(f"{1e3 * t:.1f}" for t in ts) for b, ts in round_time_s.items()), file=sys.stderr)
    live = serving.LiveScheduler(gen.engine, gen.params, samp, slots=job.slots, capacity=capacity,
                                 key=jax.random.key(job.seed), max_queue=job.max_queue, pad_multiple=gen.pad_multiple,
                                 buckets=buckets.sizes, round_time_s=round_time_s)
    live.warmup()
    live.start()
    name = job.model_name or s.target
    sampling_settings = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                         "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
                         "frequency_penalty": s.frequency_penalty}
    return live, serving.make_app(live, gen.tokenizer, name, sampling_settings), name


def start_in_thread(app, host: str = "127.0.0.1", log_level: str = "warning", timeout_s: float = 30.0):
    """Serve the ASGI ``app`` by uvicorn in a daemon thread of this process, on a socket bound
    here to a free port of ``host`` (no other process can take the port between a probe and the
    bind): (base url, stop function). What tests and experiments use to call the server over
    real HTTP without a second process; RuntimeError if it does not start in ``timeout_s``."""
    import socket
    import threading
    import time

    import uvicorn
    sock = socket.socket()
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def stop():
        srv.should_exit = True
        thread.join(timeout_s)
        sock.close()
        if thread.is_alive():
            raise RuntimeError(f"the HTTP server on {host}:{port} did not stop in {timeout_s:g} s")
    t0 = time.monotonic()
    while not srv.started and thread.is_alive() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)
    if not srv.started:
        stop()
        raise RuntimeError(f"the HTTP server on {host}:{port} did not start in {timeout_s:g} s")
    return f"http://{host}:{port}", stop


def main(job: ServeJob) -> None:
    import uvicorn

    build.check_seed(job.seed)
    build.enable_compilation_cache(job.compilation_cache_dir)
    build.limit_heap_retention()
    live, app, name = build_server(job)
    print(f"[specjax] serving {name} (drafter {job.run.drafter}) on http://{job.host}:{job.port}/v1 with "
          f"{job.slots} slots", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=job.host, port=job.port, log_level=job.log_level,
                    timeout_graceful_shutdown=max(1, int(job.drain_s)))
    finally:
        live.stop(job.drain_s)
