"""Feature-level draft heads: Medusa-1, EAGLE (1/2) and EAGLE-3 style, on the target's features.

A head reads the target's hidden features of the committed positions (`DraftContext.features`,
kept by the engine for every committed position and rolled back with the caches) and drafts
with the target's own embedding, final norm and LM head; only the head's own weights are
trained and exported (`HeadConfig.own_param_names`).

Indexing. ``f_t`` is the target's feature at position t (the residual stream after the chosen
layers, before the final norm); the target's LM head on ``norm(f_t)`` gives the distribution
of token ``x_{t+1}``. At a round with L committed tokens the engine knows ``f_0 .. f_{L-2}``
(the last committed token is the first input of the next verification pass).

* **Medusa-1** (Cai et al. 2024): K residual blocks ``h_k = f + SiLU(W_k f + b_k)`` on
  ``f_{L-2}``; head k (1-based) gives the distribution of ``x_{L-1+k}`` through the target's
  head. Each proposal is drawn from its own head independently of the others, so q_k is
  exactly the distribution it was drawn from; no autoregression, one pass per round.
* **EAGLE** (Li et al. 2024): the entry at slot s is the pair (token ``x_s``, feature of
  position s-1): ``fc([embed(x_s) ; g_{s-1}])`` (2D -> D), one decoder layer with its own KV
  cache, output ``h_s`` = the head's prediction of ``f_s``, logits of ``x_{s+1}`` from the
  target's final norm and head. ``g_{s-1}`` is the target's ``f_{s-1}`` where known, else the
  head's own ``h_{s-1}`` (drafting continues in feature space). Trained with a feature
  regression (smooth L1 to ``f_s``) plus a divergence to the target's distribution.
* **EAGLE-3 style** (Li et al. 2025): the target features are a low, a middle and a high
  layer, fused by ``fuse`` (3D -> D) before ``fc``; beyond the known prefix the head's own
  output stands in for the fused feature. No feature regression; training-time test unrolls
  several drafting steps so the head learns from its own predictions (`eagle_train_forward`).
* **EAGLE-3, published** (``eagle3_published``; Li et al. 2025, the reference code's layer,
  `specjax.drafters._eagle3`): ``fc`` (3D -> D) fuses the three features; the layer's attention
  reads the normed embedding and the normed fused feature side by side (two norms, a 2D-wide
  q/k/v), its residual adds the fused feature; the head scores with its *own* final norm and
  LM head over a draft vocabulary (``head_ids``: draft row i is target token ``head_ids[i]``,
  the reference's ``i + d2t[i]``). The layout other systems read and write
  (`specjax.drafters.load_eagle3`, `save_eagle3`). The embedding stays the target's.
* ``input_norm`` (either EAGLE kind): the embedding and the feature are RMS-normalized, each
  with its own learned weight, before ``fc`` (EAGLE-3's reference layer normalizes its two
  inputs separately before concatenating them). The target's features are raw residual
  streams, far larger than the embedding (SmolLM2-135M: RMS ~30 with a few dimensions in the
  thousands, against ~0.1), which otherwise drown the token's half of the input.

A reduced-vocabulary head (``head_size``: the target's head rows of the ``head_ids`` tokens,
-inf logit elsewhere) keeps sampling exact: q is zero off the subset, and the verifier only
needs q to be what was sampled.

The EAGLE head is a model of the `apply` protocol over its own `HeadCache`, so
`ModelDrafter`'s catch-up, rollout and commit drive it unchanged (`FeatureHeadDrafter`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import kernels
from specjax.drafters import _eagle3
from specjax.drafters._model import ModelDrafter, ModelDraftState, draw_support, expand, rollout
from specjax.drafters._protocol import Capabilities, DraftContext
from specjax.models import Llama, ModelConfig, prefill
from specjax.models import llama as llama_lib
from specjax.models.kv_cache import KVCache

EAGLE3_PUBLISHED = "eagle3_published"
HEAD_KINDS = ("medusa", "eagle", "eagle3", EAGLE3_PUBLISHED)
INIT_STD = 0.02


def default_feature_layers(kind: str, num_layers: int) -> tuple[int, ...]:
    """Medusa and EAGLE read the last layer; EAGLE-3 a low, a middle and a high layer
    (layers 2, L/2 and L-3 in 1-based terms, as in Li et al. 2025). The published EAGLE-3 head
    takes the reference's triple as it is, the outputs of layers (1, L/2 - 1, L - 4) (0-based):
    the reference captures the inputs of layers 2, L // 2 and L - 3 (SafeAILab/EAGLE,
    eagle/model/modeling_llama_kv.py), as SGLang and vLLM do by default; on a target too shallow
    for three distinct layers there (L < 7) the config must name them."""
    if kind == EAGLE3_PUBLISHED:
        return (1, num_layers // 2 - 1, num_layers - 4)
    if kind == "eagle3":
        return tuple(sorted({min(1, num_layers - 1), num_layers // 2 - 1 if num_layers > 1 else 0,
                             max(num_layers - 4, 0)}))
    return (-1,)


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Static description of a draft head over a given target (hashable)."""
    kind: str
    target: ModelConfig
    feature_layers: tuple[int, ...]
    num_heads: int = 4                  # Medusa: heads (the longest chain it drafts)
    head_size: int | None = None        # reduced-vocabulary head (None: the target's full head)
    # Inference layout: the head's matrices as `specjax.kernels` panels and its layer in the
    # target's packed layout (unrolled, fused), as the target runs on the CPU kernel. Set by
    # `load_head` for a packed target; training and export use the plain layout.
    packed: bool = False
    # EAGLE kinds: RMS-normalize the embedding and the feature before ``fc`` (module doc).
    input_norm: bool = False
    # Published EAGLE-3 only: the head layer's own dimensions (heads, head_dim, MLP width, RoPE,
    # norm eps; one layer, the target's width and vocabulary), None = the target's
    # (`_eagle3.default_layer`); and whether the head has its own embedding (a file whose
    # embedding differs from the target's) instead of the target's.
    layer: ModelConfig | None = None
    own_embedding: bool = False

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"head kind must be one of {HEAD_KINDS}, got {self.kind!r}")
        if self.kind == EAGLE3_PUBLISHED:
            self._check_published()
        elif self.layer is not None or self.own_embedding:
            raise ValueError(f"layer and own_embedding describe {EAGLE3_PUBLISHED} heads, not {self.kind!r}")
        L = self.target.num_layers
        if not self.feature_layers or any(not -L <= int(i) < L for i in self.feature_layers):
            raise ValueError(f"feature layers {self.feature_layers} must be non-empty, in [-{L}, {L}) "
                             f"(the target has {L} layers)")
        if self.kind not in ("eagle3", EAGLE3_PUBLISHED) and len(self.feature_layers) != 1:
            raise ValueError(f"a {self.kind} head reads one feature layer, got {self.feature_layers}")
        if self.kind == "medusa" and self.num_heads < 1:
            raise ValueError(f"a Medusa head needs num_heads >= 1, got {self.num_heads}")
        if self.head_size is not None and not 0 < self.head_size <= self.target.vocab_size:
            raise ValueError(f"head_size must be in [1, {self.target.vocab_size}], got {self.head_size}")
        if self.input_norm and self.kind == "medusa":
            raise ValueError("input_norm applies to EAGLE heads (their fc input); a Medusa head has none")
        if self.packed and not self.target.packed_projections:
            raise ValueError("a packed head runs beside a packed target (packed_projections=True): "
                             "its full-vocabulary head and its layer use the target's panel layout")

    def _check_published(self):
        t = self.target
        fl = tuple(int(i) for i in self.feature_layers)
        if len(fl) != 3 or list(fl) != sorted(set(fl)) or not 0 <= fl[0] <= fl[-1] < t.num_layers:
            raise ValueError(
                f"a {EAGLE3_PUBLISHED} head reads three distinct target layers in ascending order (the order "
                f"every engine concatenates them in), each in [0, {t.num_layers}), got {fl}; the default "
                f"(1, L//2 - 1, L - 4) needs a target of at least 7 layers, name them otherwise")
        if self.input_norm:
            raise ValueError(f"input_norm is the eagle/eagle3 option; a {EAGLE3_PUBLISHED} layer has its two norms")
        if self.packed:
            raise ValueError(f"a {EAGLE3_PUBLISHED} head runs in the plain layout (no kernel panels for its layer yet)")
        if self.head_size is None:              # the draft vocabulary: the whole target vocabulary
            object.__setattr__(self, "head_size", t.vocab_size)
        # Medusa's setting, meaningless here: one value, so that configs read from any file compare equal.
        object.__setattr__(self, "num_heads", 4)
        lc = self.layer_config
        if lc.hidden_size != t.hidden_size:
            raise ValueError(f"the head layer's width {lc.hidden_size} differs from the target's {t.hidden_size}: "
                             f"it reads the target's embedding")

    @classmethod
    def make(cls, kind: str, target: ModelConfig, *, num_heads: int = 4, head_size: int | None = None,
             feature_layers: tuple[int, ...] | None = None, packed: bool = False,
             input_norm: bool = False, layer: ModelConfig | None = None,
             own_embedding: bool = False) -> "HeadConfig":
        layers = default_feature_layers(kind, target.num_layers) if feature_layers is None else feature_layers
        return cls(kind=kind, target=target, feature_layers=tuple(int(i) for i in layers), num_heads=num_heads,
                   head_size=head_size, packed=packed, input_norm=bool(input_norm), layer=layer,
                   own_embedding=bool(own_embedding))

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.target.hidden_size

    @property
    def layer_config(self) -> ModelConfig:
        """The head's own decoder layer: the target's dimensions, one layer, stacked layout (the
        layout of its stored and trained weights). Published EAGLE-3: `layer` (or the target's
        dimensions), with the target's vocabulary, dtype and attention op."""
        if self.kind == EAGLE3_PUBLISHED:
            t = self.target
            base = self.layer if self.layer is not None else _eagle3.default_layer(t)
            return base.replace(vocab_size=t.vocab_size, dtype=t.dtype, attention_op=t.attention_op, num_layers=1,
                                scan_layers=False, fuse_projections=False, packed_projections=False,
                                cpu_attention=False)
        return self.target.replace(num_layers=1, scan_layers=True, fuse_projections=False,
                                   packed_projections=False)

    @property
    def run_layer_config(self) -> ModelConfig:
        """The layer's layout at inference: `layer_config`, or packed like the target's."""
        if self.kind == EAGLE3_PUBLISHED:
            return self.layer_config
        if self.packed:
            return self.target.replace(num_layers=1, scan_layers=False, fuse_projections=True,
                                       packed_projections=True)
        return self.layer_config

    @property
    def own_param_names(self) -> tuple[str, ...]:
        """The head's own parameters (what is trained and exported); the rest are the target's."""
        if self.kind == EAGLE3_PUBLISHED:
            return ("fc", "layer", "norm", "lm_head", "head_ids") + (("embed",) if self.own_embedding else ())
        if self.kind == "medusa":
            names = ("medusa_w", "medusa_b")
        else:
            names = ("fc", "layers") + (("fuse",) if self.kind == "eagle3" else ()) + \
                (("input_norm",) if self.input_norm else ())
        return names + (("head_ids",) if self.head_size is not None else ())

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "feature_layers": list(self.feature_layers), "num_heads": self.num_heads,
             "head_size": self.head_size, "input_norm": self.input_norm}
        if self.layer is not None:
            d["layer"] = _eagle3.layer_to_dict(self.layer)
        if self.own_embedding:
            d["own_embedding"] = True
        return d


