"""The generation loop: target-only and speculative decoding as one jitted `lax.while_loop`.

One round (all on device, no host round trip):

    key_B -> (draft, verify, next) per row             explicit split, every round
    drafter.propose (gamma tokens, q as sampled)       lax.scan inside the drafter
    target.apply([last, d_1..d_gamma])                 one (gamma+1)-token forward
    verifier (vmapped per row, each with its own key)  -> n_accepted_B, committed tokens
    write committed tokens, truncated at EOS / max_new_tokens, masked for finished rows
    caches roll back to the committed prefix (lengths only; see `rollback_to_committed`)

Target-only decoding is the same round with gamma = 0 (no draft; the verifier then samples
the one committed token from p), so both paths share prefill, logits processing, stopping
and bookkeeping. A row whose target logits hold a NaN stops with status NAN_LOGITS and keeps
what it had committed; other rows go on.

Randomness: every row carries its own key, normally `fold_in(key, request_id)`, so with a
fixed gamma a row's sample does not depend on its batch position or the batch size. With
adaptive gamma the choice of gamma is batch-wide, so the realised sample (not its
distribution, which is always the target's) can depend on the other rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import sampling as sampling_lib
from specjax import verify as verify_lib
from specjax.decoding import _adaptive
from specjax.drafters._model import rollback_to_committed
from specjax import models
from specjax.models._protocol import CacheCapacityError, check_capacity

RUNNING, EOS, MAX_TOKENS, NAN_LOGITS = 0, 1, 2, 3
STATUS_NAMES = {RUNNING: "running", EOS: "eos", MAX_TOKENS: "max_new_tokens", NAN_LOGITS: "nan_logits"}
PAD_ID = 0  # what unwritten slots of the token buffer hold (a valid id: models may read them)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Static settings (shapes and strategy choices); numeric sampling knobs live in
    `SamplingConfig` as traced values.

    gamma: a fixed draft length (0 = target-only), or `AdaptiveGamma` for a per-round choice.
    verifier: 'token' (Leviathan/Chen) or 'block' (Sun et al. 2025); greedy sampling always
      uses the greedy verifier, which the others reduce to at temperature 0.
    """
    max_new_tokens: int
    gamma: int | _adaptive.AdaptiveGamma = 4
    verifier: str = "token"
    eos_ids: tuple[int, ...] = ()
    max_rounds: int | None = None   # safety bound; default max_new_tokens (every round commits >= 1)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.gamma, int) and self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")
        if self.verifier not in ("token", "block"):
            raise ValueError(f"verifier must be 'token' or 'block', got {self.verifier!r}")

    @property
    def gammas(self) -> tuple[int, ...]:
        return self.gamma.gammas if isinstance(self.gamma, _adaptive.AdaptiveGamma) else (self.gamma,)

    @property
    def max_gamma(self) -> int:
        return max(self.gammas)


@struct.dataclass
class Metrics:
    """Per-row counters, summed over rounds in which the row was active.

    accepted counts what the verifier accepted, including tokens that EOS or max_new_tokens
    then cut off; committed counts what was written. draft_passes: gamma draft forwards per
    round for model drafters (catch-up ingests not counted), 0 for model-free drafters.
    """
    rounds_B: jax.Array
    draft_passes_B: jax.Array
    proposed_B: jax.Array
    accepted_B: jax.Array
    committed_B: jax.Array
    degenerate_residual_B: jax.Array
    accepted_at_BG: jax.Array     # accepted at draft position j
    tested_at_BG: jax.Array       # draft position j reached verification
    gamma_rounds_K: jax.Array     # rounds run with each configured gamma (batch-wide)
    invalid_draft_rounds_B: jax.Array  # rounds whose draft q was not finite (proposals discarded)

    @property
    def target_passes_B(self):
        """One target forward per round (prefill not counted)."""
        return self.rounds_B

    @property
    def wasted_B(self):
        """Proposed draft tokens that were not accepted."""
        return self.proposed_B - self.accepted_B

    def summary(self) -> dict:
        """Aggregate over rows (host side): counts, mean accepted tokens per target pass,
        acceptance rate and acceptance per draft position (accepted / reached)."""
        m = jax.device_get(self)
        passes = int(m.rounds_B.sum())
        tested_G = m.tested_at_BG.sum(0)
        return {
            "target_passes": passes, "draft_passes": int(m.draft_passes_B.sum()),
            "proposed": int(m.proposed_B.sum()), "accepted": int(m.accepted_B.sum()),
            "wasted": int(m.wasted_B.sum()), "committed": int(m.committed_B.sum()),
            "degenerate_residuals": int(m.degenerate_residual_B.sum()),
            "mean_accepted_tokens_per_pass": float(m.committed_B.sum()) / max(passes, 1),
            "acceptance_rate": float(m.accepted_B.sum()) / max(int(m.proposed_B.sum()), 1),
            "acceptance_per_position": [float(a) / max(int(t), 1) for a, t in zip(m.accepted_at_BG.sum(0), tested_G)],
            "rounds_per_gamma": [int(x) for x in m.gamma_rounds_K],
            "invalid_draft_rounds": int(m.invalid_draft_rounds_B.sum()),
        }


