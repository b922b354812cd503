"""Host-side validation of verifier inputs.

Decision: validation runs on the HOST, OUTSIDE jit, on concrete arrays (it pulls them to
numpy). Call it at the boundary -- in tests, tools, and the engine's debug mode before
entering the jitted decoding loop -- never inside the hot loop. There is no ``checkify``
variant: the checks need full-vocabulary reductions every round, and a checkified
function changes the jitted signature (it returns an error value the caller must throw);
the verifiers themselves are written to stay NaN-free and in-support on valid inputs, and
the property tests cover that.

Subnormal probabilities. The verifiers compute in float32, and XLA flushes subnormal float32
values (below ``np.finfo(np.float32).tiny`` ~ 1.18e-38) to zero on CPU and GPU. A drafted token
whose ``q(x)`` is subnormal is therefore, to the verifier, a token q says could not have been
drawn -- and `specjax.sampling.sample` never draws one (its log-probability is ``-inf`` after the
flush). So it is an INPUT ERROR here, the same as ``q(x) = 0``. The verifiers still never commit
a token outside p's support on such input (they treat it as ``q(x) = 0``: ratio 1 if
``p(x) > 0``, else 0), but that ratio is not the ``p(x) / q(x)`` the caller meant.
"""

from __future__ import annotations

import numpy as np


def _check_distribution(name: str, x: np.ndarray, atol: float) -> None:
    if np.isnan(x).any():
        raise ValueError(f"{name} contains NaN probabilities (first at index "
                         f"{tuple(int(i) for i in np.argwhere(np.isnan(x))[0])})")
    if np.isinf(x).any():
        raise ValueError(f"{name} contains infinite probabilities")
    if (x < 0).any():
        idx = tuple(int(i) for i in np.argwhere(x < 0)[0])
        raise ValueError(f"{name} contains negative probabilities (e.g. {float(x[idx])} "
                         f"at index {idx})")
    if x.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary axis")
    sums = x.sum(axis=-1, dtype=np.float64)
    bad = np.abs(sums - 1.0) > atol
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} rows do not sum to 1 within atol={atol}: row {idx} sums to "
                         f"{float(sums[idx])!r}")


def validate_verify_inputs(draft_tokens_BG, q_BGV, p_BG1V, *, atol: float = 1e-4,
                           check_draft_support: bool = True) -> None:
    """Raise ``ValueError`` naming the problem if the inputs of a verifier are malformed.

    Checks, in order: ranks; batch sizes agree; gamma (``draft_tokens_BG.shape[1]``) agrees
    with ``q_BGV`` (G positions) and ``p_BG1V`` (G+1 positions, so G >= 0); vocab sizes of p
    and q agree; draft tokens are integers in ``[0, V)``; p and q have no NaN/inf/negative
    entries and every row sums to 1 within ``atol``; and (``check_draft_support``) every
    draft token has ``q(x) >= np.finfo(np.float32).tiny`` (a normal float32; 0 or a subnormal
    value, flushed to 0 in the verifiers' float32 arithmetic, means q is not the distribution
    the token was sampled from: see the module docstring).

    Runs on the host (numpy), outside jit. Returns None.
    """
    draft = np.asarray(draft_tokens_BG)
    q = np.asarray(q_BGV)
    p = np.asarray(p_BG1V)
    if draft.ndim != 2:
        raise ValueError(f"draft_tokens_BG must have shape [B, G], got shape {draft.shape}")
    if q.ndim != 3:
        raise ValueError(f"q_BGV must have shape [B, G, V], got shape {q.shape}")
    if p.ndim != 3:
        raise ValueError(f"p_BG1V must have shape [B, G+1, V], got shape {p.shape}")
    batch, gamma = draft.shape
    if q.shape[0] != batch or p.shape[0] != batch:
        raise ValueError(f"batch sizes disagree: draft_tokens_BG has {batch} rows, q_BGV "
                         f"{q.shape[0]}, p_BG1V {p.shape[0]}")
    if p.shape[1] < 1:
        raise ValueError(f"negative gamma: p_BG1V has {p.shape[1]} positions, it needs "
                         f"gamma + 1 >= 1 (gamma = 0 still verifies one target position)")
    if q.shape[1] != gamma:
        raise ValueError(f"gamma mismatch: draft_tokens_BG has G={gamma} positions but q_BGV "
                         f"has {q.shape[1]} (q needs G)")
    if p.shape[1] != gamma + 1:
        raise ValueError(f"gamma mismatch: draft_tokens_BG has G={gamma} positions but p_BG1V "
                         f"has {p.shape[1]} (p needs G+1={gamma + 1}, the last being the "
                         f"bonus position)")
    if p.shape[2] != q.shape[2]:
        raise ValueError(f"vocab sizes differ: p_BG1V has V={p.shape[2]}, q_BGV has "
                         f"V={q.shape[2]}")
    vocab = p.shape[2]
    if draft.size and not np.issubdtype(draft.dtype, np.integer):
        raise ValueError(f"draft tokens must be integers, got dtype {draft.dtype}")
    if draft.size and (draft.min() < 0 or draft.max() >= vocab):
        bad = np.argwhere((draft < 0) | (draft >= vocab))[0]
        raise ValueError(f"draft token out of range [0, {vocab}): {int(draft[tuple(bad)])} at "
                         f"index {tuple(int(i) for i in bad)}")
    _check_distribution("q_BGV", q, atol)
    _check_distribution("p_BG1V", p, atol)
    if check_draft_support and draft.size:
        qx = np.take_along_axis(q, draft[..., None].astype(np.int64), axis=-1)[..., 0]
        tiny = float(np.finfo(np.float32).tiny)
        if (qx < tiny).any():
            bad = tuple(int(i) for i in np.argwhere(qx < tiny)[0])
            kind = "zero" if qx[bad] == 0 else f"subnormal ({float(qx[bad])!r} < {tiny:.6g}, flushed to 0 in float32)"
            raise ValueError(f"draft token {int(draft[bad])} at index {bad} has {kind} "
                             f"probability under q_BGV: q must be the distribution the draft "
                             f"actually sampled from")
