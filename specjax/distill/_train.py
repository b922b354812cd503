"""The distillation step: a pure, jitted function of (train state, frozen inputs, batch).

Only the draft's trainable parameters are differentiated. The target enters as its final
hidden states at the loss positions (computed once per data set, see `_data`) and the rows of
its output head (``teacher_head_UD``); both are plain arguments outside the gradient, and the
teacher logits are additionally wrapped in `lax.stop_gradient`.

With a reduced draft head (tokens S) the loss compares q with p restricted to S and
renormalized (p|S): q must be zero off S, and p|S is also the q that maximizes the acceptance
rate sum_x min(p, q) under that constraint (it reaches the ceiling p(S)). Evaluation
(`evaluate_batch`) always uses the full-vocabulary p.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from specjax.distill import _divergence
from specjax.models import llama as llama_lib
from specjax.models.reduced_head import ReducedHeadLlama


@struct.dataclass
class TrainState:
    step: jax.Array          # micro-steps taken (= optimizer updates x accumulate)
    params: Any              # the draft's trainable parameters
    opt_state: Any
    key: jax.Array           # raw uint32 key data (checkpointable); `rng` wraps it


def rng(state: TrainState) -> jax.Array:
    return jax.random.wrap_key_data(state.key)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    divergence: str = "fkl"
    beta: float = 0.5
    temperature: float = 1.0

    def __post_init__(self):
        if self.divergence not in _divergence.DIVERGENCES:
            raise ValueError(f"unknown divergence {self.divergence!r}: expected one of {_divergence.DIVERGENCES}")
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"beta must be in (0, 1), got {self.beta}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


def check_optimizer_settings(*, learning_rate, warmup_steps, end_lr_fraction=0.1, clip_norm=1.0,
                             weight_decay=0.0, accumulate=1) -> None:
    """``ValueError`` naming the setting and value unless: ``learning_rate`` finite and > 0;
    ``warmup_steps`` an integer >= 0; ``end_lr_fraction`` in [0, 1]; ``clip_norm`` finite and
    >= 0 (0 = no clipping); ``weight_decay`` finite and >= 0; ``accumulate`` an integer >= 1.
    Cheap: the training loop calls it before loading anything."""
    def number(name, value, ok, expected):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not np.isfinite(value) or not ok(value):
            raise ValueError(f"optim.{name}={value!r}: expected {expected}")

    def integer(name, value, minimum):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise ValueError(f"optim.{name}={value!r}: expected an integer >= {minimum}")

    number("learning_rate", learning_rate, lambda v: v > 0,
           "a finite number > 0 (0 would leave the draft unchanged)")
    integer("warmup_steps", warmup_steps, 0)
    number("end_lr_fraction", end_lr_fraction, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    number("clip_norm", clip_norm, lambda v: v >= 0,
           "a finite number >= 0: the largest global gradient norm, or 0 for no clipping")
    number("weight_decay", weight_decay, lambda v: v >= 0, "a finite number >= 0")
    integer("accumulate", accumulate, 1)


def make_optimizer(*, learning_rate: float, warmup_steps: int, total_updates: int, end_lr_fraction: float = 0.1,
                   clip_norm: float = 1.0, weight_decay: float = 0.0, accumulate: int = 1):
    """AdamW with linear warm-up and cosine decay, global-norm clipping, optional accumulation
    (`optax.MultiSteps`: one update per `accumulate` micro-batches).

    ``clip_norm``: gradients whose global norm exceeds it are scaled down to it; ``0`` means NO
    clipping (``optax.clip_by_global_norm(0)`` would instead scale every update to zero, so
    training would run and change nothing). Negative or non-finite values, and the other bad
    settings of `check_optimizer_settings`, raise ``ValueError``."""
    check_optimizer_settings(learning_rate=learning_rate, warmup_steps=warmup_steps,
                             end_lr_fraction=end_lr_fraction, clip_norm=clip_norm,
                             weight_decay=weight_decay, accumulate=accumulate)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=max(total_updates, warmup_steps + 1), end_value=learning_rate * end_lr_fraction)
    # identity() for 0 keeps the optimizer state's structure the same for every clip_norm.
    clip = optax.identity() if clip_norm == 0 else optax.clip_by_global_norm(clip_norm)
    opt = optax.chain(clip, optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=weight_decay))
    if accumulate > 1:
        opt = optax.MultiSteps(opt, every_k_schedule=accumulate)
    return opt, schedule


def split_params(params: dict, trainable: tuple[str, ...]) -> tuple[dict, dict]:
    """(trainable, frozen) by top-level name."""
    tr = {k: v for k, v in params.items() if k in trainable}
    fr = {k: v for k, v in params.items() if k not in trainable}
    missing = set(trainable) - set(params)
    if missing:
        raise ValueError(f"trainable names not in the draft's params: {sorted(missing)}")
    return tr, fr


def merge_params(trainable: dict, frozen: dict) -> dict:
    return {**frozen, **trainable}


def init_state(params: dict, trainable: tuple[str, ...], optimizer, key) -> tuple[TrainState, dict]:
    tr, fr = split_params(params, trainable)
    # The train step donates the state: give it its own buffers (trainable tensors may be the
    # target's own arrays, e.g. a shared final norm, which must outlive the step).
    tr = jax.tree.map(lambda x: jnp.array(x, copy=True), tr)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=tr, opt_state=optimizer.init(tr),
                       key=jax.random.key_data(key))
    return state, fr


def teacher_head(target, target_params, head_ids=None):
    """Rows of the target's output layer [S, D] (all V rows when head_ids is None)."""
    p = target_params
    w = p["embed"] if target.config.tie_embeddings else p["lm_head"].T
    return w if head_ids is None else jnp.take(w, jnp.asarray(head_ids, jnp.int32), axis=0)