@struct.dataclass
class LoopState:
    tokens_BL: jax.Array
    lengths_B: jax.Array
    prompt_lengths_B: jax.Array
    done_B: jax.Array
    status_B: jax.Array
    target_cache: Any
    draft_state: Any
    key_B: jax.Array
    metrics: Metrics
    policy: Any
    round: jax.Array


@struct.dataclass
class GenerateOutput:
    tokens_BL: jax.Array          # prompt followed by generated tokens, PAD_ID after lengths
    lengths_B: jax.Array
    prompt_lengths_B: jax.Array
    status_B: jax.Array
    metrics: Metrics

    def generated(self) -> list[list[int]]:
        toks, lens, plens = (np.asarray(x) for x in (self.tokens_BL, self.lengths_B, self.prompt_lengths_B))
        return [toks[b, plens[b]:lens[b]].tolist() for b in range(toks.shape[0])]


# ----------------------------------------------------------------------------- host helpers

def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None = None, multiple: int = 1):
    """Right-pad token lists into (prompt_BP int32, prompt_lengths_B int32), checking them.

    `multiple` rounds the padded width up (e.g. 64), so prompts of similar lengths share one
    compiled program.
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError(f"prompt {lens.index(min(lens))} is empty; every prompt needs >= 1 token")
    for b, p in enumerate(prompts):
        arr = np.asarray(p, np.int64)
        if vocab_size is not None and (arr.min() < 0 or arr.max() >= vocab_size):
            raise ValueError(f"prompt {b} has token ids outside [0, {vocab_size}): "
                             f"min {arr.min()}, max {arr.max()}")
    tokens_BP, lengths_B = models.pad_prompts(prompts, pad_id=PAD_ID, multiple=multiple)
    return jnp.asarray(tokens_BP), jnp.asarray(lengths_B, jnp.int32)


def request_keys(key: jax.Array, request_ids) -> jax.Array:
    """One key per request, folded from its id: samples do not depend on batch layout."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(request_ids, jnp.uint32))


def _verifier(config: GenerationConfig, cfg: sampling_lib.SamplingConfig):
    if cfg.greedy:
        return verify_lib.GreedyVerifier()
    return verify_lib.BlockVerifier() if config.verifier == "block" else verify_lib.TokenVerifier()


def _write_rows(buf_BL, block_BK, start_B, n_B):
    """buf[b, start_b + j] = block[b, j] for j < n_b; other slots unchanged."""
    K = block_BK.shape[1]

    def one(row_L, blk_K, start, n):
        old_K = jax.lax.dynamic_slice(row_L, (start,), (K,))
        new_K = jnp.where(jnp.arange(K) < n, blk_K, old_K)
        return jax.lax.dynamic_update_slice(row_L, new_K.astype(row_L.dtype), (start,))

    return jax.vmap(one)(buf_BL, block_BK, start_B, n_B)


# ----------------------------------------------------------------------------- one round

