"""Adaptive draft length: pick gamma per round from recent acceptance and a cost model.

The policy lives inside the jitted loop. Each gamma in the configured set (0 = plain target
decoding included) has its own compiled branch, chosen per round with `lax.switch`; all
branches return the same shapes (buffers sized for the largest gamma), so the loop state is
unchanged across branches.

Decision rule (Leviathan et al. 2023, §3.3, with measured instead of modelled costs): with an
acceptance estimate a, the expected committed tokens of a gamma-round are
(1 - a^(gamma+1)) / (1 - a), and its time is the calibrated round time of that gamma (per
draft source, see below), measured on the host once per model pair and carried in the policy
state. The policy picks the gamma with the least predicted time per token.

Load: the round is priced for the rows it decodes. Each active row has its own estimate (its
tested draft positions since it entered its slot, shrunk toward the regime's a by
`prior_positions`, `row_alphas`), and a candidate's committed tokens are the sum over the active
rows; the round times are those measured at the batch size the round runs at (a scheduler that
runs rounds at the size its busy rows need, `specjax.serving.Buckets`, gives the policy that
size's times). So a few busy rows in a round bound by memory traffic draft long, and a full
batch bound by compute, where a gamma-round costs close to (gamma + 1) plain rounds, runs at
gamma = 0. A draft length is one gamma for the whole batch: in a dense batch a round costs what
its widest row costs, and a row's expected committed tokens only grow with its own gamma, so a
shorter gamma for some rows would save nothing and commit less; a row budget (below) packs the
rows' positions, so there a shorter gamma saves its positions.
Hysteresis: it moves away from the current gamma only when the best one is predicted at
least `hysteresis` (relative) cheaper. The estimate a is a discounted mean of the acceptance
probability min(1, p/q) over the draft positions actually tested, forgetting per tested
position, not per round: a position tested n positions ago weighs (1 - 1/`window`)^n (the
positions of one round weigh alike), and the initial estimate counts as `initial_weight`
positions. A round tests from one position (one row at gamma 1) to rows x gamma; forgetting
per round would let a one-row round of one or two positions move the estimate as much as a
full batch's, so at low load the estimate would swing with each round's luck and price every
fresh row by the last few positions. While at gamma = 0 nothing is tested, so every
`probe_every` rounds the smallest positive gamma is tried once to refresh it.

Per-row draft lengths (`RowBudget`): a candidate that gives each row its own gamma in one
round. The round scores a fixed number of positions N (the budget: ``width`` per row, rounded up
over the batch; the target's pass packs them, `specjax.models.PackedRows`, so it costs what N
positions cost, not what the widest row's block costs), and the positions past each row's root
go to the proposals with the largest marginal expected tokens: the j-th proposal of a row with
estimate a adds a^j, which falls with j, so taking the N - B largest of {a_b^j} hands each row a
prefix (`allocate`). Rows that accept well draft long, the others short or not at all, and the
round is priced by the sum of the rows' expected tokens at their allocated gammas. The drafter
still drafts the budget's ``gamma`` for every row (the cheap part); each row's verdict is cut at
its own gamma, which is exactly a round of that gamma for the row (`specjax.decoding._round`).

Static token trees (`specjax.trees.TreeShape`) may be candidates beside the draft lengths: a
tree's expected committed tokens under the same estimate are `TreeShape.expected_tokens`
(every tried child accepted with probability a independently; for a chain it is the formula
above), and a is measured on the first child tried at each depth.

Draft sources (regimes): a drafter that picks between sources per round from the committed
tokens (`specjax.drafters.HybridDrafter`: prompt lookup where the text repeats, a model
elsewhere) names ``regimes`` R > 1 and says, per row, which source drafts this round
(``regime_B(params, context)``, read before the round from committed tokens only). The sources differ
in acceptance (lookup drafts are all-or-nothing copies) and in cost (lookup runs no model), so
the policy keeps one estimate, one current choice, one probe counter and one row of round times
per regime, and each round is priced in its batch regime: the lowest-numbered regime among the
active rows (regime 0 is the source that runs whenever any row needs it). Each regime's
estimate is updated from the tested positions of the rows that drafted from it. With R = 1
this is the single-estimate policy above. The choice still reads only what earlier rounds
committed, so every round is an exact round of a fixed gamma.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import trees as trees_lib


@dataclasses.dataclass(frozen=True)
class RowBudget:
    """An adaptive candidate with a gamma per row (module doc): rows draft up to ``gamma`` tokens,
    and the round scores ``width`` positions per row in all (the root included; 1 < width <=
    gamma + 1), handed out by `allocate`."""
    gamma: int
    width: float

    def __post_init__(self):
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"a row budget's gamma must be an int >= 1, got {self.gamma!r}")
        if not 1.0 < float(self.width) <= self.gamma + 1:
            raise ValueError(f"a row budget's width (positions scored per row, the root included) must be in "
                             f"(1, gamma + 1 = {self.gamma + 1}], got {self.width!r}")

    @property
    def max_depth(self) -> int:
        return self.gamma

    @property
    def num_nodes(self) -> int:
        return self.gamma

    def slots(self, batch: int) -> int:
        """The positions a round of ``batch`` rows scores (static)."""
        return int(min(batch * (self.gamma + 1), max(batch + 1, np.ceil(self.width * batch - 1e-9))))

    def expected_tokens(self, alpha):
        """Committed tokens per row when every row has the estimate ``alpha``: the budget's
        proposals spread evenly, ``width - 1`` per row (the fraction as the mix of the two
        nearest gammas)."""
        extra = float(self.width) - 1.0
        low = int(np.floor(extra))
        frac = extra - low
        high = min(low + 1, self.gamma)
        return (1.0 - frac) * expected_tokens(alpha, jnp.float32(low)) + frac * expected_tokens(alpha, jnp.float32(high))

    def __str__(self):
        return f"budget[gamma {self.gamma}, {float(self.width):g} per row]"


def allocate(budget: RowBudget, alpha_B, active_B):
    """Each row's gamma (int32 [B]) in a `RowBudget` round of B rows: the ``slots(B) - B``
    positions past the roots go to the largest marginal gains a_b^j (j = 1..gamma) of the active
    rows (equal gains: the lower j first, then the lower row, so equal estimates spread evenly);
    an inactive row gets 0. Each row's share is a prefix of its proposals, as a^j falls with j."""
    B, G = alpha_B.shape[0], budget.gamma
    extra = budget.slots(B) - B
    alpha_B = jnp.clip(alpha_B.astype(jnp.float32), 0.0, 1.0)
    gain_BG = alpha_B[:, None] ** jnp.arange(1, G + 1, dtype=jnp.float32)[None]
    # A strict order inside a row (equal gains, a = 1 or a = 0, go to the lower j first; top_k
    # takes the lower index among equal values) and inactive rows last.
    gain_BG = jnp.where(active_B[:, None], gain_BG - 1e-6 * jnp.arange(G, dtype=jnp.float32)[None], -1.0)
    _, picked = jax.lax.top_k(gain_BG.reshape(-1), extra)
    taken_BG = jnp.zeros((B * G,), bool).at[picked].set(True).reshape(B, G) & active_B[:, None]
    return jnp.sum(taken_BG, axis=1).astype(jnp.int32)