def student_logits(draft, params, tokens_BT):
    """The draft's logits over its own output tokens ([B, T, S] for a reduced head, else V)."""
    h, _ = draft.hidden_states(params, tokens_BT, None)
    if isinstance(draft, ReducedHeadLlama):
        return draft.head_logits(params, h)
    return draft.logits_from_hidden(params, h)


def teacher_logits(head_UD, hidden_BTD, softcap: float | None = None):
    """The target's logits over the rows ``head_UD`` from its final hidden states, soft-capped
    with the target's ``final_softcap`` (Gemma 2) as its own logits are."""
    logits = jnp.einsum("btd,sd->bts", hidden_BTD, head_UD.astype(hidden_BTD.dtype),
                        preferred_element_type=jnp.float32)
    return jax.lax.stop_gradient(llama_lib.softcap(logits, softcap))


def final_softcap(draft) -> float | None:
    """The logit soft-cap of a draft made from the target's layers (the target's own)."""
    return (draft.base if isinstance(draft, ReducedHeadLlama) else draft).config.final_softcap


def loss_fn(trainable, frozen, head_UD, batch, *, draft, spec: LossSpec, key=None):
    del key                  # deterministic (the step's key is for losses that draw noise)
    params = merge_params(trainable, frozen)
    q_logits = student_logits(draft, params, batch["tokens"])
    p_logits = teacher_logits(head_UD, batch["teacher_hidden"], final_softcap(draft))
    div = _divergence.divergence(spec.divergence, p_logits, q_logits, spec.temperature, spec.beta)
    mask = batch["mask"]
    loss = _divergence.masked_mean(div, mask)
    p = jax.nn.softmax(p_logits, -1)
    q = jax.nn.softmax(q_logits, -1)
    aux = {"loss": loss,
           "alpha_on_head": _divergence.masked_mean(jnp.sum(jnp.minimum(p, q), -1), mask),
           "agreement_on_head": _divergence.masked_mean(
               (jnp.argmax(p_logits, -1) == jnp.argmax(q_logits, -1)).astype(jnp.float32), mask),
           "loss_tokens": jnp.sum(mask)}
    return loss, aux


ON_NONFINITE = ("stop", "skip")


def check_on_nonfinite(mode) -> str:
    if mode not in ON_NONFINITE:
        raise ValueError(f"optim.on_nonfinite={mode!r}: expected one of {ON_NONFINITE}")
    return mode


