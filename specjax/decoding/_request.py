"""One request path, text in and text out: chat template -> pad -> capacity -> keys -> run or
stream -> detokenize. The CLI, the distillation data generator, the greedy check and every
benchmark go through it (`make_batch` for token ids, `Generator` for text).

Capacity: the cache must hold the longest prompt, max_new_tokens and the largest
verification block (`GenerationConfig.slots_needed`); it is rounded up to ``pad_multiple`` so
nearby prompt lengths share one compiled program, and it is checked on the host before
anything runs (XLA clamps out-of-range writes silently).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax.decoding._engine import Engine, GenerationConfig
from specjax.decoding._state import PAD_ID, STATUS_NAMES, Batch, EngineParams, GenerateOutput, Prefill, StreamEvent


REQUEST_ID_LIMIT = 2 ** 32      # a request's key is fold_in(key, id) with a uint32 id


def check_request_id(request_id) -> int:
    """A request id as an int; ValueError naming it unless it is an integer in [0, 2**32).

    A request's key is ``fold_in(key, id)`` with a uint32 id: an id outside that range is
    refused rather than wrapped, since wrapping (-1 -> 2**32 - 1) would give two distinct ids
    one key (the same samples) and hashing would change the keys of valid ids."""
    if not isinstance(request_id, (bool, np.bool_)):
        try:
            value = operator.index(request_id)
        except TypeError:
            value = None
        if value is not None and 0 <= value < REQUEST_ID_LIMIT:
            return value
    raise ValueError(f"request id {request_id!r}: expected an integer in [0, 2**32) = [0, {REQUEST_ID_LIMIT}) "
                     f"(a request's key is fold_in(key, id) with a uint32 id)")


def request_keys(key: jax.Array, request_ids) -> jax.Array:
    """One key per request, folded from its id: samples do not depend on batch layout. Ids
    outside [0, 2**32) are refused (`check_request_id`)."""
    ids = np.asarray(request_ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() >= REQUEST_ID_LIMIT)):
        ids = [check_request_id(i) for i in np.asarray(request_ids, object).ravel()]
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(ids, jnp.uint32))


def _round_up(x: int, multiple: int) -> int:
    return -(-int(x) // multiple) * multiple


def check_text(text: str, what: str, escaped_bytes: bool = True) -> str:
    """``text`` when it can be encoded as UTF-8, else a one-line ValueError naming ``what`` and
    the byte offset of the first character that cannot: a byte that was not UTF-8 (Python keeps
    one as a surrogate U+DC80..U+DCFF in a command-line argument, an environment variable or a
    file read with errors='surrogateescape'; ``escaped_bytes=False`` for text that cannot hold
    such bytes, e.g. parsed JSON), or another lone surrogate (e.g. a JSON escape such as
    "\\ud800"). The tokenizer would otherwise fail on it with a TypeError after the model has
    loaded."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        offset, code = len(text[:e.start].encode("utf-8")), ord(text[e.start])
    if escaped_bytes and 0xDC80 <= code <= 0xDCFF:
        problem = f"byte 0x{code - 0xDC00:02x} at byte offset {offset} is not UTF-8"
    else:
        problem = f"a lone surrogate U+{code:04X} at byte offset {offset} cannot be encoded as UTF-8"
    raise ValueError(f"{what}: {problem}; give the text as UTF-8")


