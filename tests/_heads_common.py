"""Shared fixtures of the feature-head tests (test_heads_*.py): a tiny random Llama target,
hand-made head weights of every kind, jitted helpers and memoised runs.

Compile budget (each file must stay near its share of 90 s on 2 CPU cores): weights are made
in numpy, every helper that runs a model is jitted (eager dispatch of the tiny ops costs more
than compiling), engine programs are shared between weights / round-time tables / keys (all
arguments), and runs are memoised per process.
"""

from __future__ import annotations
import dataclasses
import functools
import itertools
import jax
import jax.numpy as jnp
import numpy as np
from specjax import decoding, drafters, models, sampling, trees
from specjax.models import llama as llama_lib
from _tabular import support_chisquare

V = 97


CFG = models.ModelConfig(vocab_size=V, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                         ffn_size=48, max_position=512, scan_layers=False)


D = CFG.hidden_size


# Layer weights are scaled up from the init's 0.02 so that the random target's greedy sequence
# depends on its context (with the raw init, a tied-embedding model mostly repeats its input).
LAYER_SCALE = 10.0


GREEDY = sampling.SamplingConfig.make(0.0)


PROMPTS = [[5], [3, 4], [7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


MAX_NEW = 16


EXTRA = 4                      # the target-only reference runs MAX_NEW + EXTRA tokens


CHUNK = 3                      # prefill chunk: the 5- and 9-token prompts are chunked


ADAPTIVE = decoding.AdaptiveGamma(gammas=(0, 1, 3), probe_every=2)


# round times per gamma (0, 1, 3): MIXED makes a low-acceptance head fall back to gamma 0 and
# probe; the others pin the policy to one gamma (the largest-index start switches at round 1)
MIXED, PIN_G1, PIN_G3 = (1.0, 1.4, 2.0), (100.0, 1.0, 100.0), (100.0, 100.0, 1.0)


TOL = dict(rtol=2e-5, atol=2e-5)


def _np_params(specs: dict, rng, layer_scale: float = 1.0, std: float = 0.02) -> dict:
    """Random canonical params in numpy (normal(std) weights, unit norms), layer projections
    times ``layer_scale``; numpy, not jax.random: nothing to compile."""
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, dict):
            out[name] = _np_params(spec, rng, layer_scale, std)
            continue
        shape, _, kind = spec
        scale = layer_scale if name.startswith("w") else 1.0
        out[name] = (np.ones(shape) if kind == "ones" else std * scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def _to_device(tree):
    return jax.tree.map(jnp.asarray, tree)


@functools.cache
def _target(scan: bool = False):
    """(model, params) of the random target in the given layout (the same weights in both).
    Layer weights are scaled up from the init's 0.02 so that the greedy sequence depends on
    its context (with the raw init, a tied-embedding model mostly repeats its input)."""
    model = models.Llama(CFG.replace(scan_layers=scan))
    canonical = _np_params(llama_lib.param_specs(CFG), np.random.default_rng(0), LAYER_SCALE)
    return model, _to_device(model.prepare_params(canonical))


@functools.cache
def _jit_apply(model):
    return jax.jit(model.apply)


@functools.cache
def _jit_features(model):
    return jax.jit(model.apply_with_features, static_argnames="layers")


def _head_config(kind: str, cfg=CFG) -> drafters.HeadConfig:
    if kind == "medusa":
        return drafters.HeadConfig.make("medusa", cfg, num_heads=3)
    if kind == "eagle_reduced":
        return drafters.HeadConfig.make("eagle", cfg, head_size=40)
    if kind == "eagle3":
        return drafters.HeadConfig.make("eagle3", cfg, feature_layers=(0, 2, -1))
    if kind == "eagle3_reduced":
        return drafters.HeadConfig.make("eagle3", cfg, feature_layers=(0, 2, -1), head_size=40)
    if kind == "parallel_reduced":
        return drafters.HeadConfig.make("parallel", cfg, feature_layers=(0, 2, -1), head_size=40, input_norm=True)
    if kind == "eagle3_norm":
        return drafters.HeadConfig.make("eagle3", cfg, feature_layers=(0, 2, -1), head_size=40, input_norm=True)
    return drafters.HeadConfig.make(kind, cfg)


def _drafter(hc: drafters.HeadConfig):
    return hc.spec.drafter(hc)


def _head_ids(hc: drafters.HeadConfig, seed: int):
    """A reduced head's tokens: the 12 the prompts use, and random others."""
    rest = np.random.default_rng(seed).permutation(np.arange(12, hc.target.vocab_size))[:hc.head_size - 12]
    return np.sort(np.concatenate([np.arange(12), rest])).astype(np.int32)


@functools.cache
def _own_params(hc: drafters.HeadConfig, mode: str, seed: int = 1, layer_scale: float = LAYER_SCALE) -> dict:
    """The head's own weights (the structure of `init_head_params`, checked in
    test_init_head_params_structure). 'zero': Medusa's init (W = 0, b = 0). 'random': random
    everywhere (the EAGLE layer's projections scaled like the target's). 'good' (EAGLE kinds):
    random, but fc (and fuse) pass the previous feature through and the layer's output
    projections are damped, so h_s is close to ``f_{s-1}`` and the head drafts like the
    target's own head one position late (accepted wherever the target repeats a token), still
    depending on every weight."""
    rng = np.random.default_rng(seed)
    Dh, F = hc.hidden_size, hc.feature_size
    if hc.kind == "medusa":
        own = {"medusa_w": np.zeros((hc.num_heads, Dh, Dh), np.float32),
               "medusa_b": np.zeros((hc.num_heads, Dh), np.float32)}
        if mode == "random":
            own = {k: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in own.items()}
    else:
        own = {"fc": (0.02 * rng.standard_normal((2 * Dh, Dh))).astype(np.float32),
               "layers": _np_params(llama_lib.param_specs(hc.layer_config)["layers"], rng, layer_scale)}
        if hc.kind in ("eagle3", "parallel"):
            own["fuse"] = (0.02 * rng.standard_normal((F, Dh))).astype(np.float32)
        if hc.kind == "parallel" and hc.num_heads > 1:
            own["block_x"] = rng.standard_normal((hc.num_heads - 1, Dh)).astype(np.float32)
        if hc.input_norm:
            own["input_norm"] = (1.0 + 0.1 * rng.standard_normal((2, Dh))).astype(np.float32)
        if mode == "good":
            eye = np.eye(Dh, dtype=np.float32)
            own["fc"][Dh:] += eye
            own["layers"]["wo"] *= 0.05
            own["layers"]["w_down"] *= 0.05
            if hc.kind == "eagle3":            # fuse picks the last listed layer's block
                own["fuse"][F - Dh:] += eye
    if hc.head_size is not None:
        own["head_ids"] = _head_ids(hc, seed)
    return _to_device(own)


def _head(kind: str, mode: str = "random", scan: bool = False):
    """(drafter, head params) on the target."""
    _, tp = _target(scan)
    hc = _head_config(kind, CFG.replace(scan_layers=scan))
    return _drafter(hc), drafters.head_params(hc, _own_params(hc, mode), tp)


def _manual_layers(model, params, tokens_BT):
    """Outputs of every layer of a cache-free forward, run by hand with `llama._layer`."""
    c = model.config.replace(scan_layers=True)
    canon = models.canonical_params(params, model.config)
    B, T = tokens_BT.shape
    h = jnp.take(canon["embed"], tokens_BT, axis=0).astype(c.jnp_dtype)
    cos, sin = llama_lib.rope_cos_sin(c, jnp.broadcast_to(jnp.arange(T)[None], (B, T)))
    outs = []
    for i in range(c.num_layers):
        h, _ = llama_lib._layer(c, jax.tree.map(lambda x: x[i], canon["layers"]), h, cos, sin, None)
        outs.append(h)
    return outs


def _want(manual, layers):
    return np.concatenate([np.asarray(manual[i % CFG.num_layers]) for i in layers], axis=-1)


LAYER_SETS = ((-1,), (0, 2, -1), (3, 1))


CACHED_LAYERS = (0, 2, -1)


@functools.partial(jax.jit, static_argnums=0)
def _feature_forwards(model, params, tok, tok2, nv, seqs):
    """Everything test 1 compares, in one program (one compile per layout)."""
    out = {"manual": _manual_layers(model, params, tok), "manual_seqs": _manual_layers(model, params, seqs),
           "apply": model.apply(params, tok, None)[0]}
    for layers in LAYER_SETS:
        logits, f, none = model.apply_with_features(params, tok, None, layers=layers)
        assert none is None
        out[str(layers)] = (logits, f)
    f_last = out[str((-1,))][1]
    out["head_on_last"] = model.logits_from_hidden(params, llama_lib.rms_norm(f_last, params["final_norm"],
                                                                              CFG.rms_eps))
    # with a cache: a ragged first call (num_valid), then a second block
    c_f, c_a = model.init_cache(3, 16), model.init_cache(3, 16)
    lf1, f1, c_f = model.apply_with_features(params, tok[:, :4], c_f, num_valid_B=nv, layers=CACHED_LAYERS)
    la1, c_a = model.apply(params, tok[:, :4], c_a, num_valid_B=nv)
    lf2, f2, c_f = model.apply_with_features(params, tok2, c_f, layers=CACHED_LAYERS)
    la2, c_a = model.apply(params, tok2, c_a)
    out["cached"] = dict(lf=(lf1, lf2), la=(la1, la2), f=(f1, f2), cf=c_f, ca=c_a)
    return out


PREFILL_VARIANTS = ((None, 0), (3, 0), (5, None))     # (chunk, start_bound); the first: one call


@functools.partial(jax.jit, static_argnums=0)
def _prefill_variants(model, params, prompt, nv):
    return [models.prefill(model, params, prompt, model.init_cache(4, 20), nv, chunk, start_bound=sb,
                           feature_layers=(1, -1)) for chunk, sb in PREFILL_VARIANTS]


def _gen(gamma, max_new=MAX_NEW, chunk=CHUNK):
    return decoding.GenerationConfig(max_new_tokens=max_new, gamma=gamma, prefill_chunk=chunk)


@functools.cache
def _target_only(prompts=tuple(map(tuple, PROMPTS))):
    """The target's greedy continuations of the prompts (PROMPTS), MAX_NEW + EXTRA tokens,
    computed cache-free (a full forward per token, independent of the engine and of any cache):
    (first MAX_NEW, all). Every chosen token beats the runner-up by > 1e-5 (the logits are ~0.1
    in size; rounding differences between cached and cache-free forwards are ~1e-7), so the
    engine cannot pick another token by rounding."""
    model, tp = _target()
    n = MAX_NEW + EXTRA
    lens = np.array([len(p) for p in prompts])
    toks = np.zeros((len(prompts), lens.max() + n), np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)] = p
    rows = np.arange(len(prompts))
    for _ in range(n):
        last = np.asarray(_jit_apply(model)(tp, toks, None)[0])[rows, lens - 1]
        top2 = np.sort(last, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 1e-5).all(), "near-tie in the reference: pick other weights"
        toks[rows, lens] = last.argmax(-1)
        lens += 1
    full = [toks[b, len(p):len(p) + n].tolist() for b, p in enumerate(prompts)]
    return [g[:MAX_NEW] for g in full], full


def _assert_target_tokens(out):
    assert out.generated() == _target_only()[0]
    assert out.statuses() == ["max_new_tokens"] * len(PROMPTS)
    m = out.metrics
    np.testing.assert_array_equal(np.asarray(m.committed_B), MAX_NEW)
    assert (np.asarray(m.accepted_B) <= np.asarray(m.proposed_B)).all()


@functools.cache
def _head_engine(kind, mode, gamma, scan=False):
    """(engine, params, batch) of a head drafter on PROMPTS (memoised)."""
    model, tp = _target(scan)
    dr, hp = _head(kind, mode, scan)
    eng = decoding.Engine(model, dr, _gen(ADAPTIVE if gamma == "adaptive" else gamma))
    return eng, decoding.EngineParams(target=tp, draft=hp), decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))