def init_head_params(hc: HeadConfig, key, head_ids=None) -> dict:
    """Random own parameters of a head (normal(0.02) weights, unit norms; Medusa's W_k start
    at zero so each head starts as the target's own next-token head on the shifted feature).
    ``head_ids``: the reduced head's tokens (required iff ``hc.head_size``; a published EAGLE-3
    head: its draft vocabulary in row order, default ``arange(head_size)``)."""
    if hc.kind == EAGLE3_PUBLISHED:
        return _init_published(hc, key, head_ids)
    D, F = hc.hidden_size, hc.feature_size
    dtype = hc.target.jnp_dtype
    k1, k2, k3 = jax.random.split(key, 3)
    if hc.kind == "medusa":
        own = {"medusa_w": jnp.zeros((hc.num_heads, D, D), dtype), "medusa_b": jnp.zeros((hc.num_heads, D), dtype)}
    else:
        lc = hc.layer_config
        own = {"fc": (INIT_STD * jax.random.normal(k1, (2 * D, D), jnp.float32)).astype(dtype),
               "layers": Llama(lc).init_params(k2)["layers"]}
        if hc.kind == "eagle3":
            own["fuse"] = (INIT_STD * jax.random.normal(k3, (F, D), jnp.float32)).astype(dtype)
        if hc.input_norm:       # [embedding's, feature's] RMS-norm weights
            own["input_norm"] = jnp.ones((2, D), dtype)
    if (hc.head_size is None) != (head_ids is None):
        raise ValueError("head_ids must be given exactly when the head config has a head_size")
    if head_ids is not None:
        ids = np.unique(np.asarray(head_ids, np.int64))
        if ids.size != hc.head_size or ids[0] < 0 or ids[-1] >= hc.target.vocab_size:
            raise ValueError(f"head_ids must be {hc.head_size} distinct ids in [0, {hc.target.vocab_size})")
        own["head_ids"] = jnp.asarray(ids, jnp.int32)
    return own