def all_finite(tree) -> jax.Array:
    """One bool: every floating-point leaf of `tree` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


_LOSS_STREAM = 0x6C6F7373      # "loss": the losses' stream of the state's key (on-policy refreshes fold in small ints)


def make_train_step(draft, spec: LossSpec, optimizer, *, skip_nonfinite: bool = False, loss=None,
                    state_shardings=None):
    """A jitted ``step(state, frozen, head_UD, batch) -> (state, metrics)``; the state is donated.

    ``metrics["nonfinite"]`` is 1.0 when the loss, the gradient norm or the updated parameters
    are not all finite (else 0.0). With ``skip_nonfinite`` such a step leaves the parameters and
    optimizer state as they were (only the step counter advances); without it the caller must
    stop (the returned state then holds the non-finite values). ``loss``: the loss function
    (default `loss_fn`; feature heads pass `specjax.distill._heads.head_loss`), called as
    ``loss(trainable, frozen, head_UD, batch, draft=draft, spec=spec, key=key) -> (loss, aux)``,
    ``key`` = the state's key folded with the step counter (a fresh stream per micro-step, the
    same one on resume).
    ``state_shardings`` (a `TrainState` of `NamedSharding`s, `sharding.train_state_shardings`):
    the updated state keeps exactly that placement on its mesh (the metrics come back
    replicated); the inputs' placements are their own (placed beforehand)."""
    objective = loss_fn if loss is None else loss
    def step(state: TrainState, frozen, head_UD, batch):
        grad_fn = jax.value_and_grad(objective, has_aux=True)
        key = jax.random.fold_in(jax.random.fold_in(rng(state), _LOSS_STREAM), state.step)
        (loss, aux), grads = grad_fn(state.params, frozen, head_UD, batch, draft=draft, spec=spec, key=key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        aux["grad_norm"] = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(aux["grad_norm"]) & all_finite(params)
        aux["nonfinite"] = 1.0 - ok.astype(jnp.float32)
        if skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), aux

    if state_shardings is None:
        return jax.jit(step, donate_argnums=(0,))
    mesh = jax.tree.leaves(state_shardings)[0].mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(step, donate_argnums=(0,), out_shardings=(state_shardings, replicated))


# ------------------------------------------------------------------------------ evaluation

def _eval_batch(draft, params, full_head_VD, batch, pos_BT):
    """Per-position acceptance sum_x min(p, q) at temperature 1 over the full vocabulary, and
    whether the draft's argmax equals the target's, at the positions `pos_BT` of each row (the
    continuation's: the draft reads every position, the vocabulary-sized work runs at these
    only). Entries past a row's count are padding (their results are ignored)."""
    tokens = batch["tokens"]
    take = lambda x: jnp.take_along_axis(x, pos_BT[..., None], axis=1)   # noqa: E731  [B, K, X]
    p_logits = teacher_logits(full_head_VD, take(batch["teacher_hidden"]), final_softcap(draft))
    h, _ = draft.hidden_states(params, tokens, None)
    h = take(h)
    if isinstance(draft, ReducedHeadLlama):
        q_logits = draft.scatter(params, draft.head_logits(params, h))
    else:
        q_logits = draft.logits_from_hidden(params, h)
    p = jax.nn.softmax(p_logits, -1)
    q = jax.nn.softmax(q_logits, -1)
    alpha_BT = jnp.sum(jnp.minimum(p, q), -1)
    agree_BT = jnp.argmax(p_logits, -1) == jnp.argmax(q_logits, -1)
    return alpha_BT, agree_BT