@functools.cache
def _run_head(kind, mode, gamma, scan=False, round_times=None):
    """Greedy `Engine.run` of a head drafter on PROMPTS (memoised)."""
    eng, ep, batch = _head_engine(kind, mode, gamma, scan)
    return eng.run(ep, GREEDY, batch, round_time_s=round_times)


# (kind, target layout scan?, gamma, head params, adaptive round times): one compiled adaptive
# program per kind (weights and round-time tables are arguments)
GREEDY_CASES = [
    ("medusa", True, "adaptive", "random", MIXED),
    ("medusa", True, "adaptive", "random", PIN_G1),
    ("eagle3_norm", True, "adaptive", "random", MIXED),
    ("eagle3_norm", True, "adaptive", "random", PIN_G1),
    ("eagle3_norm", True, "adaptive", "good", PIN_G1),
    ("eagle3_norm", True, "adaptive", "good", PIN_G3),
]


@dataclasses.dataclass(frozen=True)
class NaiveCommitHead(drafters.FeatureHeadDrafter):
    """BROKEN on purpose: commits like a plain draft model (keeps every committed slot,
    including those whose input feature was the head's own prediction)."""

    def commit(self, state, new_lengths_B, accepted=None):
        return drafters.ModelDraftState(cache=state.cache.truncate(new_lengths_B - 1))


