"""What every head kind shares: the static `HeadConfig`, the `HeadKind` protocol with its
registry, and the entry points for a head's parameters and scores (each the kind's answer).

A head kind is one object (`HeadKind`) in one module of this package: it validates its
settings, names, initializes and lays out its own parameters, runs its forward for drafting
(its drafter), for training (`train_outputs`, `extra_loss`) and for evaluation
(`eval_outputs`), and declares the defaults its training config takes. `HeadConfig` carries the
kind's name and delegates every kind-specific question to it, so a new kind is one module that
calls `register_head_kind` (imported by this package's ``__init__``). The defaults (a head that
scores through the target's final norm and output layer) use `_target_head`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import kernels
from specjax.drafters.heads import _eagle3_layer
from specjax.drafters.heads._target_head import check_head_ids, target_head_params, target_head_scores
from specjax.models import ModelConfig
from specjax.models import llama as llama_lib

INIT_STD = llama_lib.INIT_STD         # the scale of every head's random matrices: the models' own


# ------------------------------------------------------------------------------ the kind protocol

class HeadKind:
    """A head kind. Subclasses override what differs from a head over one target feature that
    scores through the target's final norm and output layer (the defaults here).

    Training defaults (the ``head.*`` settings of configs/distill_head.py when a config leaves
    them unset) are class attributes: ``default_ttt_steps``, ``default_feature_weight``,
    ``autoregressive`` (False: the kind drafts all tokens at once, ``ttt_steps`` must be 1),
    ``has_input_norm`` (the ``input_norm`` option applies), ``state_keys`` (the config keys that
    shape its parameters, so a training workdir only resumes under the same values)."""
    name: str = ""
    autoregressive: bool = True
    default_ttt_steps: int = 1
    default_feature_weight: float = 0.0
    has_input_norm: bool = False
    can_store: bool = True                # its matrices may be held in a linear op's form (`HeadConfig.linear_op`)
    configurable_layer: bool = False      # `HeadConfig.layer` and `own_embedding` apply
    origin_outputs: bool = False          # `train_outputs` with origins returns them at the origins only
    state_keys: tuple[str, ...] = ("head.feature_layers",)

    # -- configuration
    def default_feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return (-1,)

    def check(self, hc: "HeadConfig") -> None:
        """Kind-specific validation of a config (the generic checks ran already)."""
        if len(hc.feature_layers) != 1:
            raise ValueError(f"a {self.name} head reads one feature layer, got {hc.feature_layers}")

    def layer_config(self, hc: "HeadConfig") -> ModelConfig | None:
        """The head's own decoder layer in its stored (training) layout, None without one."""
        return None

    def run_layer_config(self, hc: "HeadConfig") -> ModelConfig | None:
        return self.layer_config(hc)

    def own_names(self, hc: "HeadConfig") -> tuple[str, ...]:
        """The head's own parameters besides ``head_ids`` (what is trained and exported)."""
        raise NotImplementedError

    # -- parameters
    def init_weights(self, hc: "HeadConfig", key) -> dict:
        """Random own weights (all own parameters but ``head_ids``)."""
        raise NotImplementedError

    def init_own(self, hc: "HeadConfig", key, head_ids=None) -> dict:
        """Random own parameters: `init_weights` and the reduced head's sorted ``head_ids``."""
        own = self.init_weights(hc, key)
        ids = check_head_ids(hc, head_ids)
        if ids is not None:
            own["head_ids"] = ids
        return own

    def run_params(self, hc: "HeadConfig", p: dict, target_params: dict) -> dict:
        """The parameters the head runs with, from its own (``p``) and the target's."""
        return target_head_params(hc, p, target_params, self.store)

    def store(self, hc: "HeadConfig", p: dict) -> dict:
        """The kind's own matrices in the stored form of ``hc.linear`` (`specjax.kernels.LinearOp`)."""
        return p

    # -- forwards
    def scores(self, hc: "HeadConfig", params: dict, h_BTD) -> tuple[jax.Array, jax.Array | None]:
        """(float32 scores [B, T, S] of head outputs, the rows' token ids [S] or None for the
        whole vocabulary)."""
        return target_head_scores(hc, params, h_BTD)

    def train_scores(self, hc: "HeadConfig", params: dict, head_UD, h_BTD) -> jax.Array:
        """Training logits [B, T, S] over the trainer's rows ``head_UD`` of the target's head."""
        x = llama_lib.norm(hc.target, h_BTD, params["final_norm"])
        s = jnp.einsum("btd,sd->bts", x, head_UD.astype(x.dtype), preferred_element_type=jnp.float32)
        return llama_lib.softcap(s, hc.target.final_softcap)

    def drafter(self, hc: "HeadConfig"):
        """The drafter that runs this head (its config as it runs: any linear op)."""
        raise NotImplementedError

    def train_outputs(self, hc: "HeadConfig", params: dict, tokens_BT, f_BTF, steps: int, origins_BQ=None) -> list:
        """[(output [B, T, D], shift)]: teacher-forced outputs on whole sequences; output at
        position t is scored against the target's distribution at position t + shift. With
        ``origins_BQ`` (int32 [B, Q], the positions the loss reads) a kind may return the outputs
        at those origins only ([B, Q, D], row q = position ``origins_BQ[b, q]``; cheaper when its
        later steps run there alone) or still at every position; the trainer takes either."""
        raise NotImplementedError

    def train_shifts(self, hc: "HeadConfig", steps: int) -> tuple[int, ...]:
        """The shifts of `train_outputs`' outputs, in order (what the trainer needs to know,
        before the step, of which origins its loss reads)."""
        raise NotImplementedError

    def eval_outputs(self, hc: "HeadConfig", params: dict, tokens_BT, f_BTF, steps: int) -> list:
        """[output [B, T, D]] per drafting step j = 1..steps, row o being the draft from origin
        o (step j scores token x_{o+j})."""
        raise NotImplementedError

    def extra_loss(self, hc: "HeadConfig", outs: list, f_BTF, mask_BT) -> jax.Array | None:
        """A loss term besides the divergence (weighted by ``feature_weight``), None if none."""
        return None

    def max_steps(self, hc: "HeadConfig") -> int | None:
        """The most tokens the head drafts per round (None: no limit)."""
        return None


