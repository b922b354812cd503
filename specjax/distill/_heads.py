"""Training feature-level draft heads (Medusa-1, EAGLE, EAGLE-3 style) with the distillation loop.

The head's loss needs the target's features at every position of a training sequence (an
EAGLE head reads ``f_{s-1}`` at every slot, prompt included) and the target's distribution at
the loss positions. With ``head.feature_cache`` set ('float32' or 'float16') both come with the
batch: the features computed once per data set and stored beside it (`_data.feature_states`),
the distribution from the cached final hidden states (one matmul with the head's rows), so the
step runs no target forward. Without it they come from one cache-free target forward inside
the jitted step, outside the gradient (``stop_gradient``), costing one target forward per batch
(more than the head's own forward and backward). Either way the step is a pure function of
(head state, target params, batch).

Losses per position (``mask`` marks the positions whose next token is a continuation token):
* divergence (`LossSpec`: FKL / RKL / JSD / TVD) between the target's distribution and the
  head's, over the head's tokens (p restricted to a reduced head and renormalized, as for the
  standalone draft, see `_train`);
* EAGLE: plus ``feature_weight`` x smooth L1 between the head's output and the target's feature
  (Li et al. 2024 use regression + 0.1 x classification); with ``head.input_norm`` between the
  two RMS-normalized (the head's output is only ever read through a norm);
* EAGLE-3: ``ttt_steps`` drafting steps unrolled (training-time test, Li et al. 2025): step j's
  output at origin o is scored against the target's distribution of ``x_{o+j}``; steps weigh
  equally. The published EAGLE-3 head (``eagle3_published``) the same, its outputs scored by its
  own norm and LM head over its draft vocabulary (the target's distribution restricted to it);
* Medusa: head k on ``f_s`` against the target's distribution of ``x_{s+k+1}``.

Origins. A training sequence is a prompt and an answer, padded to its batch's width; only the
answer's positions carry loss. Training-time test runs each drafting step after the first at
every origin, and the vocabulary-sized scoring runs at every position, though an origin whose
shifted targets all lie in the prompt or the padding adds nothing to the loss. The loop attaches
the origins the loss reads (`with_loss_origins`, `loss_origins`); the step then scores only
those and runs the later drafting steps there alone (step 1 still runs everywhere: its entries
are the context every later step attends to). The loss is the same, to float rounding.

With ``feature_noise`` > 0 the head reads the target's features with uniform noise added
(`noisy_features`, EAGLE's augmentation), drawn from the key the train step passes.

Evaluation (held-out target-greedy continuations): temperature-1 acceptance sum_x min(p, q) of
the first draft step, greedy agreement per draft step, and the greedy chain's accepted tokens
per target pass, simulated exactly along each sequence with the head's multi-step outputs (a
round at origin o accepts the run of steps j whose argmax equals the target's, then commits one
more token).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import drafters
from specjax.distill import _divergence, _settings
from specjax.distill._train import chain_tokens_per_pass, teacher_logits
from specjax.models import Llama
from specjax.models import llama as llama_lib


@dataclasses.dataclass(frozen=True)
class HeadObjective:
    """Static description of a head's training (hashable: the jitted step's static argument)."""
    config: drafters.HeadConfig
    target: Llama
    ttt_steps: int = 1
    feature_weight: float = 0.0
    feature_noise: float = 0.0
    compute_dtype: str = "float32"

    def __post_init__(self):
        if self.compute_dtype not in _settings.COMPUTE_DTYPES:
            raise ValueError(f"head.compute_dtype must be one of {_settings.COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.ttt_steps < 1:
            raise ValueError(f"head.ttt_steps must be >= 1, got {self.ttt_steps}")
        if not self.config.spec.autoregressive and self.ttt_steps != 1:
            raise ValueError(f"{self.config.kind} heads are not autoregressive: head.ttt_steps must be 1")
        if not self.feature_weight >= 0:
            raise ValueError(f"head.feature_weight must be >= 0, got {self.feature_weight}")
        if not 0 <= self.feature_noise < 10:
            raise ValueError(f"head.feature_noise must be in [0, 10), got {self.feature_noise}")

    @property
    def trainable(self) -> tuple[str, ...]:
        return tuple(n for n in self.config.own_param_names if n != "head_ids")


def feature_layers_of(c, target: Llama) -> tuple[int, ...]:
    """The target layers a run's head reads (its ``head.feature_layers`` or the kind's default);
    `c`: a distillation config or its `DistillSettings`."""
    c = _settings.distill_settings(c, extra="ignore")
    return drafters.HeadConfig.make(c.draft.kind, target.config,
                                    feature_layers=tuple(c.head.feature_layers) or None).feature_layers


def objective_from_config(c, target: Llama, head_ids=None) -> HeadObjective:
    """The objective of a run whose ``draft.kind`` is a head kind (`c`: a distillation config or
    its `DistillSettings`)."""
    c = _settings.distill_settings(c, extra="ignore")
    h = c.head
    spec = drafters.head_kind_of(c.draft.kind)
    hc = drafters.HeadConfig.make(c.draft.kind, target.config, num_heads=h.num_heads,
                                  head_size=c.draft.head_vocab or None, feature_layers=tuple(h.feature_layers) or None,
                                  input_norm=h.input_norm and spec.has_input_norm)
    return HeadObjective(config=hc, target=target,
                         ttt_steps=spec.default_ttt_steps if h.ttt_steps is None else h.ttt_steps,
                         feature_weight=spec.default_feature_weight if h.feature_weight is None else h.feature_weight,
                         feature_noise=h.feature_noise, compute_dtype=h.compute_dtype)


def _shift(x, k: int):
    """x[:, t + k] at t (zeros past the end)."""
    if k == 0:
        return x
    pad = jnp.zeros((x.shape[0], k) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def _target_pass(obj: HeadObjective, tp, tokens_BT):
    """(final normed hidden [B, T, D], features [B, T, F]) of the target, outside the gradient."""
    hc = obj.config
    h, feats, _ = obj.target.trunk(tp, tokens_BT, None, collect=hc.feature_layers)
    h = llama_lib.norm(obj.target.config, h, tp["final_norm"])
    return jax.lax.stop_gradient(h), jax.lax.stop_gradient(jnp.concatenate(feats, axis=-1))


def noisy_features(f_BTF, num_layers: int, noise: float, key):
    """``f + noise * rms(f) * u``, u ~ U(-1, 1) per element, the RMS taken per fused layer (each
    of the `num_layers` equal slices of the last axis, so every layer is perturbed relative to its
    own scale). EAGLE (Li et al. 2024) trains on features with uniform noise U(-0.1, 0.1) added,
    so the head meets slightly-off features, as its own predicted ones are at later steps; here
    the width is relative, as the scale of a target's features is its own."""
    B, T, F = f_BTF.shape
    f = f_BTF.astype(jnp.float32).reshape(B, T, num_layers, F // num_layers)
    rms = jnp.sqrt(jnp.mean(f * f, axis=-1, keepdims=True))
    u = jax.random.uniform(key, f.shape, jnp.float32, -1.0, 1.0)
    return (f + noise * rms * u).reshape(B, T, F).astype(f_BTF.dtype)


def _at_origins(o_BQ, x_BT):
    """x at the origins: [B, Q, ...] from [B, T, ...]."""
    idx = jnp.clip(o_BQ, 0, x_BT.shape[1] - 1).reshape(o_BQ.shape + (1,) * (x_BT.ndim - 2))
    return jnp.take_along_axis(x_BT, idx, axis=1)


def loss_origins(mask_BT: np.ndarray, shifts, parts: int = 8, min_width: int = 256):
    """The origins a head's loss reads, for ``batch["origins"]`` / ``batch["origins_valid"]``
    (`head_loss`): position o of a row when ``mask[o + k]`` for some shift k of its outputs
    (`HeadKind.train_shifts`), in order, the rows padded (position 0, not valid) to one width Q,
    the largest count rounded up to a multiple of T / ``parts`` (few shapes to compile). None
    when Q would be the whole width (nothing to save) or the batch is narrower than
    ``min_width`` (each (width, Q) is a program to compile; narrow batches save too little to
    pay for theirs).

    Training-time test runs every drafting step after the first at each origin; positions whose
    every shifted target is a prompt token or padding need none of it."""
    m = np.asarray(mask_BT) > 0
    B, T = m.shape
    if T < min_width:
        return None
    need = np.zeros_like(m)
    for k in shifts:
        if 0 <= k < T:
            need[:, :T - k] |= m[:, k:]
    counts = need.sum(1)
    unit = max(1, -(-T // parts))
    Q = max(unit, -(-int(counts.max(initial=0)) // unit) * unit)
    if Q >= T:
        return None
    origins = np.zeros((B, Q), np.int32)
    valid = np.zeros((B, Q), np.float32)
    for r in range(B):
        nz = np.flatnonzero(need[r])
        origins[r, :len(nz)] = nz
        valid[r, :len(nz)] = 1.0
    return origins, valid


def with_loss_origins(obj: HeadObjective, batch: dict, min_width: int = 256) -> dict:
    """``batch`` with the origins its loss reads (`loss_origins`) when they save work."""
    got = loss_origins(batch["mask"], obj.config.spec.train_shifts(obj.config, obj.ttt_steps), min_width=min_width)
    return batch if got is None else {**batch, "origins": got[0], "origins_valid": got[1]}


def head_loss(trainable, frozen, head_UD, batch, *, draft: HeadObjective, spec, key=None):
    """The head's loss on one batch (see the module doc); ``frozen`` = {"target": target params,
    plus the head's non-trainable own params (``head_ids``)}; ``head_UD``: the rows of the
    target's output layer over the head's tokens; ``key``: the noise of ``feature_noise`` > 0
    (`noisy_features` on the features the head reads; the regression target stays clean).
    ``batch["origins"]`` / ``["origins_valid"]`` ([B, Q], `loss_origins`): the loss is read at
    those origins only (the same loss: every position it counts is one of them), and a kind
    whose later drafting steps can run there alone (`HeadKind.origin_outputs`) runs them there."""
    obj, hc = draft, draft.config
    tp = frozen["target"]
    own = {**trainable, **{k: v for k, v in frozen.items() if k != "target"}}
    params = drafters.head_params(hc, own, tp)
    tokens, mask = batch["tokens"], batch["mask"]
    if "features" in batch:         # cached on disk with the data (`feature_states`): no target forward
        f_BTF = batch["features"]
        h_BTD = (batch["teacher_hidden"] if "teacher_hidden" in batch else           # streamed shards
                 llama_lib.norm(obj.target.config, batch["final_residual"].astype(obj.target.config.jnp_dtype),
                                tp["final_norm"]))
    else:
        h_BTD, f_BTF = _target_pass(obj, tp, tokens)
    p_logits = teacher_logits(head_UD, h_BTD, obj.target.config.final_softcap)
    f_in = f_BTF
    if obj.feature_noise > 0:
        if key is None:
            raise ValueError("head.feature_noise > 0 needs a key (make_train_step passes one)")
        f_in = noisy_features(f_BTF, len(hc.feature_layers), obj.feature_noise, key)
    terms, first = [], None
    head_c = head_UD
    if obj.compute_dtype != "float32":      # the head's own forward in low precision, its master weights float32
        low = jnp.dtype(obj.compute_dtype)
        params = jax.tree.map(lambda x: x.astype(low) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        head_c, f_in = head_UD.astype(low), f_in.astype(low)
    o_BQ = batch.get("origins")
    outs = hc.spec.train_outputs(hc, params, tokens, f_in, obj.ttt_steps, origins_BQ=o_BQ)
    at = (lambda x: x) if o_BQ is None else functools.partial(_at_origins, o_BQ)
    valid = 1.0 if o_BQ is None else batch["origins_valid"].astype(jnp.float32)
    T = tokens.shape[1]

    def shifted(k):
        """(target logits, mask) at t + k for each scored row (zero mask past the end): a gather
        at the origins, not a shifted copy of the [B, T, V] logits per step."""
        if o_BQ is None:
            return _shift(p_logits, k), _shift(mask, k)
        at_k = o_BQ + k
        return _at_origins(at_k, p_logits), _at_origins(at_k, mask) * (at_k < T) * valid

    for out, k in outs:
        if o_BQ is not None and not hc.spec.origin_outputs:
            out = at(out)
        q_logits = hc.spec.train_scores(hc, params, head_c, out).astype(jnp.float32)
        p_k, m_k = shifted(k)
        div = _divergence.divergence(spec.divergence, p_k, q_logits, spec.temperature, spec.beta)
        terms.append(_divergence.masked_mean(div, m_k))
        if first is None:
            first = (p_k, q_logits, m_k)
    loss = sum(terms) / len(terms)
    aux = {}
    extra_BT = hc.spec.extra_loss(hc, outs if o_BQ is None or hc.spec.origin_outputs else
                                  [(at(h), k) for h, k in outs], at(f_BTF), at(mask) * valid) \
        if obj.feature_weight > 0 else None
    if extra_BT is not None:                # EAGLE's feature regression (`Eagle.extra_loss`)
        reg = _divergence.masked_mean(extra_BT, at(mask) * valid)
        loss = loss + obj.feature_weight * reg
        aux["feature_loss"] = reg
    p_l, q_l, m = first
    p, q = jax.nn.softmax(p_l, -1), jax.nn.softmax(q_l, -1)
    aux.update({"loss": loss,
                "alpha_on_head": _divergence.masked_mean(jnp.sum(jnp.minimum(p, q), -1), m),
                "agreement_on_head": _divergence.masked_mean(
                    (jnp.argmax(p_l, -1) == jnp.argmax(q_l, -1)).astype(jnp.float32), m),
                "loss_tokens": jnp.sum(mask)})
    for j, t in enumerate(terms):
        aux[f"divergence_step{j + 1}"] = t
    return loss, aux


# ------------------------------------------------------------------------------ evaluation

def _eval_batch(obj: HeadObjective, params, tp, tokens_BT, steps: int):
    """Per origin o: acceptance of step 1 at temperature 1 [B, T], and per step j the head's
    argmax and the target's argmax of token x_{o+j} ([B, T, J] each). A reduced head is scored
    over its own tokens only: q = 0 elsewhere, so sum_x min(p, q) and argmax q need no more."""
    hc = obj.config
    h_BTD, f_BTF = _target_pass(obj, tp, tokens_BT)
    p_logits = obj.target.logits_from_hidden(tp, h_BTD)                 # [B, T, V]: p_t scores x_{t+1}
    outs = hc.spec.eval_outputs(hc, params, tokens_BT, f_BTF, steps)
    alpha, q_arg, p_arg = None, [], []
    for j, out in enumerate(outs):
        s, ids = drafters.head_scores(hc, params, out)
        p_j = _shift(p_logits, j)
        a = jnp.argmax(s, -1)
        q_arg.append(a if ids is None else ids[a])
        p_arg.append(jnp.argmax(p_j, -1))
        if j == 0:
            p = jax.nn.softmax(p_j, -1)
            alpha = jnp.sum(jnp.minimum(p if ids is None else p[..., ids], jax.nn.softmax(s, -1)), -1)
    return alpha, jnp.stack(q_arg, axis=-1), jnp.stack(p_arg, axis=-1)


_eval_batch_jit = jax.jit(_eval_batch, static_argnums=(0, 4))
head_eval_batch = _eval_batch_jit     # public: (objective, head params, target params, tokens_BT, steps)


def evaluate_head(obj: HeadObjective, own: dict, tp, plan, gammas) -> dict:
    """alpha_t1 (step 1), greedy agreement per step, greedy chain tokens per target pass per
    gamma, over one pass of `plan` (held-out target-greedy continuations)."""
    gammas = tuple(int(g) for g in (gammas if np.ndim(gammas) else (gammas,)))
    J = max(gammas)
    most = obj.config.spec.max_steps(obj.config)
    if most is not None:
        J = min(J, most)
    params = drafters.head_params(obj.config, own, tp)
    alpha_sum = count = 0.0
    agree_sum = np.zeros(J)
    agree_cnt = np.zeros(J)
    committed, passes = dict.fromkeys(gammas, 0), dict.fromkeys(gammas, 0)
    for i in range(plan.batches_per_epoch):
        b = plan.batch(i)
        alpha, q_arg, p_arg = _eval_batch_jit(obj, params, tp, jnp.asarray(b["tokens"]), J)
        alpha, agree = np.asarray(alpha), np.asarray(q_arg) == np.asarray(p_arg)
        m = b["mask"] > 0
        alpha_sum += float(alpha[m].sum())
        count += float(m.sum())
        for j in range(J):
            mj = np.asarray(_shift(jnp.asarray(b["mask"]), j)) > 0
            ok = m & mj
            agree_sum[j] += float(agree[..., j][ok].sum())
            agree_cnt[j] += float(ok.sum())
        for r in range(m.shape[0]):
            if not m[r].any():
                continue
            # Step j from origin o is only meaningful while o + j stays inside the continuation.
            last = int(np.flatnonzero(m[r])[-1])
            inside = np.arange(m.shape[1])[:, None] + np.arange(J)[None, :] <= last
            for g in gammas:
                c, p = chain_tokens_per_pass(agree[r] & inside, m[r], min(g, J))
                committed[g] += c
                passes[g] += p
    out = {"alpha_t1": alpha_sum / max(count, 1.0), "greedy_agreement": float(agree_sum[0] / max(agree_cnt[0], 1.0)),
           "eval_tokens": int(count)}
    for j in range(J):
        out[f"greedy_agreement_step{j + 1}"] = float(agree_sum[j] / max(agree_cnt[j], 1.0))
    for g in gammas:
        out[f"greedy_tokens_per_pass_g{g}"] = committed[g] / max(passes[g], 1)
    return out