def _rows_expected(candidate, alpha_B, active_B):
    """A candidate's committed tokens summed over the active rows, each at its own estimate."""
    if isinstance(candidate, RowBudget):
        gamma_B = allocate(candidate, alpha_B, active_B)
        return jnp.sum(jnp.where(active_B, expected_tokens(alpha_B, gamma_B.astype(jnp.float32)), 0.0))
    return jnp.sum(jnp.where(active_B, expected_per_candidate(alpha_B, (candidate,))[0], 0.0))


@dataclasses.dataclass(frozen=True)
class AdaptiveGamma:
    gammas: tuple[int, ...] = (0, 1, 2, 3, 4, 6)
    # The estimate's memory, in tested draft positions: one tested n positions ago weighs (1 - 1/window)^n.
    window: float = 64.0
    hysteresis: float = 0.05
    probe_every: int = 16
    initial_alpha: float = 0.5
    # `initial_alpha` weighs as this many tested positions until real ones outweigh it.
    initial_weight: float = 8.0
    # A row's own tested positions weigh against this many at its regime's estimate (`row_alphas`).
    prior_positions: float = 8.0

    def __post_init__(self):
        lengths = [g for g in self.gammas if isinstance(g, int)]
        shapes = [g for g in self.gammas if not isinstance(g, int)]
        if not self.gammas or any(g < 0 for g in lengths) or lengths != sorted(set(lengths)):
            raise ValueError(f"gammas must be distinct, sorted and >= 0, got {self.gammas}")
        if list(self.gammas) != lengths + shapes or len(set(shapes)) != len(shapes):
            raise ValueError(f"adaptive candidates are the draft lengths (sorted) followed by distinct row budgets "
                             f"and static trees, got {self.gammas}")
        if any(not isinstance(g, (trees_lib.TreeShape, RowBudget)) for g in shapes):
            raise ValueError("adaptive drafting chooses among draft lengths, row budgets (RowBudget) and static "
                             "trees (TreeShape); a dynamic tree's size is not known before it is drafted, so it has "
                             "no cost model here")
        if not self.window >= 1.0:
            raise ValueError(f"window must be >= 1 tested position, got {self.window}")
        if not self.initial_weight > 0.0:
            raise ValueError(f"initial_weight must be > 0 positions, got {self.initial_weight}")


