"""Medusa-1 heads (Cai et al. 2024): K residual blocks on the target's last feature.

``h_k = f + SiLU(W_k f + b_k)`` on ``f_{L-2}`` (the feature of the second-to-last committed
position, the last one the engine knows); head k (1-based) gives the distribution of
``x_{L-1+k}`` through the target's final norm and output layer. Each proposal is drawn from its
own head independently of the others, so q_k is exactly the distribution it was drawn from; no
autoregression, one pass per round. Trained with head k on ``f_s`` against the target's
distribution of ``x_{s+k+1}``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters._model import draw_positions
from specjax.drafters._protocol import Capabilities, DraftContext
from specjax.drafters.heads._config import HeadConfig, HeadKind, head_logits, head_scores, register_head_kind


def medusa_features(hc: HeadConfig, params: dict, f_BTD) -> jax.Array:
    """[B, T, K, D]: head k's residual block on each feature."""
    w, b = params["medusa_w"], params["medusa_b"].astype(f_BTD.dtype)
    if hc.stored:
        K, D = b.shape                                                      # the stored form of [D, K D]
        z = hc.linear.apply(f_BTD, w, K * D).reshape(*f_BTD.shape[:-1], K, D) + b
    else:
        z = jnp.einsum("btd,kde->btke", f_BTD, w.astype(f_BTD.dtype), preferred_element_type=jnp.float32) + b
    return (f_BTD[:, :, None, :].astype(jnp.float32) + jax.nn.silu(z)).astype(f_BTD.dtype)


def medusa_logits(hc: HeadConfig, params: dict, f_BTD, num: int | None = None) -> jax.Array:
    """[B, T, K, V] logits: head k on ``f_t`` scores token ``x_{t+1+k}`` (k = 1..K; the
    target's own head on ``f_t`` scores ``x_{t+1}``)."""
    h = medusa_features(hc, params, f_BTD)
    if num is not None:
        h = h[:, :, :num]
    B, T, K, D = h.shape
    return head_logits(hc, params, h.reshape(B, T * K, D)).reshape(B, T, K, -1)


class Medusa(HeadKind):
    name = "medusa"
    autoregressive = False
    state_keys = ("head.num_heads", "head.feature_layers")

    def check(self, hc):
        super().check(hc)
        if hc.num_heads < 1:
            raise ValueError(f"a Medusa head needs num_heads >= 1, got {hc.num_heads}")

    def own_names(self, hc):
        return ("medusa_w", "medusa_b")

    def init_weights(self, hc, key):
        # W_k start at zero: each head starts as the target's own next-token head on the shifted feature.
        D, dtype = hc.hidden_size, hc.target.jnp_dtype
        return {"medusa_w": jnp.zeros((hc.num_heads, D, D), dtype), "medusa_b": jnp.zeros((hc.num_heads, D), dtype)}

    def store(self, hc, p):
        K, D, E = p["medusa_w"].shape                                     # [K, D, E] -> the stored [D, K E]
        w = jnp.transpose(p["medusa_w"], (1, 0, 2)).reshape(D, K * E).astype(hc.target.jnp_dtype)
        return {**p, "medusa_w": hc.linear.store(w)}

    def drafter(self, hc):
        return MedusaDrafter(hc)

    def train_outputs(self, hc, params, tokens_BT, f_BTF, steps, origins_BQ=None):
        h_BTJD = medusa_features(hc, params, f_BTF)        # per position: no saving from origins
        return [(h_BTJD[:, :, k], k + 1) for k in range(hc.num_heads)]

    def train_shifts(self, hc, steps):
        return tuple(range(1, hc.num_heads + 1))

    def eval_outputs(self, hc, params, tokens_BT, f_BTF, steps):
        # Origin o reads f_{o-1}: head k scores x_{o+k}.
        f_prev = jnp.concatenate([jnp.zeros_like(f_BTF[:, :1]), f_BTF[:, :-1]], axis=1)
        h_all = medusa_features(hc, params, f_prev)[:, :, :steps]           # [B, T, J, D]
        return [h_all[:, :, j] for j in range(h_all.shape[2])]

    def max_steps(self, hc):
        return hc.num_heads


MEDUSA = register_head_kind(Medusa())


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
    """Medusa-1 heads as a drafter: gamma <= K proposals from the K heads on ``f_{L-2}``."""
    config: HeadConfig

    @property
    def vocab_size(self) -> int:
        return self.config.target.vocab_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(feature_layers=self.config.feature_layers)       # no cache, chains only

    def init(self, params, prompt_BP, prompt_lengths_B, capacity, features_BPF=None):
        return None

    def forward_passes(self, gamma: int) -> int:
        return 1

    def check_gamma(self, gamma: int) -> None:
        if gamma > self.config.num_heads:
            raise ValueError(f"a Medusa head with {self.config.num_heads} heads drafts at most that many "
                             f"tokens per round, asked for gamma={gamma}")

    def propose(self, params, state, context: DraftContext, key_B, gamma, cfg):
        self.check_gamma(gamma)
        L_B = context.lengths_B
        idx_B = jnp.maximum(L_B - 2, 0)
        f_BD = jnp.take_along_axis(context.features, idx_B[:, None, None], axis=1)[:, 0]
        f_BD = jnp.where((L_B >= 2)[:, None], f_BD, 0)
        h_BGD = medusa_features(self.config, params, f_BD[:, None])[:, 0, :gamma]
        scores_BGU, ids = head_scores(self.config, params, h_BGD)      # over the head's tokens (see draw_support)
        tokens_BG, q_BGV = draw_positions(key_B, scores_BGU, ids, cfg, self.vocab_size)
        return tokens_BG, q_BGV, state

    def commit(self, state, new_lengths_B, accepted=None):
        return state

    def propose_tree(self, *args, **kwargs):
        raise NotImplementedError("Medusa heads draft chains here; see check_tree")

    def tree_forward_passes(self, tree) -> int:
        return 1

    def check_tree(self, tree) -> None:
        raise ValueError("Medusa heads draft chains only in specjax so far: use an integer gamma")