def _step_through(engine, ep, batch, sampling_cfg, state=None):
    """Round by round: [(lengths before, state after as host arrays)], final state."""
    state = engine.init(ep, batch) if state is None else state
    rounds = []
    for _ in range(MAX_NEW):
        before = np.asarray(state.lengths_B)
        state, _ = engine.step(ep, sampling_cfg, state)
        rounds.append((before, jax.device_get(state)))
        if np.asarray(state.done_B).all():
            break
    return rounds, state


def _true_features(tokens_BS, layers):
    """The target's features over whole token rows, cache-free (fresh)."""
    model, tp = _target()
    return np.asarray(_jit_features(model)(tp, jnp.asarray(tokens_BS), None, layers=layers)[1])


@functools.cache
def _medusa_stepped(mode):
    """Medusa (3 heads, gamma 3, greedy) round by round on PROMPTS (memoised)."""
    model, tp = _target()
    dr, hp = _head("medusa", mode)
    eng = decoding.Engine(model, dr, _gen(3))
    batch = decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))
    return _step_through(eng, decoding.EngineParams(target=tp, draft=hp), batch, GREEDY)


def _assert_committed_features(rounds, final, layers):
    """After every round the engine's feature buffer -- the next round's
    `DraftContext.features` -- holds at every position < L - 1 exactly what a fresh cache-free
    forward over the committed tokens gives: the features computed for rejected draft
    positions were overwritten or lie past L - 1."""
    ref = _true_features(final.tokens_BS, layers)
    for _, st in rounds:
        L, feats = st.lengths_B, st.features_BSF
        for b in range(len(L)):
            np.testing.assert_allclose(feats[b, :L[b] - 1], ref[b, :L[b] - 1], rtol=1e-4, atol=1e-4)


