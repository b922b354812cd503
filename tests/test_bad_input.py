"""Bad input must fail loudly or be handled exactly, never give silent wrong output
(issue 18, items 1-4). One test per item; each names what it catches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _distill_toy as toy
from _toy import TabularModel, random_table
from configs import generate
from specjax import build, decoding, distill, drafters, models, sampling, trees
from specjax import verify as verify_lib


# ------------------------------------------------------------------ item 1: tiny temperature

def test_item1_tiny_temperature_rejected_or_exact_and_bad_p_stops_the_row():
    """(a) 1e-38 is a subnormal float32 (flushed to 0 by XLA): ``SamplingConfig.make`` used to
    accept it and ``logits / T`` gave NaN probabilities; it must be a ValueError naming the
    temperature. A small *normal* temperature (1e-37, 1e-30) used to overflow ``logits / T`` to
    inf (NaN after softmax); with the max subtracted first it must give the greedy one-hot.
    (b) A p that is NaN although the logits are finite (here: a SamplingConfig built around
    ``make`` with temperature 0 and greedy off) used to pass the engine's logits-only guard, and
    every row emitted token 0 with status max_new_tokens; now each row (linear rounds with either
    verifier, target-only, tree rounds) must stop at once with NAN_LOGITS and commit nothing."""
    for bad in (1e-38, 1e-45, float("inf"), float("nan"), -1e-3):
        with pytest.raises(ValueError, match="temperature"):
            sampling.SamplingConfig.make(bad)
    logits = jnp.array([[1.0, 3.0, 2.5, -1e30], [-3e38, 3e38, 0.0, 1.0], [5.0, 5.0, -2.0, 0.0]])
    want = np.array([[0, 1, 0, 0], [0, 1, 0, 0], [0.5, 0.5, 0, 0]], np.float32)   # ties share
    for t in (sampling.MIN_TEMPERATURE, 1e-37, 1e-30):
        for kw in ({}, {"top_k": 2}, {"top_p": 0.9}):
            got = np.asarray(sampling.probabilities(logits, sampling.SamplingConfig.make(t, **kw)))
            assert np.isfinite(got).all(), (t, kw)
            np.testing.assert_allclose(got, want, atol=1e-6, err_msg=str((t, kw)))

    V = 5
    model = TabularModel(V)
    target = random_table(jax.random.key(0), V)
    draft = target + 0.5 * random_table(jax.random.key(1), V)
    broken = sampling.SamplingConfig(temperature=jnp.float32(0.0), top_k=jnp.int32(0),
                                     top_p=jnp.float32(1.0))       # greedy=False, T=0: NaN p
    assert np.isnan(np.asarray(sampling.probabilities(target[0], broken))).all()
    configs = [decoding.GenerationConfig(4, gamma=0), decoding.GenerationConfig(4, gamma=2, verifier="token"),
               decoding.GenerationConfig(4, gamma=2, verifier="block"),
               decoding.GenerationConfig(4, gamma=trees.TreeShape.from_branching((2, 1)))]
    for config in configs:
        drafter = drafters.ModelDrafter(model) if config.gamma != 0 else None
        engine = decoding.Engine(model, drafter, config)
        batch = decoding.make_batch([[1, 2], [3]], config, jax.random.key(2))
        out = engine.run(decoding.EngineParams(target=target, draft=draft if drafter else None), broken, batch)
        assert out.generated() == [[], []], config
        assert out.statuses() == ["nan_logits", "nan_logits"], config


# ------------------------------------------------------------ item 2: support of every verifier

def test_item2_committed_tokens_lie_in_target_support():
    """Draft tokens outside p's support (token 0, p = 0) with q(x) zero or subnormal (0, 1e-45,
    1e-40, 1e-39, one value per group of rows). The BlockVerifier's weight
    ``w*p < q ? w*p/q : 1`` fell back to 1 there (a subnormal q is 0 to XLA), so it committed
    token 0 in every such row; and after a zero weight a later such token brought the weight
    back to 1. Every verifier -- token, block, and the tree verifiers on the same chain -- must
    commit only tokens with p > 0; the validator must reject the input (q(x) below the smallest
    normal float32 is an input error: see `specjax.verify._validate`)."""
    V, G, B = 4, 3, 512
    rng = np.random.default_rng(0)
    q_bad_B = np.resize(np.array([0.0, 1e-45, 1e-40, 1e-39], np.float32), B)
    p = np.broadcast_to(np.array([0.0, 0.5, 0.25, 0.25], np.float32), (B, G + 1, V)).copy()
    q = np.broadcast_to(np.array([0.0, 0.4, 0.3, 0.3], np.float32), (B, G, V)).copy()
    q[..., 0] = q_bad_B[:, None]
    draft = rng.choice([0, 1], size=(B, G), p=[0.7, 0.3]).astype(np.int32)
    draft[:8] = 0                                                  # rows with only bad tokens
    u = rng.uniform(size=(B, G)).astype(np.float32)
    key = jax.random.key(7)

    def check(name, committed, n_acc):
        committed, n_acc = np.asarray(committed), np.asarray(n_acc)
        used = np.arange(G + 1)[None] <= n_acc[:, None]
        bad_rows = np.nonzero(((committed == 0) & used).any(axis=1))[0]
        assert bad_rows.size == 0, (name, bad_rows.size, sorted(set(q_bad_B[bad_rows].tolist())))

    for verifier in (verify_lib.TokenVerifier(), verify_lib.BlockVerifier()):
        for res in (verifier.verify_with_uniforms(jnp.asarray(u), key, draft, q, p), verifier(key, draft, q, p)):
            check(type(verifier).__name__, res.committed_BG1, res.n_accepted_B)
    tree = trees.DraftTree.from_shape(trees.TreeShape.chain(G), jnp.asarray(draft), "iid")
    q_tree = np.concatenate([q, np.full((B, 1, V), 1.0 / V, np.float32)], axis=1)   # leaf row unused
    for verifier in (verify_lib.RecursiveRejectionVerifier(), verify_lib.TraversalVerifier()):
        for res in (verifier.verify_with_uniforms(jnp.asarray(u), key, tree, q_tree, p), verifier(key, tree, q_tree, p)):
            check(type(verifier).__name__, res.committed_BA1, res.n_accepted_B)

    # The validator: q(x) of a drafted token below float32's smallest normal is an input error.
    for q_bad in (0.0, 1e-45, 1e-40, 1e-39):
        with pytest.raises(ValueError, match="zero|subnormal"):
            verify_lib.validate_verify_inputs(draft[:1], np.where(np.arange(V) == 0, q_bad, q[:1]), p[:1])
    ok_q = q.copy()
    ok_q[..., 0] = np.finfo(np.float32).tiny
    verify_lib.validate_verify_inputs(draft, ok_q, p)             # smallest normal: accepted


# ------------------------------------------------------------------ item 3: clip_norm = 0

def test_item3_clip_norm_zero_means_no_clipping_and_negative_is_an_error(tmp_path):
    """``optax.clip_by_global_norm(0)`` scales every update to 0: with ``optim.clip_norm = 0`` a
    run trained, reported and exported the unchanged draft. 0 now means "no clipping" (a few
    steps on a tiny model change the params, by the same amount as an unreachable clip norm);
    a negative or non-finite value is a ValueError, raised by ``train`` before it loads the
    target (the bogus target path would otherwise fail first with another error)."""
    cfg = models.ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                             head_dim=8, ffn_size=32, max_position=64)
    target = models.Llama(cfg)
    tparams = target.init_params(jax.random.key(0))
    choice = distill.DraftChoice(layers=(0,))
    draft, params = distill.build_draft(choice, target, tparams, key=jax.random.key(1))
    head = distill.teacher_head(target, tparams)
    k1, k2 = jax.random.split(jax.random.key(2))
    batch = {"tokens": jax.random.randint(k1, (2, 8), 0, 32), "mask": jnp.ones((2, 8), jnp.float32),
             "teacher_hidden": 3.0 * jax.random.normal(k2, (2, 8, 16))}

    def train(clip_norm):
        opt, _ = distill.make_optimizer(learning_rate=1e-2, warmup_steps=0, total_updates=3, clip_norm=clip_norm)
        state, frozen = distill.init_state(params, choice.trainable, opt, jax.random.key(3))
        step = distill.make_train_step(draft, distill.LossSpec("fkl"), opt)
        for _ in range(3):
            state, _ = step(state, frozen, head, batch)
        return jax.tree.map(np.asarray, state.params)

    before = jax.tree.map(np.asarray, distill.split_params(params, choice.trainable)[0])
    no_clip, huge = train(0.0), train(1e30)
    moved = sum(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(no_clip), jax.tree.leaves(before)))
    assert moved > 1e-3, moved
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), no_clip, huge)

    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clip_norm"):
            distill.make_optimizer(learning_rate=1e-2, warmup_steps=0, total_updates=3, clip_norm=bad)
    c = toy.config(target_dir=tmp_path / "no-such-target", data_path=tmp_path / "none.jsonl", data_root=tmp_path)
    c.optim.clip_norm = -1.0
    with pytest.raises(ValueError, match=r"optim\.clip_norm=-1\.0"):
        distill.train(c, tmp_path / "work", log=lambda s: None)


# ------------------------------------------------------- item 4: settings checked in every mode

@pytest.mark.parametrize("setting,value", [
    ("gamma", -1), ("adaptive_gammas", (0, -1)), ("adaptive_gammas", (3, 1)), ("tree", "branching:0"),
    ("tree", "bogus"), ("adaptive_trees", ("dynamic:2,2,3",)), ("adaptive_trees", ("paths:1",)),
    ("adaptive_budgets", (0.5,)), ("adaptive_budgets", (2.0, "x")), ("adaptive_budgets", (9.0,)),
    ("verifier", "blok"), ("tree_verifier", "bfs"), ("tree_children", "some"), ("temperature", 1e-38),
    ("temperature", -1.0), ("top_k", -2), ("top_p", 1.5), ("max_new_tokens", 0)])
def test_item4_invalid_settings_are_errors_whichever_mode_reads_them(setting, value):
    """With adaptive gamma on, ``gamma = -1`` was silently ignored (and likewise an adaptive or
    tree setting when another mode ran). Each bad setting must raise one ValueError naming it
    and its value, in every mode: fixed gamma, adaptive gamma, a tree, and no drafter."""
    modes = [{"adaptive_gamma": False}, {"adaptive_gamma": True}, {"tree": "branching:2,1", "drafter": "ngram"},
             {"drafter": "none"}]
    for mode in modes:
        c = generate.get_config()
        c.update(mode)
        build.check_config(build.generate_settings(c))            # the mode itself is valid
        c[setting] = value
        with pytest.raises(ValueError) as err:
            build.check_config(build.generate_settings(c))
        msg = str(err.value)
        assert msg.startswith(setting) and repr(value) in msg, (mode, msg)