def _round(target, target_params, drafter, draft_params, config, cfg, gamma, state: LoopState):
    """One draft-verify round with a static gamma. Returns (state, tested_mean, any_tested)."""
    B = state.tokens_BL.shape[0]
    G1 = config.max_gamma + 1
    keys_B3 = jax.vmap(lambda k: jax.random.split(k, 3))(state.key_B)
    draft_key_B, verify_key_B, next_key_B = keys_B3[:, 0], keys_B3[:, 1], keys_B3[:, 2]
    L_B = state.lengths_B
    last_B = jnp.take_along_axis(state.tokens_BL, (L_B - 1)[:, None], axis=1)[:, 0]

    V = target.vocab_size
    if gamma > 0:
        extra = {"target_cache": state.target_cache} if getattr(drafter, "reads_target_cache", False) else {}
        draft_BG, q_BGV, draft_state = drafter.propose(
            draft_params, state.draft_state, state.tokens_BL, L_B, draft_key_B, gamma, cfg, **extra)
    else:
        draft_BG = jnp.zeros((B, 0), jnp.int32)
        q_BGV = jnp.zeros((B, 0, V), jnp.float32)
        draft_state = state.draft_state
    block_BG1 = jnp.concatenate([last_B[:, None], draft_BG], axis=1)
    logits_BGV, target_cache = target.apply(target_params, block_BG1, state.target_cache)
    p_BG1V = sampling_lib.probabilities(logits_BGV, cfg)

    # Non-finite inputs. (a) A draft q that is not finite cannot be verified: the row's
    # proposals are discarded and the round commits one token sampled from p_0, exactly a
    # gamma = 0 round for that row. (b) NaN or +inf target logits: positions from the first such
    # one are replaced by a uniform p before verifying (keeps the verifier's arithmetic finite;
    # nothing from those positions is committed, see below).
    bad_p_BG1 = (jnp.isnan(logits_BGV) | jnp.isposinf(logits_BGV)).any(axis=-1)   # -inf is a legal mask
    bad_p_BG1 = jnp.cumsum(bad_p_BG1, axis=1) > 0
    p_safe_BG1V = jnp.where(bad_p_BG1[..., None], 1.0 / V, p_BG1V)
    bad_q_B = ~jnp.isfinite(q_BGV).all(axis=(1, 2)) if gamma > 0 else jnp.zeros((B,), bool)
    q_safe_BGV = jnp.where(bad_q_B[:, None, None], jax.nn.one_hot(draft_BG, V, dtype=q_BGV.dtype), q_BGV)

    verifier = _verifier(config, cfg)
    res = jax.vmap(lambda k, d, q, p: jax.tree.map(lambda x: x[0], verifier(k, d[None], q[None], p[None])))(
        verify_key_B, draft_BG, q_safe_BGV, p_safe_BG1V)
    if gamma > 0:   # bad-q rows: the gamma = 0 outcome, one token from p_0 with its own key
        fresh_key_B = jax.vmap(lambda k: jax.random.fold_in(k, 1))(verify_key_B)
        fresh_B = (jnp.argmax(p_safe_BG1V[:, 0], -1) if cfg.greedy
                   else jax.vmap(sampling_lib.sample)(fresh_key_B, p_safe_BG1V[:, 0]))
        fresh_BG1 = jnp.full_like(res.committed_BG1, verify_lib.PAD_TOKEN).at[:, 0].set(
            fresh_B.astype(res.committed_BG1.dtype))
        res = res.replace(n_accepted_B=jnp.where(bad_q_B, 0, res.n_accepted_B),
                          committed_BG1=jnp.where(bad_q_B[:, None], fresh_BG1, res.committed_BG1),
                          degenerate_residual_B=jnp.where(bad_q_B, 0, res.degenerate_residual_B))

    active_B = ~state.done_B
    j_G1 = jnp.arange(gamma + 1)
    # Non-finite target logits: only the positions whose p the verifier used (0 .. n_accepted)
    # matter. With the first one at j <= n_accepted the row keeps the j drafts accepted before
    # it (exactly what target-only decoding commits before reaching it) and stops with NAN_LOGITS.
    nan_BG1 = bad_p_BG1 & (j_G1[None] <= res.n_accepted_B[:, None])
    nan_B = nan_BG1.any(axis=1) & active_B
    remaining_B = config.max_new_tokens - (L_B - state.prompt_lengths_B)
    n_commit_B = jnp.where(nan_B, jnp.argmax(nan_BG1, axis=1), res.n_accepted_B + 1)
    n_commit_B = jnp.minimum(n_commit_B, remaining_B)
    if config.eos_ids:
        is_eos_BG1 = jnp.isin(res.committed_BG1, jnp.asarray(config.eos_ids)) & (j_G1[None] < n_commit_B[:, None])
        hit_eos_B = is_eos_BG1.any(axis=1)
        n_commit_B = jnp.where(hit_eos_B, jnp.argmax(is_eos_BG1, axis=1) + 1, n_commit_B)
    else:
        hit_eos_B = jnp.zeros((B,), bool)
    live_B = active_B & ~nan_B
    hit_eos_B = hit_eos_B & active_B
    n_commit_B = jnp.where(active_B, n_commit_B, 0).astype(jnp.int32)

    committed_BK = jnp.pad(res.committed_BG1, ((0, 0), (0, G1 - (gamma + 1))), constant_values=PAD_ID)
    tokens_BL = _write_rows(state.tokens_BL, committed_BK, L_B, n_commit_B)
    new_L_B = L_B + n_commit_B

    reached_max_B = active_B & (new_L_B - state.prompt_lengths_B >= config.max_new_tokens)
    # Whatever ends the row first in token order names its status (EOS or the limit can come
    # before a NaN position inside the same block).
    status_B = jnp.where(active_B & reached_max_B, MAX_TOKENS, state.status_B)
    status_B = jnp.where(nan_B & ~hit_eos_B & ~reached_max_B, NAN_LOGITS, status_B)
    status_B = jnp.where(hit_eos_B, EOS, status_B)
    done_B = state.done_B | nan_B | hit_eos_B | reached_max_B

    m = state.metrics
    pad_G = config.max_gamma - gamma
    drafted_B = live_B & ~bad_q_B
    n_acc_B = jnp.where(drafted_B, res.n_accepted_B, 0)
    pos_G = jnp.arange(gamma)
    accepted_at_BG = (pos_G[None] < n_acc_B[:, None]) & drafted_B[:, None]
    tested_at_BG = (pos_G[None] <= n_acc_B[:, None]) & drafted_B[:, None]
    draft_forwards = 0 if getattr(drafter, "model_free", False) else gamma
    metrics = Metrics(
        rounds_B=m.rounds_B + active_B.astype(jnp.int32),
        draft_passes_B=m.draft_passes_B + active_B.astype(jnp.int32) * draft_forwards,
        proposed_B=m.proposed_B + drafted_B.astype(jnp.int32) * gamma,
        accepted_B=m.accepted_B + n_acc_B,
        committed_B=m.committed_B + n_commit_B,
        degenerate_residual_B=m.degenerate_residual_B + jnp.where(live_B, res.degenerate_residual_B, 0),
        accepted_at_BG=m.accepted_at_BG + jnp.pad(accepted_at_BG.astype(jnp.int32), ((0, 0), (0, pad_G))),
        tested_at_BG=m.tested_at_BG + jnp.pad(tested_at_BG.astype(jnp.int32), ((0, 0), (0, pad_G))),
        gamma_rounds_K=m.gamma_rounds_K + (jnp.asarray(config.gammas) == gamma).astype(jnp.int32),
        invalid_draft_rounds_B=m.invalid_draft_rounds_B + (live_B & bad_q_B).astype(jnp.int32),
    )
    n_tested = jnp.sum(tested_at_BG)
    # alpha estimate: E_{x~q}[min(1, p(x)/q(x))] = sum_x min(p, q) (Leviathan et al. 2023, Def. 3.1),
    # from the sampled draft tokens; independent of which verifier ran.
    px_BG = jnp.take_along_axis(p_safe_BG1V[:, :gamma], draft_BG[..., None], axis=-1)[..., 0]
    qx_BG = jnp.take_along_axis(q_safe_BGV, draft_BG[..., None], axis=-1)[..., 0]
    ratio_BG = jnp.minimum(1.0, px_BG / jnp.maximum(qx_BG, 1e-30))
    tested_mean = jnp.sum(jnp.where(tested_at_BG, ratio_BG, 0.0)) / jnp.maximum(n_tested, 1)

    new_state = state.replace(
        tokens_BL=tokens_BL, lengths_B=new_L_B, done_B=done_B, status_B=status_B,
        target_cache=rollback_to_committed(target_cache, new_L_B),
        draft_state=drafter.commit(draft_state, new_L_B) if gamma > 0 else draft_state,
        key_B=next_key_B, metrics=metrics, round=state.round + 1)
    return new_state, tested_mean, n_tested > 0