HEAD_TREES = {"static-2x2x1": trees.TreeShape.from_branching((2, 2, 1)),
              "dynamic-k2-d3-n6": trees.DynamicTree(depth=3, topk=2, node_budget=6)}


# One cache capacity for the EAGLE engines of every gamma and tree (the one the largest tree
# needs), so that their state shapes, and the programs that take only the state (`init`, the
# fresh-prefill reference, the head's own forwards), are the same.
EAGLE_CAPACITY = max(_gen(g).slots_needed(max(map(len, PROMPTS))) for g in (3, *HEAD_TREES.values()))


@functools.cache
def _eagle_setup(mode, gamma=3):
    model, tp = _target()
    dr, hp = _head("eagle", mode)
    eng = decoding.Engine(model, dr, _gen(gamma))
    ep = decoding.EngineParams(target=tp, draft=hp)
    return eng, ep, decoding.make_batch(PROMPTS, eng.config, jax.random.key(2), capacity=EAGLE_CAPACITY)


@functools.cache
def _eagle_stepped(mode, naive=False, gamma=3):
    """The EAGLE head (gamma 3 or a tree, greedy) round by round; naive: the same init, then
    the broken commit."""
    eng, ep, batch = _eagle_setup(mode, gamma)
    state = None
    if naive:
        state = eng.init(ep, batch)
        eng = dataclasses.replace(eng, drafter=NaiveCommitHead(eng.drafter.model))
    return _step_through(eng, ep, batch, GREEDY, state)