def token_ids(prompt, what: str = "prompt") -> list[int]:
    """A prompt given as token ids, as a list of ints; ValueError naming ``what`` and the first
    value that is not an integer (a float, even 2.0, a bool, a nested list) or, for text, that
    text must be encoded first. Integer numpy / jax arrays are read whole."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"{what}: expected token ids, got text {prompt[:20]!r}; encode it first "
                         f"(decoding.encode_prompt)")
    if hasattr(prompt, "__array__"):
        arr = np.asarray(prompt)
        if arr.ndim == 1 and arr.dtype.kind in "iu":
            return arr.tolist()
    out = []
    for i, t in enumerate(prompt):
        try:
            if isinstance(t, (bool, np.bool_)):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"{what}: token ids must be integers, got {t!r} at position {i}") from None
    return out


def encode_prompt(tokenizer, prompt: str, *, chat: bool = True, system: str = "") -> list[int]:
    """The token ids of one user prompt: in the tokenizer's chat template (a first user turn,
    with an optional system message, ready for the assistant's answer), or as plain text.
    Text that is not UTF-8 is a ValueError naming 'prompt' or 'system' and the byte offset
    (`check_text`)."""
    check_text(prompt, "prompt")
    check_text(system, "system")
    if not chat:
        return list(tokenizer.encode(prompt))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def make_batch(prompts: Sequence[Sequence[int]], config: GenerationConfig, key: jax.Array, *,
               request_ids: Sequence[int] | None = None, pad_multiple: int = 1,
               capacity: int | None = None) -> Batch:
    """Right-pad (to a multiple of ``pad_multiple``) and key a batch of token-id prompts.

    capacity: by default the slots `config` needs for the longest prompt, rounded up to
    ``pad_multiple`` (at least the padded width); pass one to share it between runs (e.g.
    speculative and target-only decoding of the same prompt). Raises ValueError for no prompts,
    an empty prompt or a wrong number of request ids; the engine checks the rest (token ids
    against the target's vocabulary, capacity) before it runs a batch.
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    lens = np.asarray([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError(f"prompt {int(lens.argmin())} is empty; every prompt needs >= 1 token")
    width = _round_up(lens.max(), pad_multiple)
    prompt_BP = np.full((len(prompts), width), PAD_ID, np.int64)
    for b, p in enumerate(prompts):
        prompt_BP[b, :len(p)] = np.asarray(token_ids(p, f"prompt {b}"), np.int64)
    if prompt_BP.min() < np.iinfo(np.int32).min or prompt_BP.max() > np.iinfo(np.int32).max:
        raise ValueError("token ids must fit in int32")
    if capacity is None:
        capacity = max(_round_up(config.slots_needed(lens.max()), pad_multiple), width)
    ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
    if len(ids) != len(prompts):
        raise ValueError(f"{len(ids)} request ids for {len(prompts)} prompts")
    return Batch(prompt_BP=jnp.asarray(prompt_BP, jnp.int32), prompt_lengths_B=jnp.asarray(lens),
                 key_B=request_keys(key, ids), capacity=int(capacity))


def timing_summary(events: list[StreamEvent], row: int = 0) -> dict:
    """Host-side latency metrics of one row from its stream events.

    ttft_s: time to the first committed token (prefill, first round and any compilation);
    inter_token_s: mean time per token after the first round (a round's wall time spread
    over the tokens it committed); tokens_per_s: tokens after the first round / their time;
    decode_tokens, decode_s: those tokens and that time (sums of them give a set's rate).
    """
    times, counts = [], []
    for e in events:
        if e.new_tokens[row]:
            times.append(e.elapsed_s)
            counts.append(len(e.new_tokens[row]))
    if not times:
        return {"ttft_s": float("nan"), "tokens": 0, "inter_token_s": float("nan"), "tokens_per_s": float("nan"),
                "decode_tokens": 0, "decode_s": 0.0}
    after = sum(counts[1:])
    span = times[-1] - times[0]
    return {"ttft_s": times[0], "tokens": sum(counts),
            "inter_token_s": span / after if after else float("nan"),
            "tokens_per_s": after / span if span > 0 else float("nan"),
            "decode_tokens": after, "decode_s": span}


@dataclasses.dataclass
class Completion:
    """One request's result: its generated ids, text (with a tokenizer) and status."""
    prompt_tokens: int
    tokens: list[int]
    text: str | None
    status: str


@dataclasses.dataclass
class Generator:
    """The request path for one engine and its weights (in the spirit of gemma's `Sampler`).
    With an engine on a mesh, ``params`` are already placed (`Engine.place_params`) and
    `batch` places its rows.

    Prompts are text (chat-templated with ``chat=True``, the default, else encoded as they
    are) or lists of token ids. ``round_time_s`` feeds adaptive gamma (`calibrate` sets it).
    """
    engine: Engine
    params: EngineParams
    tokenizer: Any = None
    pad_multiple: int = 64
    round_time_s: tuple[float, ...] | None = None

    @property
    def config(self) -> GenerationConfig:
        return self.engine.config

    def target_only(self) -> "Generator":
        """The same target and settings without a drafter (gamma = 0); a padded block size
        (`GenerationConfig.block_tokens`) stays the speculative program's, so both score blocks
        of one shape."""
        config = dataclasses.replace(self.config, gamma=0, block_tokens=self.config.target_block or 0)
        return dataclasses.replace(self, engine=Engine(self.engine.target, None, config, mesh=self.engine.mesh,
                                                       rules=self.engine.rules),
                                   params=EngineParams(target=self.params.target), round_time_s=None)

    def encode(self, prompt: str | Sequence[int], *, chat: bool = True, system: str = "") -> list[int]:
        if not isinstance(prompt, str):
            return token_ids(prompt)
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        return encode_prompt(self.tokenizer, prompt, chat=chat, system=system)

    def batch(self, prompts: Sequence[str | Sequence[int]], key: jax.Array, *, chat: bool = True,
              request_ids: Sequence[int] | None = None, capacity: int | None = None) -> Batch:
        batch = make_batch([self.encode(p, chat=chat) for p in prompts], self.config, key,
                           request_ids=request_ids, pad_multiple=self.pad_multiple, capacity=capacity)
        # On a mesh the rows go over its batch axes (the weights were placed with the engine).
        return batch if self.engine.mesh is None else self.engine.place_batch(batch)

    def prefill(self, batch: Batch) -> Prefill:
        """The batch's prompts in the caches, once: pass it as ``prefill=`` to `run`, `stream`
        and `calibrate` of this generator and of its `target_only` twin."""
        return self.engine.prefill(self.params, batch)

    def run(self, batch: Batch, sampling: sampling_lib.SamplingConfig,
            prefill: Prefill | None = None) -> GenerateOutput:
        return self.engine.run(self.params, sampling, batch, self.round_time_s, prefill=prefill)

    def stream(self, batch: Batch, sampling: sampling_lib.SamplingConfig,
               prefill: Prefill | None = None, precompile: bool = False) -> Iterator[StreamEvent]:
        return self.engine.stream(self.params, sampling, batch, self.round_time_s, prefill=prefill,
                                  precompile=precompile)

    def calibrate(self, batch: Batch, sampling: sampling_lib.SamplingConfig, repeats: int = 3,
                  prefill: Prefill | None = None) -> tuple[float, ...]:
        """Measure one round per gamma (per draft source and gamma, for a drafter with several:
        `Engine.round_times`) on `batch` (adaptive gamma's costs) and keep them."""
        times = self.engine.round_times(self.params, sampling, batch, repeats, prefill=prefill)
        if jax.process_count() > 1:     # every process must choose the same gammas: process 0's times
            from jax.experimental import multihost_utils
            times = np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(times, np.float64)))
        self.round_time_s = tuple(float(t) for t in times)
        return self.round_time_s

    def detokenize(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts: Sequence[str | Sequence[int]], sampling: sampling_lib.SamplingConfig,
                 key: jax.Array, *, chat: bool = True) -> list[Completion]:
        """Text (or ids) in, `Completion`s out: one jitted run over the whole batch."""
        batch = self.batch(prompts, key, chat=chat)
        out = jax.device_get(self.run(batch, sampling))
        plens = np.asarray(out.prompt_lengths_B)
        return [Completion(prompt_tokens=int(plens[b]), tokens=ids, text=self.detokenize(ids),
                           status=STATUS_NAMES[int(out.status_B[b])])
                for b, ids in enumerate(out.generated())]