def _step(target, target_params, drafter, draft_params, config, cfg, round_time_K, state):
    """One round, with gamma fixed or chosen by the adaptive policy."""
    if not isinstance(config.gamma, _adaptive.AdaptiveGamma):
        state, _, _ = _round(target, target_params, drafter, draft_params, config, cfg, config.gamma, state)
        return state
    policy = config.gamma
    chosen, probe = _adaptive.choose(policy, state.policy, round_time_K)
    branches = [
        (lambda s, g=g: _round(target, target_params, drafter, draft_params, config, cfg, g, s))
        for g in policy.gammas]
    state, tested_mean, any_tested = jax.lax.switch(chosen, branches, state)
    return state.replace(policy=_adaptive.update(policy, state.policy, chosen, probe, tested_mean, any_tested))


def _init_state(target, target_params, drafter, draft_params, config, prompt_BP, prompt_lengths_B,
                key_B, capacity):
    B, P = prompt_BP.shape
    tokens_BL = jnp.full((B, capacity), PAD_ID, jnp.int32).at[:, :P].set(prompt_BP)
    # The barrier keeps XLA from constant-folding the prefill over an all-zeros cache (it
    # otherwise spends tens of seconds of compile time folding attention over constants).
    cache = jax.lax.optimization_barrier(target.init_cache(B, capacity))
    _, cache = target.apply(target_params, prompt_BP, cache, num_valid_B=prompt_lengths_B - 1)
    draft_state = (drafter.init(draft_params, prompt_BP, prompt_lengths_B, capacity)
                   if config.max_gamma > 0 else None)
    G, K = config.max_gamma, len(config.gammas)
    zeros_B = jnp.zeros((B,), jnp.int32)
    metrics = Metrics(zeros_B, zeros_B, zeros_B, zeros_B, zeros_B, zeros_B,
                      jnp.zeros((B, G), jnp.int32), jnp.zeros((B, G), jnp.int32), jnp.zeros((K,), jnp.int32),
                      zeros_B)
    policy = None
    if isinstance(config.gamma, _adaptive.AdaptiveGamma):
        policy = _adaptive.init_policy(config.gamma, len(config.gammas) - 1)
    return LoopState(tokens_BL=tokens_BL, lengths_B=prompt_lengths_B, prompt_lengths_B=prompt_lengths_B,
                     done_B=jnp.zeros((B,), bool), status_B=zeros_B, target_cache=cache,
                     draft_state=draft_state, key_B=key_B, metrics=metrics, policy=policy,
                     round=jnp.int32(0))