@functools.cache
def _fresh_head_init(hc, capacity):
    head = drafters.FeatureHeadDrafter(drafters.EagleHead(hc))
    return jax.jit(lambda hp, tok, lens, f: head.init(hp, tok, lens, capacity, features_BPF=f).cache)


def _head_cache_mismatch(mode, naive=False, gamma=3):
    """After every commit compare the head's cache (K/V and output features of the slots it
    keeps) with a fresh head prefill over the committed tokens and their true features.
    Returns the largest absolute difference."""
    eng, ep, batch = _eagle_setup(mode, gamma)
    hc = eng.drafter.model.config
    rounds, _ = _eagle_stepped(mode, naive, gamma)
    worst = 0.0
    for before, st in rounds:
        if not naive:
            # cut back to the slots made from target features: those before the round's start
            np.testing.assert_array_equal(np.asarray(st.draft_state.cache.kv.lengths_B),
                                          np.minimum(st.lengths_B - 1, before))
        worst = max(worst, _kept_slots_vs_fresh(hc, ep, batch.capacity, st))
    return worst


def _kept_slots_vs_fresh(hc, ep, capacity, st):
    """The largest absolute difference between the head cache's kept slots (K/V and output
    features) in loop state `st` and a fresh head prefill over the committed tokens with their
    true features."""
    L, cache = st.lengths_B, st.draft_state.cache
    fresh = _fresh_head_init(hc, capacity)(ep.draft, st.tokens_BS, L, _true_features(st.tokens_BS, hc.feature_layers))
    kept = np.asarray(cache.kv.lengths_B)
    assert (kept <= L - 1).all()
    k, v = (np.asarray(x) for x in cache.kv.layer(0))
    fk, fv = (np.asarray(x) for x in fresh.kv.layer(0))
    pred, fpred = np.asarray(cache.pred_BSD), np.asarray(fresh.pred_BSD)
    worst = 0.0
    for b in range(len(L)):
        n = kept[b]
        worst = max(worst, np.abs(k[b, :, :n] - fk[b, :, :n]).max(initial=0),
                    np.abs(v[b, ..., :n] - fv[b, ..., :n]).max(initial=0),
                    np.abs(pred[b, :n] - fpred[b, :n]).max(initial=0))
    return worst


DV = 5


D_CFG = models.ModelConfig(vocab_size=DV, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                           ffn_size=32, max_position=64, scan_layers=True)


D_PROMPT = (1, 4, 2)


D_NEW = 4


D_GAMMA = 2


D_BATCH = 10_000              # rows per distribution run: power in test_heads_sampling's docstring


D_SEED = 2025


FAMILY_WISE_ALPHA = 1e-4


T1 = dict(temperature=1.0)


T1_FILTERED = dict(temperature=1.0, top_k=3, top_p=0.9)


D_TREE = trees.TreeShape.from_branching((2, 1))      # sampled tree: 2 children of the root (iid), 1 each


D_EXACT = {"medusa_T1_topk3_topp0.9": (T1_FILTERED, "medusa"), "eagle_reduced_head_T1": (T1, "eagle_reduced"),
           "eagle_reduced_head_T1_topk3_tree2x1": (T1_FILTERED, "eagle_reduced", D_TREE),
           "hybrid_lookup_or_eagle_reduced_T1": (T1, "hybrid"),
           "parallel_T1_topk3_topp0.9": (T1_FILTERED, "parallel"), "parallel_T1_tree2x1": (T1, "parallel", D_TREE)}