def _init_published(hc: HeadConfig, key, head_ids) -> dict:
    lc, S, V = hc.layer_config, hc.head_size, hc.target.vocab_size
    k1, k2, k3, k4 = jax.random.split(key, 4)
    normal = lambda k, shape: (INIT_STD * jax.random.normal(k, shape, jnp.float32)).astype(lc.jnp_dtype)  # noqa: E731
    ids = np.arange(S, dtype=np.int64) if head_ids is None else np.asarray(head_ids, np.int64)
    if ids.shape != (S,) or np.unique(ids).size != S or ids.min() < 0 or ids.max() >= V:
        raise ValueError(f"head_ids must be {S} distinct ids in [0, {V}) (the draft vocabulary, in row order)")
    own = {"fc": normal(k1, (hc.feature_size, lc.hidden_size)), "layer": _eagle3.init_layer(lc, k2),
           "norm": jnp.ones((lc.hidden_size,), lc.jnp_dtype), "lm_head": normal(k3, (S, lc.hidden_size)),
           "head_ids": jnp.asarray(ids, jnp.int32)}
    if hc.own_embedding:
        own["embed"] = normal(k4, (V, lc.hidden_size))
    return own


def head_params(hc: HeadConfig, own: dict, target_params: dict) -> dict:
    """The parameters a head runs with: its own plus the target's embedding, final norm and LM
    head (shared arrays, not copies; a reduced head gathers its rows once, here). A packed
    head (`HeadConfig.packed`) gets its matrices as `specjax.kernels` panels and its layer in
    the target's packed layout, converted once here."""
    missing = [n for n in hc.own_param_names if n not in own]
    if missing:
        raise ValueError(f"{hc.kind} head parameters lack {missing}")
    p = {n: own[n] for n in hc.own_param_names}
    if hc.kind == EAGLE3_PUBLISHED:         # its own norm and LM head; the target's embedding unless its own
        if not hc.own_embedding:
            p["embed"] = target_params["embed"]
        return p
    p["embed"] = target_params["embed"]
    p["final_norm"] = target_params["final_norm"]
    if hc.head_size is not None:
        ids = p["head_ids"]
        p["head"] = (jnp.take(target_params["embed"], ids, axis=0) if hc.target.tie_embeddings
                     else jnp.take(target_params["lm_head"], ids, axis=1).T)
    elif not hc.target.tie_embeddings:
        p["lm_head"] = target_params["lm_head"]
    if "head_panels" in target_params and (hc.head_size is None or hc.packed):
        p["head_panels"] = target_params["head_panels"]     # a packed target's head (its layer reads it too)
    if hc.packed:
        if "head_panels" not in p:
            raise ValueError("a packed head needs the packed target's params (with 'head_panels'): "
                             "target.prepare_params(params)")
        dtype = hc.target.jnp_dtype
        if hc.head_size is not None:
            p["head"] = kernels.pack_rows(p["head"])                          # [S, D] rows -> panels of [D, S]
        if hc.kind == "medusa":
            K, D, E = p["medusa_w"].shape                                     # [K, D, E] -> panels of [D, K E]
            p["medusa_w"] = kernels.pack(jnp.transpose(p["medusa_w"], (1, 0, 2)).reshape(D, K * E).astype(dtype))
        else:
            p["fc"] = kernels.pack(p["fc"].astype(dtype))
            if "fuse" in p:
                p["fuse"] = kernels.pack(p["fuse"].astype(dtype))
            p["layers"] = llama_lib.prepare_layers(
                {k: v.astype(dtype) for k, v in p["layers"].items()}, hc.run_layer_config)
    return p