_KINDS: dict[str, HeadKind] = {}


def register_head_kind(kind: HeadKind) -> HeadKind:
    """Make a head kind known by its name (what ``draft.kind`` and head.json say)."""
    if not kind.name:
        raise ValueError("a head kind needs a name")
    if kind.name in _KINDS and type(_KINDS[kind.name]) is not type(kind):
        raise ValueError(f"head kind {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def unregister_head_kind(name: str) -> None:
    """Forget a registered kind (a test's own)."""
    _KINDS.pop(name, None)


def head_kinds() -> tuple[str, ...]:
    return tuple(_KINDS)


def head_kind_of(name: str) -> HeadKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"head kind must be one of {head_kinds()}, got {name!r}") from None


# ------------------------------------------------------------------------------ the config

@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Static description of a draft head over a given target (hashable)."""
    kind: str
    target: ModelConfig
    feature_layers: tuple[int, ...]
    num_heads: int = 4                  # Medusa: heads (the longest chain it drafts)
    head_size: int | None = None        # reduced-vocabulary head (None: the target's full head)
    # Inference layout: the linear op (`specjax.kernels.LINEAR_OPS`) that stores the head's matrices,
    # "xla" (plain) or the target's, with its layer in the target's layout (unrolled, fused). Set
    # by `load_head` to the target's op; training and export use the plain layout ("xla").
    linear_op: str = "xla"
    # EAGLE kinds: RMS-normalize the embedding and the feature before ``fc``.
    input_norm: bool = False
    # Published EAGLE-3 only: the head layer's own dimensions (heads, head_dim, MLP width, RoPE,
    # norm eps; one layer, the target's width and vocabulary), None = the target's; and whether
    # the head has its own embedding (a file whose embedding differs from the target's).
    layer: ModelConfig | None = None
    own_embedding: bool = False

    def __post_init__(self):
        spec = head_kind_of(self.kind)
        if (self.layer is not None or self.own_embedding) and not spec.configurable_layer:
            raise ValueError(f"layer and own_embedding describe heads with a layer of their own dimensions "
                             f"(eagle3_published), not {self.kind!r}")
        L = self.target.num_layers
        if not self.feature_layers or any(not -L <= int(i) < L for i in self.feature_layers):
            raise ValueError(f"feature layers {self.feature_layers} must be non-empty, in [-{L}, {L}) "
                             f"(the target has {L} layers)")
        if self.head_size is not None and not 0 < self.head_size <= self.target.vocab_size:
            raise ValueError(f"head_size must be in [1, {self.target.vocab_size}], got {self.head_size}")
        if self.input_norm and not spec.has_input_norm:
            raise ValueError(f"input_norm applies to EAGLE heads (their fc input); a {self.kind} head has none")
        linear = self.linear                  # an unknown name: ValueError naming the registered ops
        if self.stored and not spec.can_store:
            raise ValueError(f"a {self.kind} head runs in the plain layout (linear_op='xla'): it cannot store "
                             f"its matrices in linear op {linear.name!r}'s form")
        if self.stored and self.linear_op != self.target.linear_op:
            raise ValueError(f"a head with linear_op={self.linear_op!r} runs beside a target of the same linear op "
                             f"(the target's linear op is {self.target.linear_op!r}): its full-vocabulary head and "
                             f"its layer use the target's layout")
        spec.check(self)

    @classmethod
    def make(cls, kind: str, target: ModelConfig, *, num_heads: int = 4, head_size: int | None = None,
             feature_layers: tuple[int, ...] | None = None, linear_op: str = "xla",
             input_norm: bool = False, layer: ModelConfig | None = None,
             own_embedding: bool = False) -> "HeadConfig":
        layers = (head_kind_of(kind).default_feature_layers(target.num_layers) if feature_layers is None
                  else feature_layers)
        return cls(kind=kind, target=target, feature_layers=tuple(int(i) for i in layers), num_heads=num_heads,
                   head_size=head_size, linear_op=linear_op, input_norm=bool(input_norm), layer=layer,
                   own_embedding=bool(own_embedding))

    @property
    def spec(self) -> HeadKind:
        """The kind's implementation."""
        return head_kind_of(self.kind)

    @property
    def linear(self):
        """The linear op (`specjax.kernels.LinearOp`) that stores the head's matrices."""
        return kernels.get_linear_op(self.linear_op)

    @property
    def stored(self) -> bool:
        """Whether the head's matrices are held in a linear op's stored form (any op but the plain "xla")."""
        return self.linear_op != "xla"

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.target.hidden_size

    @property
    def layer_config(self) -> ModelConfig | None:
        """The head's own decoder layer in its stored and trained layout (None: no layer)."""
        return self.spec.layer_config(self)

    @property
    def run_layer_config(self) -> ModelConfig | None:
        """The layer's layout at inference: `layer_config`, or the target's linear op and layout."""
        return self.spec.run_layer_config(self)

    @property
    def own_param_names(self) -> tuple[str, ...]:
        """The head's own parameters (what is trained and exported); the rest are the target's."""
        names = self.spec.own_names(self)
        return names + (("head_ids",) if self.head_size is not None and "head_ids" not in names else ())

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "feature_layers": list(self.feature_layers), "num_heads": self.num_heads,
             "head_size": self.head_size, "input_norm": self.input_norm}
        if self.layer is not None:
            d["layer"] = _eagle3_layer.layer_to_dict(self.layer)
        if self.own_embedding:
            d["own_embedding"] = True
        return d