D_NEGATIVE = {"medusa_samples_at_T/2_reports_T": (T1, "misreport"),
              "hybrid_reports_the_head_q_for_lookup_drafts": (T1, "hybrid_misreport")}


PER_TEST_ALPHA = FAMILY_WISE_ALPHA / len(D_EXACT)


@dataclasses.dataclass(frozen=True)
class MisreportingMedusa(drafters.MedusaDrafter):
    """BROKEN: samples each head at temperature T/2, reports the temperature-T q (without
    filters softmax(l/T) is proportional to softmax(l/(T/2))^(1/2))."""

    def propose(self, params, state, context, key_B, gamma, cfg):
        toks, q_half, st = super().propose(params, state, context, key_B, gamma,
                                           cfg.replace(temperature=cfg.temperature / 2))
        q = jnp.sqrt(q_half)
        return toks, q / q.sum(-1, keepdims=True), st


D_HEAD_IDS = (0, 2, 4)          # the reduced EAGLE head drafts only these: q = 0 on 1 and 3


@dataclasses.dataclass(frozen=True)
class MisreportingHybrid(drafters.HybridDrafter):
    """BROKEN: proposes as the hybrid does, but reports the head's q for every row, also for
    the rows whose tokens came from prompt lookup."""

    def propose(self, params, state, context, key_B, gamma, cfg):
        toks, _, st = super().propose(params, state, context, key_B, gamma, cfg)
        _, q_head, _ = self.model.propose(params, state, context, key_B, gamma, cfg)
        return toks, q_head, st


def _hybrid(model_drafter, cls=drafters.HybridDrafter, max_ngram=2, min_match=1):
    return cls(drafters.NGramDrafter(model_drafter.vocab_size, max_ngram=max_ngram), model_drafter,
               min_match=min_match)


@functools.cache
def _dist_setup():
    """(model, target params, {kind: (head config, head params)})."""
    model = models.Llama(D_CFG)
    canonical = _np_params(llama_lib.param_specs(D_CFG), np.random.default_rng(30), layer_scale=10.0)
    canonical["embed"] *= 20.0          # tied head: peaked logits (mean max p ~0.7)
    tp = _to_device(canonical)
    heads = {}
    for kind in ("medusa", "eagle_reduced", "parallel"):
        hc = drafters.HeadConfig.make({"eagle_reduced": "eagle"}.get(kind, kind), D_CFG, num_heads=D_GAMMA)
        own = dict(_own_params(hc, "random", 31, 10.0))
        if kind == "eagle_reduced":
            hc = dataclasses.replace(hc, head_size=len(D_HEAD_IDS))
            own["head_ids"] = jnp.asarray(D_HEAD_IDS, jnp.int32)
        heads[kind] = (hc, drafters.head_params(hc, own, tp))
    return model, tp, heads


@functools.cache
def _dist_run(name):
    """(generated [B, D_NEW], rejection rate) of one configuration (memoised)."""
    samp_kw, kind, *tree = {**D_EXACT, **D_NEGATIVE}[name]
    model, tp, heads = _dist_setup()
    hc, hp = heads[{"misreport": "medusa", "hybrid": "eagle_reduced", "hybrid_misreport": "eagle_reduced"}.get(kind, kind)]
    dr = {"misreport": lambda: MisreportingMedusa(hc), "hybrid": lambda: _hybrid(_drafter(hc)),
          "hybrid_misreport": lambda: _hybrid(_drafter(hc), MisreportingHybrid)}.get(kind, lambda: _drafter(hc))()
    eng = decoding.Engine(model, dr, decoding.GenerationConfig(max_new_tokens=D_NEW, gamma=tree[0] if tree else D_GAMMA))
    batch = decoding.make_batch([list(D_PROMPT)] * D_BATCH, eng.config, jax.random.key(D_SEED))
    out = eng.run(decoding.EngineParams(target=tp, draft=hp), sampling.SamplingConfig.make(**samp_kw), batch)
    np.testing.assert_array_equal(np.asarray(out.lengths_B), len(D_PROMPT) + D_NEW)
    m = out.metrics
    rejection = 1.0 - int(np.asarray(m.accepted_B).sum()) / int(np.asarray(m.proposed_B).sum())
    return np.asarray(out.tokens_BS)[:, len(D_PROMPT):len(D_PROMPT) + D_NEW], rejection