def _generate(target, target_params, drafter, draft_params, config, cfg, prompt_BP, prompt_lengths_B,
              key_B, round_time_K, capacity):
    state = _init_state(target, target_params, drafter, draft_params, config, prompt_BP,
                        prompt_lengths_B, key_B, capacity)
    max_rounds = config.max_rounds or config.max_new_tokens

    def cond(s):
        return (~jnp.all(s.done_B)) & (s.round < max_rounds)

    def body(s):
        return _step(target, target_params, drafter, draft_params, config, cfg, round_time_K, s)

    state = jax.lax.while_loop(cond, body, state)
    return GenerateOutput(tokens_BL=state.tokens_BL, lengths_B=state.lengths_B,
                          prompt_lengths_B=state.prompt_lengths_B, status_B=state.status_B,
                          metrics=state.metrics)


_generate_jit = jax.jit(_generate, static_argnames=("target", "drafter", "config", "capacity"))


def capacity_for(prompt_lengths, config: GenerationConfig, multiple: int = 1) -> int:
    """Slots needed: longest prompt + max_new_tokens + gamma_max + 1 (the verification block),
    rounded up to `multiple` so that nearby prompt lengths share one compiled program."""
    need = int(max(prompt_lengths)) + config.max_new_tokens + config.max_gamma + 1
    return -(-need // multiple) * multiple


def _checked_capacity(prompt_BP, prompt_lengths_B, config, capacity):
    """Host-side capacity check before anything runs (XLA clamps out-of-range writes)."""
    plens = np.asarray(prompt_lengths_B)
    if plens.min() < 1 or plens.max() > prompt_BP.shape[1]:
        raise ValueError(f"prompt lengths must lie in [1, {prompt_BP.shape[1]}] (the padded width), "
                         f"got min {plens.min()}, max {plens.max()}")
    if capacity is None:
        # From the padded width, not the longest prompt: a static shape, so batches padded to
        # the same width share one compiled program.
        capacity = capacity_for([prompt_BP.shape[1]], config)
    check_capacity(capacity, plens, config.max_new_tokens, config.max_gamma)
    if prompt_BP.shape[1] > capacity:
        raise CacheCapacityError(f"padded prompt width {prompt_BP.shape[1]} exceeds the cache capacity {capacity}")
    return capacity


def _round_times(config, round_time_s):
    if round_time_s is None:
        # Uncalibrated default: a round costs (1 + 0.1 gamma) target tokens (cheap draft).
        return jnp.asarray([1.0 + 0.1 * g for g in config.gammas], jnp.float32)
    rt = jnp.asarray(round_time_s, jnp.float32)
    if rt.shape != (len(config.gammas),):
        raise ValueError(f"round_time_s needs one entry per gamma {config.gammas}, got shape {rt.shape}")
    return rt


def _check_pair(target, drafter, config):
    if config.max_gamma > 0 and drafter is None:
        raise ValueError("gamma > 0 needs a drafter")
    if drafter is not None and drafter.vocab_size != target.vocab_size:
        raise ValueError(f"vocab mismatch: the drafter has {drafter.vocab_size} tokens, the target "
                         f"{target.vocab_size}; speculative sampling needs a shared vocabulary")


def speculative_generate(target, target_params, drafter, draft_params, prompt_BP, prompt_lengths_B,
                         key_B, sampling: sampling_lib.SamplingConfig, config: GenerationConfig,
                         round_time_s=None, capacity: int | None = None) -> GenerateOutput:
    """Speculative decoding of a batch of right-padded prompts, fully on device.

    key_B holds one key per row (see `request_keys`). round_time_s (one per gamma in the
    adaptive set) feeds the adaptive policy; see `calibrate_round_times`.
    """
    _check_pair(target, drafter, config)
    capacity = _checked_capacity(prompt_BP, prompt_lengths_B, config, capacity)
    return _generate_jit(target, target_params, drafter, draft_params, config, sampling, prompt_BP,
                         prompt_lengths_B, key_B, _round_times(config, round_time_s), capacity)


def autoregressive_generate(target, target_params, prompt_BP, prompt_lengths_B, key_B,
                            sampling: sampling_lib.SamplingConfig, max_new_tokens: int,
                            eos_ids: tuple[int, ...] = (), capacity: int | None = None) -> GenerateOutput:
    """Target-only decoding: the same loop with gamma = 0."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, gamma=0, eos_ids=tuple(eos_ids))
    return speculative_generate(target, target_params, None, None, prompt_BP, prompt_lengths_B, key_B,
                                sampling, config, capacity=capacity)