# ------------------------------------------------------------------------------ parameters

def init_head_params(hc: HeadConfig, key, head_ids=None) -> dict:
    """Random own parameters of a head (the kind's `init_own`). ``head_ids``: the reduced
    head's tokens (required iff ``hc.head_size``; a published EAGLE-3 head: its draft
    vocabulary in row order, default ``arange(head_size)``)."""
    return hc.spec.init_own(hc, key, head_ids)


def head_params(hc: HeadConfig, own: dict, target_params: dict) -> dict:
    """The parameters a head runs with: its own plus what it shares with the target (shared
    arrays, not copies; a reduced head gathers its rows once, here). A head with a linear op
    (`HeadConfig.linear_op`) gets its matrices in that op's stored form, converted once here."""
    missing = [n for n in hc.own_param_names if n not in own]
    if missing:
        raise ValueError(f"{hc.kind} head parameters lack {missing}")
    return hc.spec.run_params(hc, {n: own[n] for n in hc.own_param_names}, target_params)


# ------------------------------------------------------------------------------ scores

def head_scores(hc: HeadConfig, params: dict, h_BTD) -> tuple[jax.Array, jax.Array | None]:
    """(float32 logits [B, T, S] of head outputs over the head's rows, the token ids of those
    rows [S] or None for the full vocabulary (S = V)). Heads without their own output layer
    score through the target's final norm and output layer; a published EAGLE-3 head through
    its own norm and LM head over its draft vocabulary."""
    return hc.spec.scores(hc, params, h_BTD)


def head_logits(hc: HeadConfig, params: dict, h_BTD) -> jax.Array:
    """float32 logits [B, T, V] of head outputs (a reduced head: its tokens' logits, -inf elsewhere)."""
    s, ids = head_scores(hc, params, h_BTD)
    if ids is None:
        return s
    full = jnp.full(s.shape[:2] + (hc.target.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[:, :, ids].set(s)