@functools.cache
def _exact_law(samp_items):
    """Exact target-only probability of every D_NEW-token continuation (itertools.product order)."""
    model, tp, _ = _dist_setup()
    cfg = sampling.SamplingConfig.make(**dict(samp_items))
    cells = np.array(list(itertools.product(range(DV), repeat=D_NEW)))
    toks = np.concatenate([np.tile(D_PROMPT, (len(cells), 1)), cells], axis=1)
    probs = jax.jit(lambda p, t, c: sampling.probabilities(model.apply(p, t, None)[0], c))
    p = np.asarray(probs(tp, jnp.asarray(toks, jnp.int32), cfg), np.float64)
    P = len(D_PROMPT)
    law = np.ones(len(cells))
    for j in range(D_NEW):
        law *= p[np.arange(len(cells)), P - 1 + j, cells[:, j]]
    return law / law.sum()


def _law(samp_kw):
    return _exact_law(tuple(sorted(samp_kw.items())))


def _pvalue(gen_BN, law):
    """Pooled chi-square p-value (`_tabular.support_chisquare`), the number of samples in cells of exact probability 0, and
    the number of cells tested."""
    index = gen_BN @ (DV ** np.arange(D_NEW - 1, -1, -1))
    return support_chisquare(np.bincount(index, minlength=len(law)), law)


PACKED_CFG = CFG.replace(scan_layers=False, fuse_projections=True, linear_op="panels")


@functools.cache
def _packed_target():
    model = models.Llama(PACKED_CFG)
    return model, model.prepare_params(_target()[1])


def _propose_once(drafter, hp, model, tp, samp, gamma=2, seed=7):
    """(tokens, q) of one `propose` after `init` on a random 9-token context with the target's
    true features (those the engine would hand the head), both in one jitted program (op by
    op, `init` dispatched and compiled dozens of small programs)."""
    rng = np.random.default_rng(seed)
    cap, ctx = 16, 9
    toks = jnp.asarray(rng.integers(0, V, (2, cap)), jnp.int32)
    lengths = jnp.asarray([ctx, ctx - 3], jnp.int32)
    layers = drafter.feature_layers
    _, feats = _jit_features(models.Llama(CFG))(_target()[1], toks, None, layers=layers)[:2]
    keys = decoding.request_keys(jax.random.key(seed), [0, 1])

    @jax.jit
    def once(p, toks, lengths, feats, keys):
        state = drafter.init(p, toks[:, :ctx], lengths, cap, features_BPF=feats[:, :ctx])
        ctxt = drafters.DraftContext(tokens_BS=toks, lengths_B=lengths, features=feats,
                                     target_cache=model.init_cache(2, cap).rollback(lengths - 1))
        return drafter.propose(p, state, ctxt, keys, gamma, samp)[:2]

    return once(hp, toks, lengths, feats, keys)


# Rows 0 and 2 repeat themselves from the start (prompt lookup drafts them at once), rows 1
# and 3 do not (the head drafts them until their last token is one seen before: min_match 1).
HYBRID_PROMPTS = ((5, 6, 5, 6, 5), (3, 4), (7, 8, 9, 7, 8, 9, 7), (1, 2, 3, 4, 5, 6, 7, 8, 9))


@functools.cache
def _hybrid_setup():
    model, tp = _target()
    head, hp = _head("eagle", "good")
    dr = _hybrid(head, max_ngram=3, min_match=1)
    eng = decoding.Engine(model, dr, _gen(3))
    ep = decoding.EngineParams(target=tp, draft=hp)
    return eng, ep, decoding.make_batch([list(p) for p in HYBRID_PROMPTS], eng.config, jax.random.key(2))