def _matmul(x, w, width: int):
    """x [..., in] @ w in float32: w a matrix [in, width], or `specjax.kernels` panels of it."""
    if jnp.ndim(w) == 3:
        return kernels.matmul(x, w, width)
    return jnp.einsum("...e,ed->...d", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def head_scores(hc: HeadConfig, params: dict, h_BTD) -> tuple[jax.Array, jax.Array | None]:
    """(float32 logits [B, T, S] of a feature through the target's final norm and the head's
    rows, the token ids of those rows [S] or None for the full vocabulary (S = V)). A published
    EAGLE-3 head: through its own norm and LM head over its draft vocabulary."""
    if hc.kind == EAGLE3_PUBLISHED:
        x = llama_lib.rms_norm(h_BTD, params["norm"], hc.layer_config.rms_eps)
        s = jnp.einsum("btd,sd->bts", x, params["lm_head"].astype(x.dtype), preferred_element_type=jnp.float32)
        return s, params["head_ids"]
    x = llama_lib.norm(hc.target, h_BTD, params["final_norm"])
    if hc.head_size is not None:            # the target's head rows, soft-capped as the target's logits
        if jnp.ndim(params["head"]) == 3:                                   # packed: panels
            s = kernels.matmul(x, params["head"], hc.head_size)
        else:
            s = jnp.einsum("btd,sd->bts", x, params["head"].astype(x.dtype), preferred_element_type=jnp.float32)
        return llama_lib.softcap(s, hc.target.final_softcap), params["head_ids"]
    return Llama(hc.target).logits_from_hidden(params, x), None


def head_logits(hc: HeadConfig, params: dict, h_BTD) -> jax.Array:
    """float32 logits [B, T, V] of a feature through the target's final norm and LM head (a
    reduced head: its tokens' logits, -inf elsewhere)."""
    s, ids = head_scores(hc, params, h_BTD)
    if ids is None:
        return s
    full = jnp.full(s.shape[:2] + (hc.target.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[:, :, ids].set(s)


# ------------------------------------------------------------------------------ Medusa

def medusa_features(hc: HeadConfig, params: dict, f_BTD) -> jax.Array:
    """[B, T, K, D]: head k's residual block on each feature."""
    w, b = params["medusa_w"], params["medusa_b"].astype(f_BTD.dtype)
    if hc.packed:
        K, D = b.shape                                                      # packed: panels of [D, K D]
        z = kernels.matmul(f_BTD, w, K * D).reshape(*f_BTD.shape[:-1], K, D) + b
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

    def propose(self, params, state, context: DraftContext, key_B, gamma, cfg):
        if gamma > self.config.num_heads:
            raise ValueError(f"a Medusa head with {self.config.num_heads} heads drafts at most that many "
                             f"tokens per round, asked for gamma={gamma}")
        L_B = context.lengths_B
        idx_B = jnp.maximum(L_B - 2, 0)
        f_BD = jnp.take_along_axis(context.features, idx_B[:, None, None], axis=1)[:, 0]
        f_BD = jnp.where((L_B >= 2)[:, None], f_BD, 0)
        h_BGD = medusa_features(self.config, params, f_BD[:, None])[:, 0, :gamma]
        scores_BGS, ids = head_scores(self.config, params, h_BGD)      # over the head's tokens (see draw_support)
        keys_BG = jax.vmap(lambda k: jax.random.split(k, gamma))(key_B)
        tokens_BG, q_BGV = jax.vmap(lambda k, s: draw_support(k, s, ids, cfg, self.vocab_size), in_axes=1,
                                    out_axes=1)(keys_BG, scores_BGS)
        return tokens_BG, q_BGV, state

    def commit(self, state, new_lengths_B, accepted=None):
        return state

    def propose_tree(self, *args, **kwargs):
        raise NotImplementedError("Medusa heads draft chains here; see check_tree")

    def tree_forward_passes(self, tree) -> int:
        return 1

    def check_tree(self, tree) -> None:
        raise ValueError("Medusa heads draft chains only in specjax so far: use an integer gamma")


# ------------------------------------------------------------------------------ EAGLE

@struct.dataclass
class HeadCache:
    """An EAGLE head's state: its layer's K/V, its output feature per slot, and (during a call
    only) the target's features with how many positions have them."""
    kv: KVCache
    pred_BSD: jax.Array            # the head's output at each slot (its prediction of f_s)
    true_len_B: jax.Array          # positions < true_len_B have target features
    true_BSF: Any = None           # the target's features [B, S, F] (None in stored state)
    # Static: inside a rollout, where every step reads the head's own previous output and no
    # target feature, so the features need not be carried (one-token calls only).
    drafting: bool = struct.field(pytree_node=False, default=False)

    @property
    def lengths_B(self):
        return self.kv.lengths_B

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def limit_attention(self, limit):
        return self.replace(kv=self.kv.limit_attention(limit))

    def rollback(self, lengths_B) -> "HeadCache":
        return self.replace(kv=self.kv.rollback(lengths_B))

    def truncate(self, max_lengths_B) -> "HeadCache":
        return self.replace(kv=self.kv.truncate(max_lengths_B))


def _write_slots(buf_BSD, new_BTD, start_B):
    return jax.vmap(lambda row, new, s: jax.lax.dynamic_update_slice(row, new.astype(row.dtype), (s, 0)))(
        buf_BSD, new_BTD, start_B)


def eagle_input(hc: HeadConfig, params: dict, tokens_BT, g_BTD) -> jax.Array:
    """``fc([embed(x) ; g])``, each half RMS-normalized first with ``hc.input_norm``: the head
    layer's input [B, T, D]."""
    e = jnp.take(params["embed"], tokens_BT, axis=0).astype(g_BTD.dtype)
    if hc.input_norm:
        w = params["input_norm"]
        e = llama_lib.rms_norm(e, w[0], hc.target.rms_eps).astype(g_BTD.dtype)
        g_BTD = llama_lib.rms_norm(g_BTD, w[1], hc.target.rms_eps).astype(g_BTD.dtype)
    return _matmul(jnp.concatenate([e, g_BTD], axis=-1), params["fc"], hc.hidden_size).astype(g_BTD.dtype)


def fuse_features(hc: HeadConfig, params: dict, f_BTF) -> jax.Array:
    """The target features as the head's D-wide input: EAGLE-3 fuses its layers (F -> D; the
    published head by its ``fc``)."""
    if hc.kind == EAGLE3_PUBLISHED:
        return _matmul(f_BTF, params["fc"], hc.layer_config.hidden_size).astype(f_BTF.dtype)
    if hc.kind == "eagle3":
        return _matmul(f_BTF, params["fuse"], hc.hidden_size).astype(f_BTF.dtype)
    return f_BTF


def _layer_params(hc: HeadConfig, params: dict) -> dict:
    p = {"embed": params["embed"], "final_norm": params["final_norm"], "layers": params["layers"]}
    if hc.packed:                 # a packed layer's model checks for its head's panels (never used)
        p["head_panels"] = params["head_panels"]
    return p


@dataclasses.dataclass(frozen=True)
class EagleHead:
    """The EAGLE / EAGLE-3 head as a protocol model over a `HeadCache` (chains and tree calls)."""
    config: HeadConfig

    @property
    def vocab_size(self) -> int:
        return self.config.target.vocab_size

    @property
    def layer(self) -> Llama:
        return Llama(self.config.run_layer_config)

    def init_cache(self, batch_size: int, capacity: int) -> HeadCache:
        c = self.config
        kv = (_eagle3.init_cache(c.layer_config, batch_size, capacity) if c.kind == EAGLE3_PUBLISHED
              else self.layer.init_cache(batch_size, capacity))
        return HeadCache(kv=kv,
                         pred_BSD=jnp.zeros((batch_size, capacity, c.hidden_size), c.target.jnp_dtype),
                         true_len_B=jnp.zeros((batch_size,), jnp.int32))

    def apply(self, params, tokens_BT, cache: HeadCache, num_valid_B=None, tree=None):
        """Entries for tokens at slots ``lengths_B + t``; the feature before each is the
        target's where known (``< true_len_B``), else the head's own output there (which, for
        t > 0, must already be in the cache: a call never needs its own outputs). With a tree
        block see `_apply_tree`."""
        if tree is not None:
            return self._apply_tree(params, tokens_BT, cache, tree)
        h_BTD, cache = self._chain(params, tokens_BT, cache, num_valid_B)
        return head_logits(self.config, params, h_BTD), cache

    def apply_support(self, params, tokens_BT, cache: HeadCache, num_valid_B=None):
        """`apply` with the logits over the head's own tokens only: (scores [B, T, S], the
        reduced head's token ids or None for the full vocabulary, cache); see
        `specjax.drafters.support_scores`."""
        h_BTD, cache = self._chain(params, tokens_BT, cache, num_valid_B)
        scores, ids = head_scores(self.config, params, h_BTD)
        return scores, ids, cache

    def _chain(self, params, tokens_BT, cache: HeadCache, num_valid_B):
        hc = self.config
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        B, T = tokens_BT.shape
        start_B = cache.lengths_B
        prev_BT = start_B[:, None] + jnp.arange(T)[None, :] - 1
        idx_BT1 = jnp.clip(prev_BT, 0, cache.capacity - 1)[..., None]
        pred_BTD = jnp.take_along_axis(cache.pred_BSD, idx_BT1, axis=1)
        if cache.true_BSF is None:
            # Drafting steps past the committed prefix read only the head's own outputs.
            if not cache.drafting or T != 1:
                raise ValueError("the head needs the target's features in its cache for this call "
                                 "(only one-token drafting steps run without them)")
            g_BTD = pred_BTD
        else:
            true_BTF = jnp.take_along_axis(cache.true_BSF, idx_BT1, axis=1)
            g_BTD = jnp.where((prev_BT < cache.true_len_B[:, None])[..., None],
                              fuse_features(hc, params, true_BTF.astype(pred_BTD.dtype)), pred_BTD)
        g_BTD = jnp.where((prev_BT >= 0)[..., None], g_BTD, 0)
        h_BTD, kv = self._layer_call(params, tokens_BT, g_BTD, cache.kv, num_valid_B)
        return h_BTD, cache.replace(kv=kv, pred_BSD=_write_slots(cache.pred_BSD, h_BTD, start_B))

    def _layer_call(self, params, tokens_BT, g_BTD, kv, num_valid_B=None, tree=None):
        """The head's layer on (tokens, features) over its cache: (output [B, T, D], cache)."""
        hc = self.config
        if hc.kind == EAGLE3_PUBLISHED:
            e_BTD = jnp.take(params["embed"], tokens_BT, axis=0)
            return _eagle3.cached_layer(hc.layer_config, params["layer"], e_BTD, g_BTD, kv, num_valid_B, tree)
        x_BTD = eagle_input(hc, params, tokens_BT, g_BTD)
        h_BTD, _, kv = self.layer.trunk(_layer_params(hc, params), None, kv, num_valid_B, tree=tree, inputs_BTD=x_BTD)
        return h_BTD, kv

    def _apply_tree(self, params, tokens_BT, cache: HeadCache, tree):
        """One tree call (EAGLE-2 drafting): node t's input feature is its parent's head output,
        the parent being its deepest visible tentative entry (the highest visible window column:
        specjax's trees lay depths out in slot order and every node sees its ancestors), or,
        with none visible, the last committed token at slot ``lengths_B - 1``. Nodes are written
        at slots ``lengths_B + offset + t`` like any tree call; the committed slots are untouched."""
        hc = self.config
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        off, start_B = tree.offset, cache.lengths_B
        if off:
            cols = jnp.where(tree.visible_BTW[:, :, :off], jnp.arange(off, dtype=jnp.int32), -1)
            col_BT = jnp.max(cols, axis=-1)
        else:
            col_BT = jnp.full(tokens_BT.shape, -1, jnp.int32)
        parent_BT = jnp.where(col_BT >= 0, start_B[:, None] + col_BT, start_B[:, None] - 1)
        g_BTD = jnp.take_along_axis(cache.pred_BSD, jnp.clip(parent_BT, 0, cache.capacity - 1)[..., None], axis=1)
        g_BTD = jnp.where((parent_BT >= 0)[..., None], g_BTD, 0)
        h_BTD, kv = self._layer_call(params, tokens_BT, g_BTD, cache.kv, tree=tree)
        cache = cache.replace(kv=kv, pred_BSD=_write_slots(cache.pred_BSD, h_BTD, start_B + off))
        return head_logits(hc, params, h_BTD), cache


@dataclasses.dataclass(frozen=True)
class FeatureHeadDrafter(ModelDrafter):
    """An EAGLE / EAGLE-3 head driven by `ModelDrafter` (catch-up, `lax.scan` rollout, commit),
    reading the target's features from the context. Its cache keeps only entries made from
    the target's own features: after a round it is cut back to the last slot whose input
    feature was the target's, and the accepted tokens are re-ingested with their true features
    next round (as EAGLE does)."""
    model: EagleHead

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.model.config.feature_layers

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(feature_layers=self.model.config.feature_layers, own_cache=True, trees=True)

    def init(self, params, prompt_BP, prompt_lengths_B, capacity, features_BPF=None):
        if features_BPF is None:
            raise ValueError("a feature head's init needs the target's prompt features (features_BPF)")
        B, P = prompt_BP.shape
        cache = jax.lax.optimization_barrier(self.model.init_cache(B, capacity))
        true_BSF = jnp.zeros((B, capacity, features_BPF.shape[-1]), features_BPF.dtype).at[:, :P].set(features_BPF)
        cache = cache.replace(true_BSF=true_BSF, true_len_B=prompt_lengths_B - 1)
        cache = prefill(self.model, params, prompt_BP, cache, prompt_lengths_B - 1, start_bound=0)
        return ModelDraftState(cache=cache.replace(true_BSF=None))

    def _with_features(self, state, context: DraftContext):
        if context.features is None:
            raise ValueError("the engine gave no target features to a feature head (its feature_layers are unset?)")
        return state.cache.replace(true_BSF=context.features, true_len_B=context.lengths_B - 1)

    def propose(self, params, state, context: DraftContext, key_B, gamma, cfg):
        # The target's features are needed only to catch up on the committed tokens; the
        # rollout's steps read the head's own outputs, so its scan does not carry them.
        scores_BS, ids, cache = self._catch_up_support(params, self._with_features(state, context), context)
        tokens_BG, q_BGV, cache = rollout(self.model, params, cache.replace(true_BSF=None, drafting=True),
                                          scores_BS, key_B, gamma, cfg, ids)
        return tokens_BG, q_BGV, ModelDraftState(cache=cache.replace(drafting=False))

    def propose_tree(self, params, state, context: DraftContext, key_B, tree, cfg, children):
        """A static or EAGLE-2 dynamic tree from the head's own confidences (`expand`); the
        head's tentative entries are dropped at commit (they were made from its predictions)."""
        logits_BV, cache = self._catch_up(params, self._with_features(state, context), context)
        draft, q_BN1V, cache = expand(self.model, params, cache.replace(true_BSF=None, drafting=True), logits_BV,
                                      key_B, tree, cfg, children)
        return draft.replace(draft_slots_BN=None), q_BN1V, ModelDraftState(cache=cache.replace(drafting=False))

    def check_tree(self, tree) -> None:
        pass

    def commit(self, state, new_lengths_B, accepted=None):
        # Slots <= true_len (the last committed token at the round's start) were made from
        # the target's features; later ones from the head's own predictions: drop those.
        cache = state.cache
        keep_B = jnp.minimum(new_lengths_B - 1, cache.true_len_B + 1)
        return ModelDraftState(cache=cache.truncate(keep_B))


# ------------------------------------------------------------------------------ training forwards

def _one_layer(hc: HeadConfig, params: dict) -> dict:
    """The head layer's parameters as one per-layer dict (stacked layout, leading dim 1)."""
    return jax.tree.map(lambda x: x[0], params["layers"])


def eagle_train_forward(hc: HeadConfig, params: dict, tokens_BT, feats_BTF, steps: int = 1,
                        with_logits: bool = True):
    """Teacher-forced head outputs on whole sequences, cache-free: a list over drafting steps
    j = 1..steps of (h_BTD, logits_BTV), row o of step j being the draft that starts at
    position o (its first step reads the target's ``f_{o-1}``).

    Step 1 at position s: input (``x_s``, target feature ``f_{s-1}``; zeros at s = 0), causal
    attention over step-1 entries: ``h_s`` predicts ``f_s`` and its logits score ``x_{s+1}``.
    Step j > 1 (training-time test, EAGLE-3): the draft from origin o continues at position
    ``o + j - 1`` with input (``x_{o+j-1}``, the head's own step-(j-1) output of origin o),
    attending to the step-1 entries at positions <= o (the committed prefix a real draft sees)
    and to its own origin's entries of steps 2..j, exactly the visibility of drafting step j
    at inference. Its logits score ``x_{o+j}``; positions past the sequence read token 0 and
    their outputs are the caller's to mask. ``with_logits=False``: logits are None (a trainer
    scores the outputs itself, e.g. over a reduced vocabulary).

    A published EAGLE-3 head runs its own layer under the same visibility, at RoPE positions
    one less, with the entry at position 0 seen by itself only (`specjax.drafters._eagle3`)."""
    B, T = tokens_BT.shape
    lc = hc.layer_config
    published = hc.kind == EAGLE3_PUBLISHED
    lp = params["layer"] if published else _one_layer(hc, params)
    dtype = lc.jnp_dtype
    f_BTD = fuse_features(hc, params, feats_BTF.astype(dtype))
    g_BTD = jnp.concatenate([jnp.zeros((B, 1, f_BTD.shape[-1]), dtype), f_BTD[:, :-1]], axis=1)
    pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    out = []
    past_k, past_v = [], []               # per step: k [B, K, T, H], v [B, K, H, T]
    h_BTD = None
    for j in range(1, steps + 1):
        tok_BT = jnp.concatenate([tokens_BT[:, j - 1:], jnp.zeros((B, j - 1), tokens_BT.dtype)], axis=1)
        cos, sin = llama_lib.rope_cos_sin(lc, pos_BT + (j - 1) - int(published))
        if published:
            e_BTD = jnp.take(params["embed"], tok_BT, axis=0)
            run = lambda past, vis: _eagle3.layer(lc, lp, e_BTD, g_BTD, cos, sin, past, vis)  # noqa: E731
        else:
            x = eagle_input(hc, params, tok_BT, g_BTD)
            run = lambda past, vis: llama_lib._layer(lc, lp, x, cos, sin, past, vis)  # noqa: E731
        if j == 1:
            h_new, (k, v) = run(None, _eagle3.first_step_visibility(T) if published else None)
        else:
            eye_TT = jnp.eye(T, dtype=bool)
            causal_TT = jnp.tril(jnp.ones((T, T), bool))
            if published:                # the step-1 entry at position 0 is seen by nobody else
                causal_TT = causal_TT & (jnp.arange(T) >= 1)[None, :]
            vis_past = jnp.concatenate([causal_TT] + [eye_TT] * (j - 2), axis=1)       # [T, (j-1) T]
            vis_past_BTS = jnp.broadcast_to(vis_past[None], (B, T, (j - 1) * T))
            vis_new_BTT = jnp.broadcast_to(eye_TT[None], (B, T, T))
            past = (jnp.concatenate(past_k, axis=2), jnp.concatenate(past_v, axis=3), None)
            h_new, (k, v) = run(past, (vis_past_BTS, vis_new_BTT))
        past_k.append(jnp.transpose(k, (0, 2, 1, 3)))        # [B, T, K, H] -> [B, K, T, H]
        past_v.append(jnp.transpose(v, (0, 2, 3, 1)))        # -> [B, K, H, T]
        h_BTD = h_new
        out.append((h_BTD, head_logits(hc, params, h_BTD) if with_logits else None))
        g_BTD = h_BTD
    return out