@struct.dataclass
class PolicyState:
    """Per regime r (R = 1 unless the drafter has several sources, see the module doc)."""
    alpha_R: jnp.ndarray           # float32 [R]: acceptance estimate
    weight_R: jnp.ndarray          # float32 [R]: the tested positions behind it (discounted)
    index_R: jnp.ndarray           # int32 [R]: the current gamma's index in `gammas`
    since_probe_R: jnp.ndarray     # int32 [R]: rounds spent at gamma = 0 since last probe
    round_time_RZ: jnp.ndarray     # float32 [R, len(gammas)]: seconds (or relative cost) of a round


def init_policy(policy: AdaptiveGamma, round_time_RZ) -> PolicyState:
    """Start at the largest gamma with the prior acceptance estimate, in every regime."""
    rt = jnp.asarray(round_time_RZ, jnp.float32)
    if rt.ndim != 2 or rt.shape[1] != len(policy.gammas):
        raise ValueError(f"round times must be [regimes, {len(policy.gammas)}], got shape {rt.shape}")
    R = rt.shape[0]
    return PolicyState(alpha_R=jnp.full((R,), policy.initial_alpha, jnp.float32),
                       weight_R=jnp.full((R,), policy.initial_weight, jnp.float32),
                       index_R=jnp.full((R,), len(policy.gammas) - 1, jnp.int32),
                       since_probe_R=jnp.zeros((R,), jnp.int32), round_time_RZ=rt)


def expected_tokens(alpha, gamma_Z):
    """(1 - a^(g+1)) / (1 - a), with the a -> 1 limit g + 1."""
    alpha = jnp.clip(alpha, 0.0, 1.0)
    near_one = alpha > 1.0 - 1e-6
    safe = jnp.where(near_one, 0.5, alpha)
    val = (1.0 - safe ** (gamma_Z + 1)) / (1.0 - safe)
    return jnp.where(near_one, gamma_Z + 1.0, val)


def expected_per_candidate(alpha, candidates):
    return jnp.stack([expected_tokens(alpha, jnp.float32(g)) if isinstance(g, int) else g.expected_tokens(jnp.clip(alpha, 0.0, 1.0))
                      for g in candidates])


