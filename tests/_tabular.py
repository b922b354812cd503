"""Test helpers: tabular draft/target models, exact enumeration, and chi-square testing.

Two kinds of toy "models" over a tiny vocabulary:

* tabular (order-2 Markov) tables ``T[a, b] -> dist over V`` indexed by the last two tokens,
  used for the statistical multi-round tests (vectorized over 10^5 sequences);
* prefix trees ``tree(prefix tuple) -> dist over V`` (every prefix its own distribution),
  used for exact enumeration of one verification round.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from specjax.sampling import sample
from specjax.verify import PAD_TOKEN

# Statistical family: token-level gamma=1..4 and block gamma=1..4 (8 chi-square tests).
FAMILY_WISE_ALPHA = 1e-4
FAMILY_SIZE = 8
PER_TEST_ALPHA = FAMILY_WISE_ALPHA / FAMILY_SIZE  # Bonferroni
NUM_SEQUENCES = 100_000
VOCAB = 3
START = (0, 1)  # the fixed two-token context every sequence starts from


def peaked_tables(seed: int, vocab: int = VOCAB, sharpness: float = 2.5) -> np.ndarray:
    """``[V, V, V]`` table of peaked next-token distributions given the last two tokens."""
    rng = np.random.default_rng(seed)
    logits = sharpness * rng.normal(size=(vocab, vocab, vocab))
    t = np.exp(logits - logits.max(-1, keepdims=True))
    return (t / t.sum(-1, keepdims=True)).astype(np.float32)


TARGET_TABLE = peaked_tables(11)
# The draft half-agrees with the target: acceptance ~0.7, so long accepted prefixes occur too.
DRAFT_TABLE = (0.5 * TARGET_TABLE + 0.5 * peaked_tables(22)).astype(np.float32)


def exact_sequence_probs(table: np.ndarray, n_tokens: int, start=START) -> np.ndarray:
    """Exact probability of every length-n sequence (base-V index, first token most
    significant) under target-only sampling from ``table``."""
    vocab = table.shape[-1]
    t = table.astype(np.float64)
    out = np.empty(vocab ** n_tokens)
    for idx, seq in enumerate(itertools.product(range(vocab), repeat=n_tokens)):
        ctx = list(start)
        prob = 1.0
        for y in seq:
            prob *= t[ctx[-2], ctx[-1], y]
            ctx.append(y)
        out[idx] = prob
    return out


def make_round(verifier, gamma: int, target_table, draft_table, n_buf: int):
    """A jitted speculative round for order-2 tabular models, vectorized over rows.

    State: ``buf_SL`` (tokens, START at slots 0-1) and ``len_S`` (tokens written). Returns
    ``round(key, buf, len) -> (buf, len, n_accepted_S)``.
    """
    P = jnp.asarray(target_table)
    Q = jnp.asarray(draft_table)

    @jax.jit
    def one_round(key, buf_SL, len_S):
        rows = jnp.arange(buf_SL.shape[0])
        a = buf_SL[rows, len_S - 2]
        b = buf_SL[rows, len_S - 1]
        draft_keys = jax.random.split(key, gamma + 1)
        xs, qs, ps = [], [], []
        for g in range(gamma):
            q_SV = Q[a, b]
            ps.append(P[a, b])
            x = sample(draft_keys[g], q_SV)
            xs.append(x)
            qs.append(q_SV)
            a, b = b, x
        ps.append(P[a, b])
        n_rows = buf_SL.shape[0]
        draft_SG = jnp.stack(xs, 1) if gamma else jnp.zeros((n_rows, 0), jnp.int32)
        q_SGV = jnp.stack(qs, 1) if gamma else jnp.zeros((n_rows, 0, P.shape[-1]))
        p_SG1V = jnp.stack(ps, 1)
        res = verifier(draft_keys[gamma], draft_SG, q_SGV, p_SG1V)
        slots = len_S[:, None] + jnp.arange(gamma + 1)[None, :]
        slots = jnp.where(res.committed_BG1 != PAD_TOKEN, slots, n_buf)  # dropped
        buf_SL = buf_SL.at[rows[:, None], slots].set(res.committed_BG1, mode="drop")
        return buf_SL, len_S + res.n_accepted_B + 1, res.n_accepted_B

    return one_round


def generate(verifier, gamma: int, n_tokens: int, n_seq: int = NUM_SEQUENCES, seed: int = 0,
             target_table=TARGET_TABLE, draft_table=DRAFT_TABLE):
    """Run rounds until every row has >= n_tokens new tokens. Returns (seqs [S, n], stats)."""
    n_buf = len(START) + n_tokens + gamma + 1
    one_round = make_round(verifier, gamma, target_table, draft_table, n_buf)
    buf = jnp.zeros((n_seq, n_buf), jnp.int32).at[:, : len(START)].set(jnp.asarray(START))
    length = jnp.full((n_seq,), len(START), jnp.int32)
    key = jax.random.key(seed)
    accepted, rounds = [], 0
    for _ in range(n_tokens):  # every round commits >= 1 token
        key, sub = jax.random.split(key)
        buf, length, n_acc = one_round(sub, buf, length)
        accepted.append(np.asarray(n_acc))
        rounds += 1
    assert int(jnp.min(length)) >= len(START) + n_tokens
    seqs = np.asarray(buf[:, len(START): len(START) + n_tokens])
    n_acc = np.concatenate(accepted)
    stats = {
        "mean_accepted": float(n_acc.mean()),
        "rejection_rate": float(np.mean(n_acc < gamma)),  # rounds that ended in a rejection
        "rounds": rounds,
    }
    return seqs, stats


def sequence_index(seqs: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    weights = vocab ** np.arange(seqs.shape[1] - 1, -1, -1)
    return (seqs.astype(np.int64) * weights).sum(1)


def pooled_chisquare(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0):
    """Chi-square goodness of fit; cells with expected count < min_expected are pooled."""
    n = observed.sum()
    expected = expected_probs * n
    small = expected < min_expected
    obs = list(observed[~small])
    exp = list(expected[~small])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.asarray(obs, float), np.asarray(exp, float)
    exp *= obs.sum() / exp.sum()  # exact sum equality for scipy
    return scipy.stats.chisquare(obs, exp)


def support_chisquare(observed: np.ndarray, law: np.ndarray, min_expected: float = 5.0):
    """Chi-square goodness of fit of counts against an exact law, over the law's support: cells
    of expected count < min_expected pooled (a pooled remainder still below it merged into the
    smallest other cell); samples in cells of exact probability 0 are counted apart (any is an
    error the caller asserts on). Returns (p-value, samples in impossible cells, cells tested)."""
    observed = np.asarray(observed, np.float64)
    n = observed.sum()
    impossible = int(observed[law == 0].sum())
    expected = n * law
    support = law > 0
    big = support & (expected >= min_expected)
    small = support & ~big
    obs, exp = list(observed[big]), list(expected[big])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
        if exp[-1] < min_expected:
            i = int(np.argmin(exp[:-1]))
            obs[i] += obs.pop()
            exp[i] += exp.pop()
    obs, exp = np.array(obs), np.array(exp)
    exp *= obs.sum() / exp.sum()    # zero-probability cells are reported separately
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(scipy.stats.chi2.sf(stat, len(obs) - 1)), impossible, len(obs)


def sequence_pvalue(seqs: np.ndarray, n_tokens: int, table=TARGET_TABLE) -> float:
    probs = exact_sequence_probs(table, n_tokens)
    observed = np.bincount(sequence_index(seqs), minlength=probs.size)
    return float(pooled_chisquare(observed, probs).pvalue)


# ---------------------------------------------------------------------------------------------
# Prefix-tree distributions and exact enumeration of one round.


def random_tree(seed: int, vocab: int, kind: str = "random"):
    """``tree(prefix) -> float32 [V]``: an independent random distribution for every prefix."""

    @functools.lru_cache(maxsize=None)
    def tree(prefix: tuple) -> np.ndarray:
        rng = np.random.default_rng([seed, len(prefix), *prefix])
        if kind == "random":
            d = rng.dirichlet(np.ones(vocab))
        elif kind == "peaked":
            d = rng.dirichlet(0.3 * np.ones(vocab))
        elif kind == "sparse":  # some exact zeros
            d = rng.dirichlet(np.ones(vocab)) * (rng.random(vocab) < 0.6)
            if d.sum() == 0:
                d[rng.integers(vocab)] = 1.0
        else:
            raise ValueError(kind)
        return (d / d.sum()).astype(np.float32)

    return tree


def tau_distribution(accept_prob_BG: np.ndarray, kind: str) -> np.ndarray:
    """``P(n_accepted = i | draft block)`` for i = 0..G from the reported acceptance
    probabilities: token-level/greedy ``a``, or block ``h`` (see the verifiers' docs)."""
    a = np.asarray(accept_prob_BG, np.float64)
    batch, gamma = a.shape
    out = np.zeros((batch, gamma + 1))
    if kind == "token":
        prefix = np.ones(batch)
        for i in range(gamma):
            out[:, i] = prefix * (1 - a[:, i])
            prefix = prefix * a[:, i]
        out[:, gamma] = prefix
    elif kind == "block":
        h = np.concatenate([np.ones((batch, 1)), a], axis=1)  # h_0 = 1
        for i in range(gamma + 1):
            out[:, i] = h[:, i] * np.prod(1 - h[:, i + 1:], axis=1)
    else:
        raise ValueError(kind)
    return out


def round_inputs(tree_p, tree_q, vocab: int, gamma: int):
    """All V^G draft blocks with their q (draft) and p (target) distributions."""
    blocks = np.array(list(itertools.product(range(vocab), repeat=gamma)), np.int32)
    blocks = blocks.reshape(vocab ** gamma, gamma)
    q = np.array([[tree_q(tuple(blk[:g])) for g in range(gamma)] for blk in blocks],
                 np.float32).reshape(len(blocks), gamma, vocab)
    p = np.array([[tree_p(tuple(blk[:g])) for g in range(gamma + 1)] for blk in blocks],
                 np.float32)
    block_prob = np.prod([[tree_q(tuple(blk[:g]))[blk[g]] for g in range(gamma)]
                          for blk in blocks], axis=1, dtype=np.float64).reshape(len(blocks))
    return blocks, q, p, block_prob


def exact_round_then_target(verifier, kind: str, tree_p, tree_q, vocab: int, gamma: int):
    """Exact law of G+1 tokens: one verification round, then target-only sampling to fill
    up to G+1 tokens. A verifier is exact iff this equals the target's own law.

    Returns (round_law [V^(G+1)], target_law [V^(G+1)], expected n_accepted).
    """
    blocks, q, p, block_prob = round_inputs(tree_p, tree_q, vocab, gamma)
    res = verifier(jax.random.key(0), jnp.asarray(blocks), jnp.asarray(q), jnp.asarray(p))
    tau = tau_distribution(np.asarray(res.accept_prob_BG), kind)
    residual = np.asarray(res.residual_BG1V, np.float64)
    seqs = list(itertools.product(range(vocab), repeat=gamma + 1))

    def target_prob(seq, start):
        prob = 1.0
        for j in range(start, len(seq)):
            prob *= float(tree_p(tuple(seq[:j]))[seq[j]])
        return prob

    round_law = np.zeros(len(seqs))
    target_law = np.array([target_prob(s, 0) for s in seqs])
    for si, seq in enumerate(seqs):
        total = 0.0
        for b, blk in enumerate(blocks):
            if block_prob[b] == 0:
                continue
            for i in range(gamma + 1):
                if tuple(blk[:i]) != tuple(seq[:i]) or tau[b, i] == 0:
                    continue
                total += (block_prob[b] * tau[b, i] * residual[b, i, seq[i]]
                          * target_prob(seq, i + 1))
        round_law[si] = total
    expected_accepted = float(np.sum(block_prob[:, None] * tau * np.arange(gamma + 1)))
    return round_law, target_law, expected_accepted


def continuation_pvalue(law: np.ndarray, gen_BN: np.ndarray, vocab: int, min_expected: float = 5.0):
    """`support_chisquare` of generated continuations ``gen_BN`` (rows of N token ids) against
    ``law`` over all vocab^N continuations (base-vocab index, first token most significant)."""
    n = gen_BN.shape[1]
    index = gen_BN @ (vocab ** np.arange(n - 1, -1, -1))
    return support_chisquare(np.bincount(index, minlength=len(law)), law / law.sum(), min_expected)


def memoised_by_settings(law_of):
    """``law_of(settings)`` (a dict of sampling settings -> an exact law) computed once per
    settings: the tests that judge one group of rows against its law from several angles (chain,
    tree, a negative control) share it."""
    memo = {}

    def law(settings: dict) -> np.ndarray:
        key = repr(sorted(settings.items()))
        if key not in memo:
            memo[key] = law_of(settings)
        return memo[key]
    return law