def _loss_positions(mask_BT: np.ndarray, multiple: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(positions [B, K], valid [B, K]): each row's masked positions in order, padded with 0 to
    K = the largest count rounded up to `multiple` (at most T), so few shapes get compiled."""
    m = mask_BT > 0
    counts = m.sum(1)
    K = min(m.shape[1], max(multiple, -(-int(counts.max(initial=0)) // multiple) * multiple))
    pos = np.zeros((m.shape[0], K), np.int32)
    valid = np.zeros((m.shape[0], K), bool)
    for r in range(m.shape[0]):
        nz = np.flatnonzero(m[r])
        pos[r, :len(nz)] = nz
        valid[r, :len(nz)] = True
    return pos, valid


_eval_batch_jit = jax.jit(_eval_batch, static_argnums=(0,))


def greedy_accepted_per_pass(agree: np.ndarray, gamma: int) -> tuple[int, int]:
    """(committed tokens, target passes) of greedy speculative decoding along a target-greedy
    sequence, from the draft's teacher-forced agreement at each position.

    With greedy sampling both models are deterministic and the committed sequence is the
    target's greedy one; a round starting at position i accepts the longest run of agreements
    a_i, a_{i+1}, ... (at most gamma) and commits one more token (the correction or the bonus).
    So this is exact, up to float near-ties between a batched and an incremental forward.
    """
    m = len(agree)
    agree = np.asarray(agree, bool)
    steps = max(int(gamma), 1)
    # A draft that does not depend on the round's origin: step j from origin i agrees iff a_{i+j}.
    agree_TJ = np.zeros((m, steps), bool)
    for j in range(min(steps, m)):
        agree_TJ[:m - j, j] = agree[j:]
    return chain_tokens_per_pass(agree_TJ, np.ones(m, bool), gamma)


def chain_tokens_per_pass(agree_TJ: np.ndarray, valid_O: np.ndarray, gamma: int) -> tuple[int, int]:
    """(committed tokens, target passes) of greedy chain drafting along one target-greedy
    sequence: ``agree_TJ[o, j]`` says whether draft step j+1 of a round whose last committed
    token sits at position o proposes the target's token (a draft head's steps depend on the
    origin; a standalone draft's do not, see `greedy_accepted_per_pass`); ``valid_O`` marks the
    origins whose next token is a continuation token (consecutive). A round accepts the run of
    agreeing steps (at most gamma) and commits one more token."""
    origins = np.flatnonzero(valid_O)
    if origins.size == 0:
        return 0, 0
    o, end = int(origins[0]), int(origins[-1]) + 1
    committed = passes = 0
    while o < end:
        n = 0
        while n < gamma and o + n < end and agree_TJ[o, n]:
            n += 1
        c = min(n + 1, end - o)
        committed += c
        passes += 1
        o += c
    return committed, passes


def evaluate(draft, params, full_head_VD, plan, gamma) -> dict:
    """Acceptance rate (temperature 1), greedy agreement and greedy mean committed tokens per
    target pass at `gamma` (an int, or several) over one pass of `plan` (held-out
    target-greedy continuations)."""
    from specjax import analysis
    gammas = (int(gamma),) if np.ndim(gamma) == 0 else tuple(int(g) for g in gamma)
    n_batches = plan.batches_per_epoch
    alpha_sum = agree_sum = count = 0.0
    committed, passes = dict.fromkeys(gammas, 0), dict.fromkeys(gammas, 0)
    for i in range(n_batches):
        b = plan.batch(i)
        pos_BT, m = _loss_positions(b["mask"])
        a_BT, g_BT = _eval_batch_jit(draft, params, full_head_VD,
                                     {k: jnp.asarray(b[k]) for k in ("tokens", "teacher_hidden")}, jnp.asarray(pos_BT))
        a_BT, g_BT = np.asarray(a_BT), np.asarray(g_BT)
        alpha_sum += float(a_BT[m].sum())
        agree_sum += float(g_BT[m].sum())
        count += float(m.sum())
        for r in range(m.shape[0]):
            if m[r].any():
                for g in gammas:
                    c, p = greedy_accepted_per_pass(g_BT[r][m[r]], g)
                    committed[g] += c
                    passes[g] += p
    alpha = alpha_sum / max(count, 1.0)
    out = {"alpha_t1": alpha, "greedy_agreement": agree_sum / max(count, 1.0), "eval_tokens": int(count)}
    for g in gammas:
        out[f"greedy_tokens_per_pass_g{g}"] = committed[g] / max(passes[g], 1)
        out[f"expected_tokens_per_pass_t1_g{g}"] = float(analysis.expected_tokens_per_round(alpha, g))
    return out