def _is_zero(g) -> bool:
    return isinstance(g, int) and g == 0


def batch_regime(regime_B, active_B):
    """The round's regime: the lowest among the active rows (0 when none is active)."""
    R_big = jnp.iinfo(jnp.int32).max
    low = jnp.min(jnp.where(active_B, regime_B, R_big))
    return jnp.where(low == R_big, 0, low).astype(jnp.int32)


def row_alphas(policy: AdaptiveGamma, state: PolicyState, accepted_B, tested_B, regime_B):
    """Each row's acceptance estimate: its own tested draft positions (``accepted_B`` of
    ``tested_B``, counted since it entered its slot) shrunk toward its regime's estimate with
    the weight of `prior_positions` positions, so a fresh row starts at the regime's figure."""
    k = jnp.float32(policy.prior_positions)
    prior_B = state.alpha_R[regime_B]
    return (accepted_B.astype(jnp.float32) + k * prior_B) / (tested_B.astype(jnp.float32) + k)


def choose(policy: AdaptiveGamma, state: PolicyState, regime=0, alpha_B=None, active_B=None):
    """(index of the gamma to run this round, whether it is a probe out of gamma = 0), for a
    round in ``regime`` (traced int32 scalar).

    With ``alpha_B`` (each row's estimate, `row_alphas`) and ``active_B`` (the rows decoding this
    round), a candidate's committed tokens are summed over the active rows, each at its own
    estimate: the round is priced by what this batch, at this occupancy, would commit. Without
    them (or with no active row) the regime's single estimate prices it."""
    alpha, current = state.alpha_R[regime], state.index_R[regime]
    expected_Z = expected_per_candidate(alpha, policy.gammas)
    if alpha_B is not None:
        rows_Z = jnp.stack([_rows_expected(g, alpha_B, active_B) for g in policy.gammas])
        expected_Z = jnp.where(jnp.any(active_B), rows_Z, expected_Z)
    per_token_Z = state.round_time_RZ[regime] / expected_Z
    best = jnp.argmin(per_token_Z).astype(jnp.int32)
    keep = per_token_Z[best] > (1.0 - policy.hysteresis) * per_token_Z[current]
    chosen = jnp.where(keep, current, best)
    positive = [i for i, g in enumerate(policy.gammas) if not _is_zero(g)]
    probe = jnp.zeros((), bool)
    if _is_zero(policy.gammas[0]) and positive:
        probe = (chosen == 0) & (state.since_probe_R[regime] >= policy.probe_every)
        chosen = jnp.where(probe, jnp.int32(positive[0]), chosen)
    return chosen, probe


def update(policy: AdaptiveGamma, state: PolicyState, chosen, probe, tested_sum_R, tested_n_R, regime=0):
    """Fold this round's tested acceptance into each regime's estimate (``tested_sum_R``: the
    sum of min(1, p/q) over the positions tested in rows of that regime, ``tested_n_R`` their
    count) and remember the choice of the round's ``regime``: the old estimate's weight decays
    by (1 - 1/window) per tested position, the round's positions add one each (module doc).

    A probe round does not become the current gamma unless the policy would choose it anyway.
    """
    n_R = jnp.asarray(tested_n_R, jnp.float32)
    kept_R = state.weight_R * jnp.float32(1.0 - 1.0 / policy.window) ** n_R
    weight_R = kept_R + n_R
    alpha_R = (kept_R * state.alpha_R + jnp.asarray(tested_sum_R, jnp.float32)) / weight_R
    at_zero = (chosen == 0) & _is_zero(policy.gammas[0])
    since = jnp.where(at_zero, state.since_probe_R[regime] + 1, 0)
    index = jnp.where(probe, state.index_R[regime], chosen)
    return state.replace(alpha_R=alpha_R, weight_R=weight_R,
                         index_R=state.index_R.at[regime].set(index.astype(jnp.int32)),
                         since_probe_R=state.since_probe_R.at[regime].set(since.astype(jnp.int32)))
