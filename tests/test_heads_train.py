"""Training feature-level draft heads (issue 14): the loss falls and only the head moves; the
training-time evaluation's chain simulation equals what the engine does with the head; export
and reload draft identically; the distillation loop trains, exports and resumes a head.

A tiny random target (vocabulary 64, 3 layers) written as an HF checkpoint, fixed token data
(`_distill_toy`)."""
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, distill, drafters, sampling

import _distill_toy as toy


@pytest.fixture(scope="module")
def toy_pair(tmp_path_factory):
    from specjax import models
    root = tmp_path_factory.mktemp("heads_toy")
    target_dir = toy.write_target(root / "target")
    target, tparams = models.load(str(target_dir))
    data_path = toy.write_data(root / "data.jsonl")
    seqs = distill.from_jsonl(data_path)
    hidden = distill.teacher_states(target, tparams, seqs, widths=(32, 64), tokens_per_batch=256)
    plan = distill.BatchPlan(distill.TeacherData(seqs, hidden, 64), 0, 256, (32, 64))
    return dict(root=root, target_dir=target_dir, target=target, params=tparams, data_path=data_path, plan=plan)


def _objective(target, kind, head_size=None, ttt=None, input_norm=False, compute_dtype="float32"):
    hc = drafters.HeadConfig.make(kind, target.config, num_heads=3, head_size=head_size, input_norm=input_norm)
    steps = ttt if ttt is not None else (2 if kind == "eagle3" else 1)
    return distill.HeadObjective(hc, target, ttt_steps=steps, feature_weight=1.0 if kind == "eagle" else 0.0,
                                 compute_dtype=compute_dtype)


@pytest.fixture(scope="module")
def trained(toy_pair):
    """``get(kind, head_size=None, input_norm=False, compute_dtype="float32")``: a head (`_objective`;
    a reduced head keeps tokens 0..head_size-1) from its init (key 0) trained 25 steps of forward
    KL on the plan's first batch (AdamW, learning rate 3e-3, no warm-up, cosine over 40 updates),
    memoised: the loss test, the evaluation's chain simulation and the bfloat16 test read the same
    runs (one compiled step per head). Returns a namespace: obj, frozen (the head's frozen own
    weights and the target), head_UD, batch, start (the trainable weights before, host copies),
    target_before (the target's, host copies), state (after), aux (each step's metrics, host)."""
    import types
    target, tp, plan = toy_pair["target"], toy_pair["params"], toy_pair["plan"]
    batch = {k: jnp.asarray(v) for k, v in plan.batch(0).items()}
    memo = {}

    def get(kind, head_size=None, input_norm=False, compute_dtype="float32"):
        key = (kind, head_size, input_norm, compute_dtype)
        if key not in memo:
            obj = _objective(target, kind, head_size, input_norm=input_norm, compute_dtype=compute_dtype)
            head_ids = np.arange(head_size) if head_size else None
            own = drafters.init_head_params(obj.config, jax.random.key(0), head_ids=head_ids)
            opt, _ = distill.make_optimizer(learning_rate=3e-3, warmup_steps=0, total_updates=40)
            state, frozen = distill.init_state(own, obj.trainable, opt, jax.random.key(1))
            frozen = {**frozen, "target": tp}
            start = jax.tree.map(np.asarray, state.params)          # (the step donates the state)
            target_before = jax.tree.map(np.asarray, tp)
            head_UD = distill.teacher_head(target, tp, head_ids)
            step = distill.make_train_step(obj, distill.LossSpec("fkl"), opt, loss=distill.head_loss)
            aux = []
            for _ in range(25):
                state, a = step(state, frozen, head_UD, batch)
                aux.append(jax.device_get(a))
            memo[key] = types.SimpleNamespace(obj=obj, frozen=frozen, head_UD=head_UD, batch=batch, start=start,
                                              target_before=target_before, state=state, aux=aux)
        return memo[key]

    return get


@pytest.mark.parametrize("kind,head_size,input_norm", [("eagle3", 40, True), ("eagle", 40, False),
                                                       ("eagle", 40, True), ("medusa", None, False),
                                                       ("parallel", None, False)])
def test_head_loss_falls_and_only_the_head_moves(toy_pair, trained, kind, head_size, input_norm):
    """25 steps on one batch (`trained`) lower the divergence by at least 10% (EAGLE's feature
    regression by at least 5%), every step finite, and the target's parameters are never updated. (EAGLE-3
    without a reduced vocabulary or input norms trains in
    test_feature_noise_is_relative_fresh_per_step_and_the_head_still_learns and the distillation
    loop tests.)"""
    tp = toy_pair["params"]
    t = trained(kind, head_size, input_norm)
    assert set(t.state.params) == set(t.obj.config.own_param_names) - {"head_ids"}
    divs = [float(a["divergence_step1"]) for a in t.aux]
    feats = [float(a.get("feature_loss", 0.0)) for a in t.aux]
    assert all(a["nonfinite"] == 0.0 for a in t.aux)
    assert divs[-1] < 0.9 * divs[0], divs       # 25 steps on one batch: at least 10% lower
    if kind == "eagle":              # the feature regression falls too (large toy features: slowly)
        assert feats[-1] < 0.95 * feats[0], feats
    # The target's parameters (embedding, head rows, layers) are never updated.
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, tp), t.target_before)


def test_loss_origins_cover_every_loss_position():
    """`loss_origins`: every position o with mask[o + k] for a shift k is a valid origin, no
    other is, in order, rows padded (invalid) to one width Q, a multiple of T / 8; None when Q
    would be the whole width or the batch is narrower than ``min_width``. Random masks of
    prompt / answer / padding rows, seed 0."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        B, T = int(rng.integers(1, 5)), int(rng.choice([16, 40, 64]))
        mask = np.zeros((B, T), np.float32)
        for r in range(B):
            a = int(rng.integers(0, T)); e = int(rng.integers(a, T + 1))
            mask[r, a:e] = 1.0
        shifts = tuple(range(int(rng.integers(1, 8)))) if trial % 2 else tuple(range(1, 4))
        got = distill.loss_origins(mask, shifts, min_width=0)
        assert distill.loss_origins(mask, shifts, min_width=T + 1) is None     # narrower than min_width
        need = [{o for o in range(T) for k in shifts if o + k < T and mask[r, o + k] > 0} for r in range(B)]
        unit = -(-T // 8)
        Q = max(unit, -(-max(map(len, need)) // unit) * unit)
        if Q >= T:
            assert got is None
            continue
        origins, valid = got
        assert origins.shape == valid.shape == (B, Q) and Q % unit == 0
        for r in range(B):
            n = int(valid[r].sum())
            assert list(origins[r, :n]) == sorted(need[r]) and not valid[r, n:].any()


@pytest.mark.parametrize("kind,head_size,ttt", [("eagle3", None, 3), ("eagle", 40, 1), ("parallel", None, 1),
                                                ("medusa", None, 1), ("eagle3_published", None, 2)])
def test_head_loss_at_loss_origins_is_the_same_loss(toy_pair, kind, head_size, ttt):
    """The loss, its metrics and its gradient with the origins its loss reads attached
    (`with_loss_origins`: later drafting steps at those origins only) equal those over every
    position (float32 rounding), for every kind (EAGLE's feature regression included); the
    batch's first rows lose their first half of loss positions so that Q < T; a wrong origin
    set (shifted by one) changes the loss."""
    target, tp, plan = toy_pair["target"], toy_pair["params"], toy_pair["plan"]
    hc = drafters.HeadConfig.make(kind, target.config, num_heads=3, head_size=head_size,
                                  feature_layers=(0, 1, 2) if kind == "eagle3_published" else None)
    obj = distill.HeadObjective(hc, target, ttt_steps=ttt, feature_weight=1.0 if kind == "eagle" else 0.0)
    head_ids = np.arange(head_size) if head_size else None
    own = drafters.init_head_params(hc, jax.random.key(2), head_ids=head_ids)
    own = jax.tree.map(lambda x: x * 8 if x.ndim == 2 else x, own)      # attention far from uniform
    trainable = {k: own[k] for k in obj.trainable}
    frozen = {"target": tp, **{k: v for k, v in own.items() if k not in obj.trainable}}
    head_UD = distill.teacher_head(target, tp, head_ids)
    batch = dict(plan.batch(0))
    mask = np.array(batch["mask"])
    T = mask.shape[1]
    mask[:, :T // 2] = 0.0
    batch["mask"] = mask
    with_o = distill.with_loss_origins(obj, batch, min_width=0)
    assert "origins" in with_o and with_o["origins"].shape[1] < T
    f = jax.jit(jax.value_and_grad(lambda t, b: distill.head_loss(t, frozen, head_UD, b, draft=obj,
                                                                  spec=distill.LossSpec("fkl")), has_aux=True))
    (loss, aux), grads = f(trainable, {k: jnp.asarray(v) for k, v in batch.items()})
    (loss_o, aux_o), grads_o = f(trainable, {k: jnp.asarray(v) for k, v in with_o.items()})
    np.testing.assert_allclose(float(loss_o), float(loss), rtol=2e-5)
    for k in aux:
        np.testing.assert_allclose(float(aux_o[k]), float(aux[k]), rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_o), jax.tree.leaves(grads)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, atol=2e-5 * np.abs(b).max(), rtol=0)
    shifted = {**with_o, "origins": np.clip(with_o["origins"] + 1, 0, T - 1)}
    (loss_s, _), _ = f(trainable, {k: jnp.asarray(v) for k, v in shifted.items()})
    assert abs(float(loss_s) - float(loss)) > 1e-4 * abs(float(loss))


def _greedy(target, tp, drafter, hp, prompts, n, gamma, ref=True):
    """(target-only, speculative) greedy runs of the prompts (the target-only one if ``ref``)."""
    greedy = sampling.SamplingConfig.greedy_config()
    cfg = decoding.GenerationConfig(max_new_tokens=n, gamma=gamma)
    batch = decoding.make_batch(prompts, cfg, jax.random.key(0))
    spec = decoding.Engine(target, drafter, cfg).run(decoding.EngineParams(target=tp, draft=hp), greedy, batch)
    if not ref:
        return None, spec
    ref = decoding.Engine(target, None, decoding.GenerationConfig(max_new_tokens=n, gamma=0)).run(
        decoding.EngineParams(target=tp), greedy, batch)
    return ref, spec


# The briefly trained heads of the chain simulation (`trained` runs), and its prompts.
CHAIN_HEADS = {"eagle3": ("eagle3", 40, True), "medusa": ("medusa", None, False), "parallel": ("parallel", None, False)}
CHAIN_PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [30, 31, 32, 33, 34, 35, 36]]
CHAIN_NEW, CHAIN_GAMMA = 30, 3


@pytest.mark.parametrize("kind", list(CHAIN_HEADS))
def test_evaluation_chain_simulation_equals_the_engine(toy_pair, trained, kind):
    """A briefly trained head (25 steps on one batch, `trained`; EAGLE-3 with a 40-token
    vocabulary and input norms): `chain_tokens_per_pass` over the multi-step
    teacher-forced agreement (what training evaluation reports) equals the engine's committed
    tokens and target passes with that head, row by row, on the target's greedy continuation.
    This ties the training-time-test attention mask (and Medusa's feature offset, the parallel
    drafter's placeholders) to inference."""
    target, tp = toy_pair["target"], toy_pair["params"]
    gamma = CHAIN_GAMMA
    t = trained(*CHAIN_HEADS[kind])
    obj = t.obj
    own = {**{k: v for k, v in t.frozen.items() if k != "target"}, **t.state.params}
    hp = drafters.head_params(obj.config, own, tp)
    drafter = obj.config.spec.drafter(obj.config)
    prompts = CHAIN_PROMPTS
    N = CHAIN_NEW
    ref, spec = _greedy(target, tp, drafter, hp, prompts, N, gamma)
    m = jax.device_get(spec.metrics)
    assert spec.generated() == ref.generated()
    # The evaluation of every row at once (right-padded: causal, and the entries read below, t + j
    # <= len - 2, come from real tokens; one compiled program, not one per row length).
    seqs = [p + gen for p, gen in zip(prompts, ref.generated())]
    width = max(map(len, seqs))
    _, q_arg, p_arg = distill.head_eval_batch(obj, hp, tp, jnp.asarray([s + [0] * (width - len(s)) for s in seqs],
                                                                        jnp.int32), gamma)
    agree_B = np.asarray(q_arg) == np.asarray(p_arg)
    total_accepted = 0
    for b, (p, gen) in enumerate(zip(prompts, ref.generated())):
        seq = np.asarray(p + gen, np.int32)
        agree = agree_B[b, :len(seq)]
        valid = np.zeros(len(seq), bool)
        valid[len(p) - 1:len(seq) - 1] = True
        inside = np.arange(len(seq))[:, None] + np.arange(gamma)[None, :] <= len(seq) - 2
        committed, passes = distill.chain_tokens_per_pass(agree & inside, valid, gamma)
        assert committed == N == int(m.committed_B[b])
        assert passes == int(m.rounds_B[b]), (b, passes, int(m.rounds_B[b]))
        total_accepted += int(m.accepted_B[b])
    assert total_accepted > 0          # the check would be vacuous if the head never agreed


@pytest.mark.parametrize("input_norm", [False, True], ids=["plain", "input_norm"])
def test_export_and_reload_draft_identically(toy_pair, tmp_path, input_norm):
    target, tp = toy_pair["target"], toy_pair["params"]
    hc = drafters.HeadConfig.make("eagle3", target.config, num_heads=3, head_size=40, input_norm=input_norm)
    own = drafters.init_head_params(hc, jax.random.key(3), head_ids=np.arange(10, 50))
    if input_norm:          # weights other than their init, so that the reload must carry them
        own["input_norm"] = 1.0 + 0.5 * jax.random.uniform(jax.random.key(4), own["input_norm"].shape)
    desc = drafters.save_head(tmp_path / "h", hc, own, dtype="float32", info={"note": "test"})
    head = json.loads((tmp_path / "h" / "head.json").read_text())["head"]
    assert desc["bytes"] > 0 and head["kind"] == "eagle3" and head["input_norm"] is input_norm
    drafter, hp = drafters.load_head(tmp_path / "h", target, tp)
    mine = drafters.FeatureHeadDrafter(drafters.EagleHead(hc))
    assert drafter == mine
    # The reloaded drafter's parameters are the saved head's, exactly (tree, dtypes as the engine
    # gets them, values): with the same drafter, every engine run drafts identically.
    want = drafters.head_params(hc, own, tp)
    assert jax.tree.structure(hp) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(hp), jax.tree.leaves(want)):
        assert jnp.asarray(x).dtype == jnp.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # And one engine run end to end, for the input-norm head (its config is the chain simulation's
    # EAGLE-3 head's: the engine program of test_evaluation_chain_simulation_equals_the_engine, no
    # compile of its own; the plain head's weights are carried by the comparison above).
    if input_norm:
        _, a = _greedy(target, tp, drafter, hp, CHAIN_PROMPTS, CHAIN_NEW, CHAIN_GAMMA, ref=False)
        _, b = _greedy(target, tp, mine, want, CHAIN_PROMPTS, CHAIN_NEW, CHAIN_GAMMA, ref=False)
        np.testing.assert_array_equal(np.asarray(a.tokens_BS), np.asarray(b.tokens_BS))
        np.testing.assert_array_equal(np.asarray(a.metrics.accepted_B), np.asarray(b.metrics.accepted_B))
    # A corrupted tensor file is refused, naming the file.
    blob = tmp_path / "h" / "head.safetensors"
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(Exception, match="sha256"):
        drafters.load_head(tmp_path / "h", target, tp)


def test_broken_head_directories_are_refused_with_the_file_named(toy_pair, tmp_path):
    """A head.json that is not JSON or lacks keys, and tensors of the wrong shape (a head saved
    with another head size than its description says), each give a CheckpointError naming the
    file instead of a traceback from inside the first jitted round."""
    from specjax.models import CheckpointError
    target, tp = toy_pair["target"], toy_pair["params"]
    hc = drafters.HeadConfig.make("eagle3", target.config, head_size=40)
    own = drafters.init_head_params(hc, jax.random.key(3), head_ids=np.arange(10, 50))
    d = tmp_path / "h"
    drafters.save_head(d, hc, own, dtype="float32")
    good = (d / "head.json").read_text()
    (d / "head.json").write_text(good[:-20])
    with pytest.raises(CheckpointError, match="head.json is not valid JSON"):
        drafters.load_head(d, target, tp)
    desc = json.loads(good)
    del desc["target_dims"]
    (d / "head.json").write_text(json.dumps(desc))
    with pytest.raises(CheckpointError, match="lacks"):
        drafters.load_head(d, target, tp)
    # input_norm written as a string ("false" would read as true through bool()).
    desc = json.loads(good)
    desc["head"]["input_norm"] = "false"
    (d / "head.json").write_text(json.dumps(desc))
    with pytest.raises(CheckpointError, match="'input_norm' must be true or false"):
        drafters.load_head(d, target, tp)
    desc["head"] = ["eagle"]                              # not an object at all
    (d / "head.json").write_text(json.dumps(desc))
    with pytest.raises(CheckpointError, match="'head' must be an object"):
        drafters.load_head(d, target, tp)
    # Tensors of a 30-token head under a description that says 40.
    small = drafters.HeadConfig.make("eagle3", target.config, head_size=30)
    drafters.save_head(tmp_path / "small", small, drafters.init_head_params(small, jax.random.key(4),
                                                                            head_ids=np.arange(30)), dtype="float32")
    desc = json.loads(good)
    desc["sha256"] = json.loads((tmp_path / "small" / "head.json").read_text())["sha256"]
    (d / "head.safetensors").write_bytes((tmp_path / "small" / "head.safetensors").read_bytes())
    (d / "head.json").write_text(json.dumps(desc))
    with pytest.raises(CheckpointError, match=r"head_ids.*shape \(30,\).*needs \(40,\)"):
        drafters.load_head(d, target, tp)


def test_distillation_loop_trains_exports_and_resumes_a_head(toy_pair, tmp_path):
    import ml_collections
    c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"], data_root=tmp_path / "cache",
                   budget=3000, export_dir=tmp_path / "export")
    c.draft.kind = "eagle3"
    c.data.draft_weight = 0.0
    c.head = ml_collections.ConfigDict({"ttt_steps": 2, "feature_weight": 0.0, "num_heads": 3, "feature_layers": ()})
    c.eval.every = 5
    c.eval.gamma = 2
    # Evaluation on a fixed token set (the toy target has no tokenizer for Spec-Bench prompts).
    c.eval.data_jsonl = str(toy.write_data(tmp_path / "eval.jsonl", n=8, seed=1))
    s = distill.train(c, tmp_path / "wd", log=lambda m: None, stop_after_steps=6)   # checkpoint at step 5
    assert s["steps"] == 6 and "export" not in s
    s = distill.train(c, tmp_path / "wd", log=lambda m: None)
    recs = [json.loads(l) for l in (tmp_path / "wd" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "resume" for r in recs)
    evals = [r for r in recs if r["kind"] == "eval"]
    assert evals and {"alpha_t1", "greedy_agreement_step2", "greedy_tokens_per_pass_g2"} <= set(evals[-1])
    assert s["export"]["bytes"] > 0 and drafters.is_head_dir(tmp_path / "export")
    drafters.load_head(tmp_path / "export", toy_pair["target"], toy_pair["params"])
    # The workdir's checkpoints hold a head without input norms (the key was absent from its
    # config): a config that adds them is refused before anything is written.
    c.head.input_norm = True
    with pytest.raises(ValueError, match="head.input_norm: false -> true"):
        distill.train(c, tmp_path / "wd", log=lambda m: None)
    # A Medusa workdir ignores input_norm (configs/distill_head.py turns it on for every kind)
    # but not num_heads, which shapes its parameters.
    (tmp_path / "wd_m" / "checkpoints" / "5").mkdir(parents=True)
    stored = json.loads((tmp_path / "wd" / "config.json").read_text())
    stored["draft"]["kind"], stored["head"]["num_heads"] = "medusa", 3
    (tmp_path / "wd_m" / "config.json").write_text(json.dumps(stored))
    c.draft.kind = "medusa"
    distill.check_resume_config(c, tmp_path / "wd_m")
    c.head.num_heads = 4
    with pytest.raises(ValueError, match="head.num_heads: 3 -> 4"):
        distill.check_resume_config(c, tmp_path / "wd_m")


def test_input_norm_reads_the_feature_direction_and_the_token(toy_pair):
    """With input_norm, the head's input does not change when the features are scaled (the
    target's raw residual streams are large; only their direction reaches fc) and does change
    with the token; without it, scaling the features changes the input; Medusa has no such
    input. (Resuming a workdir with it toggled: test_distillation_loop_trains_exports_and_resumes_a_head.)"""
    target, tp = toy_pair["target"], toy_pair["params"]
    for kind in ("eagle", "eagle3"):
        hc_n = drafters.HeadConfig.make(kind, target.config, input_norm=True)
        hc_p = drafters.HeadConfig.make(kind, target.config)
        own = drafters.init_head_params(hc_n, jax.random.key(0))
        assert "input_norm" in hc_n.own_param_names and "input_norm" not in hc_p.own_param_names
        p_n = drafters.head_params(hc_n, own, tp)
        p_p = drafters.head_params(hc_p, {k: v for k, v in own.items() if k != "input_norm"}, tp)
        f = jax.random.normal(jax.random.key(1), (1, 5, hc_n.feature_size))
        tok = jnp.array([[1, 2, 3, 4, 5]], jnp.int32)
        x = lambda hc, p, t, f: drafters.eagle_input(hc, p, t, drafters.fuse_features(hc, p, f))  # noqa: E731
        np.testing.assert_allclose(np.asarray(x(hc_n, p_n, tok, 50.0 * f)), np.asarray(x(hc_n, p_n, tok, f)),
                                   rtol=0, atol=2e-3)      # float32 rounding (inputs ~0.3)
        assert not np.allclose(np.asarray(x(hc_n, p_n, tok + 1, f)), np.asarray(x(hc_n, p_n, tok, f)), atol=2e-2)
        assert not np.allclose(np.asarray(x(hc_p, p_p, tok, 50.0 * f)), np.asarray(x(hc_p, p_p, tok, f)), atol=2e-2)
    with pytest.raises(ValueError, match="input_norm applies to EAGLE"):
        drafters.HeadConfig.make("medusa", target.config, input_norm=True)


def test_head_settings_are_checked(toy_pair):
    target = toy_pair["target"]
    with pytest.raises(ValueError, match="ttt_steps must be 1"):
        _objective(target, "medusa", ttt=3)
    with pytest.raises(ValueError, match="head kind"):
        drafters.HeadConfig.make("hydra", target.config)
    c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"], data_root="/tmp/unused")
    c.draft.kind = "eagle"
    c.data.draft_weight = 0.5
    with pytest.raises(ValueError, match="draft_weight"):
        distill.train(c, toy_pair["root"] / "never", log=lambda m: None)
    # head.input_norm (on in configs/distill_head.py) is for the EAGLE kinds; Medusa ignores it.
    import ml_collections
    c.head = ml_collections.ConfigDict({"input_norm": True})
    assert distill.objective_from_config(c, target).config.input_norm
    c.draft.kind = "medusa"
    assert not distill.objective_from_config(c, target).config.input_norm


def test_feature_noise_is_relative_fresh_per_step_and_the_head_still_learns(toy_pair):
    """`noisy_features`: |noise| <= a x the RMS of each fused layer's slice, with a spread that
    fills that band, the same for one key and different for another; the train step draws new
    noise each step (the key folded with the step), the loss refuses to run without a key, and an
    EAGLE-3 head trained with noise still lowers its (noise-free) divergence."""
    f = jax.random.normal(jax.random.key(0), (2, 16, 3 * 8)) * jnp.repeat(jnp.array([1.0, 10.0, 100.0]), 8)
    a = 0.3
    g = distill.noisy_features(f, 3, a, jax.random.key(1))
    fs, ds = np.asarray(f).reshape(2, 16, 3, 8), np.asarray(g - f).reshape(2, 16, 3, 8)
    rms = np.sqrt((fs ** 2).mean(-1, keepdims=True))
    ratio = np.abs(ds) / rms
    assert ratio.max() <= a * (1 + 1e-5) and ratio.max() > 0.9 * a      # 768 draws: one > 0.9 a w.p. 1 - 0.9^768
    np.testing.assert_array_equal(np.asarray(distill.noisy_features(f, 3, a, jax.random.key(1))), np.asarray(g))
    assert not np.array_equal(np.asarray(distill.noisy_features(f, 3, a, jax.random.key(2))), np.asarray(g))

    target, tp, plan = toy_pair["target"], toy_pair["params"], toy_pair["plan"]
    hc = drafters.HeadConfig.make("eagle3", target.config, num_heads=3)
    obj = distill.HeadObjective(hc, target, ttt_steps=2, feature_noise=0.2)
    with pytest.raises(ValueError, match="feature_noise must be"):
        distill.HeadObjective(hc, target, feature_noise=-0.1)
    own = drafters.init_head_params(hc, jax.random.key(0))
    opt, _ = distill.make_optimizer(learning_rate=3e-3, warmup_steps=0, total_updates=40)
    state, frozen = distill.init_state(own, obj.trainable, opt, jax.random.key(1))
    frozen = {**frozen, "target": tp}
    head_UD = distill.teacher_head(target, tp, None)
    batch = {k: jnp.asarray(v) for k, v in plan.batch(0).items()}
    with pytest.raises(ValueError, match="needs a key"):       # (raised while tracing: nothing runs)
        jax.eval_shape(lambda tr: distill.head_loss(tr, frozen, head_UD, batch, draft=obj,
                                                    spec=distill.LossSpec("fkl")), state.params)
    clean = dataclasses.replace(obj, feature_noise=0.0)
    loss = jax.jit(lambda tr, k: distill.head_loss(tr, frozen, head_UD, batch, draft=obj, spec=distill.LossSpec("fkl"),
                                                   key=k)[0])
    # the noise-free loss, jitted too (op by op, each of its 26 calls dispatched hundreds of ops)
    clean_loss = jax.jit(lambda tr: distill.head_loss(tr, frozen, head_UD, batch, draft=clean,
                                                      spec=distill.LossSpec("fkl"))[0])
    l1, l2 = float(loss(state.params, jax.random.key(3))), float(loss(state.params, jax.random.key(4)))
    l0 = float(clean_loss(state.params))
    assert len({l0, l1, l2}) == 3, (l0, l1, l2)              # the noise reaches the loss, new per key
    step = distill.make_train_step(obj, distill.LossSpec("fkl"), opt, loss=distill.head_loss)
    copy = lambda st, k=0: jax.tree.map(jnp.copy, st).replace(step=st.step + k)   # noqa: E731 (the step donates)
    at0, again0, at1 = (float(step(copy(state, k), frozen, head_UD, batch)[1]["loss"]) for k in (0, 0, 1))
    assert at0 == again0 and at0 != at1, (at0, again0, at1)     # the same noise on resume, new at the next step
    losses = []
    for _ in range(25):
        state, aux = step(state, frozen, head_UD, batch)
        losses.append(float(clean_loss(state.params)))
    assert losses[-1] < 0.9 * l0, (l0, losses)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_cached_features_give_the_online_loss_and_gradients(toy_pair, tmp_path, kind):
    """Features stored once with the data (`feature_states`) are the target's own features at
    every position (a batch of each width), and a step fed from them computes the loss and
    gradients of the step that runs the target forward itself (float32 cache: equal up to float
    rounding; on the first batch: the loss reads the batch's features whatever its width, which
    the first check covers); a float16 cache stays within float16's rounding."""
    target, tp, plan = toy_pair["target"], toy_pair["params"], toy_pair["plan"]
    # (EAGLE-3 with a 3-step training-time test: the online loss is then the program of
    # test_head_loss_at_loss_origins_is_the_same_loss, as Medusa's is)
    obj = _objective(target, kind, ttt=3 if kind == "eagle3" else None)
    layers = obj.config.feature_layers
    seqs = plan.data.seqs
    feats = distill.feature_states(target, tp, seqs, layers, path=tmp_path / "f.npy", widths=(32, 64),
                                   tokens_per_batch=256)
    assert isinstance(feats, np.memmap) and feats.shape == (int(np.minimum(seqs.lengths, 64).sum()),
                                                            obj.config.feature_size)
    assert not list(tmp_path.glob("*.partial.npy"))
    cached = distill.BatchPlan(plan.data.with_features(feats), 0, 256, (32, 64))
    own = drafters.init_head_params(obj.config, jax.random.key(3))
    frozen = {"target": tp}
    head_UD = distill.teacher_head(target, tp, None)
    spec = distill.LossSpec("fkl")
    grad = jax.jit(jax.value_and_grad(lambda t, b: distill.head_loss(t, frozen, head_UD, b, draft=obj, spec=spec),
                                      has_aux=True))
    trunk = jax.jit(lambda p, t: target.trunk(p, t, None, collect=layers)[1])      # (op by op: slower than a compile)
    for i in range(2):
        b_cached = {k: jnp.asarray(v) for k, v in cached.batch(i).items()}
        b_online = {k: v for k, v in b_cached.items() if k != "features"}
        # The batch's features are the target's, row by row, wherever a token is.
        want = trunk(tp, b_cached["tokens"])
        want = np.concatenate([np.asarray(w) for w in want], -1)
        toks = np.asarray(b_cached["tokens"])
        lens = [len(seqs.tokens[r]) for r in cached.epoch(0)[i][1]]
        # Not bit-equal: XLA CPU sums matmuls in an order that depends on the batch's shape and the
        # toy's large random features (|f| ~ 50) amplify that through the layers: 1e-4 of the scale.
        scale = float(np.abs(want).max())
        for r, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(b_cached["features"])[r, :n], want[r, :n], rtol=0, atol=1e-4 * scale)
            assert not np.asarray(b_cached["features"])[r, n:].any() and not toks[r, n:].any()
        if i:
            continue
        ((l_c, _), g_c), ((l_o, _), g_o) = grad(own, b_cached), grad(own, b_online)
        np.testing.assert_allclose(float(l_c), float(l_o), rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6), g_c, g_o)
    # One pass for a new data set: the same features plus its teacher states.
    again, teacher = distill.feature_states(target, tp, seqs, layers, path=tmp_path / "g.npy", widths=(32, 64),
                                            tokens_per_batch=256, with_teacher=True)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(feats))
    np.testing.assert_allclose(teacher, np.asarray(plan.data.hidden), rtol=1e-5, atol=1e-5)
    half = distill.feature_states(target, tp, seqs, layers, path=tmp_path / "h.npy", widths=(32, 64),
                                  tokens_per_batch=256, dtype="float16")
    assert half.dtype == np.float16
    np.testing.assert_allclose(np.asarray(half, np.float32), np.asarray(feats), rtol=2e-3, atol=2e-3)


def test_distillation_loop_caches_features_once_and_trains_as_online(toy_pair, tmp_path):
    """With head.feature_cache the loop computes the features once (a file beside the data),
    reuses them on the next run, and its steps give the losses of the online loop."""
    import ml_collections
    runs = {}
    for name, cache in (("online", ""), ("cached", "float32"), ("again", "float32")):
        c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"],
                       data_root=tmp_path / "cache", budget=3000)
        c.draft.kind = "eagle3"
        c.data.draft_weight = 0.0
        c.head = ml_collections.ConfigDict({"ttt_steps": 2, "feature_weight": 0.0, "num_heads": 3,
                                            "feature_layers": (), "feature_cache": cache})
        c.eval.every = 0
        logs = []
        distill.train(c, tmp_path / name, log=logs.append, stop_after_steps=3)
        recs = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r["loss"] for r in recs if r["kind"] == "train"], logs)
    assert len(list((tmp_path / "cache").rglob("features-*.npy"))) == 1
    assert any("features of layers" in m for m in runs["cached"][1])
    assert any("reusing cached features" in m for m in runs["again"][1])
    assert not any("features of layers" in m for m in runs["again"][1])
    np.testing.assert_allclose(runs["cached"][0], runs["online"][0], rtol=1e-4)
    assert runs["again"][0] == runs["cached"][0]


def test_bad_feature_caches_are_refused(toy_pair, tmp_path):
    target, tp, plan = toy_pair["target"], toy_pair["params"], toy_pair["plan"]
    with pytest.raises(ValueError, match="stale feature cache"):
        plan.data.with_features(np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="feature cache dtype"):
        distill.feature_states(target, tp, plan.data.seqs, (0,), path=tmp_path / "x.npy", dtype="int8")
    c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"], data_root=tmp_path / "c")
    c.draft.kind = "eagle"
    c.data.draft_weight = 0.0
    import ml_collections
    c.head = ml_collections.ConfigDict({"feature_cache": "bf16"})
    with pytest.raises(ValueError, match="head.feature_cache must be"):
        distill.train(c, tmp_path / "wd", log=lambda m: None)
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").rglob("features-*"))


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_reduced_head_evaluation_equals_scoring_the_full_vocabulary(toy_pair, kind):
    """The evaluation scores a reduced head over its own tokens only; that equals scoring the
    full vocabulary with q = 0 (logit -inf) off the head: same argmax, same sum_x min(p, q)."""
    from specjax.models import llama as llama_lib
    target, tp, plan = toy_pair["target"], toy_pair["params"], toy_pair["plan"]
    head_ids = np.sort(np.random.default_rng(0).choice(target.vocab_size, 40, replace=False)).astype(np.int32)
    obj = _objective(target, kind, head_size=40)
    own = drafters.init_head_params(obj.config, jax.random.key(5), head_ids=head_ids)
    params = drafters.head_params(obj.config, own, tp)
    toks = jnp.asarray(plan.batch(0)["tokens"])
    alpha, q_arg, p_arg = distill.head_eval_batch(obj, params, tp, toks, 2)

    @jax.jit            # (op by op, the reference dispatched and compiled dozens of small programs)
    def reference(params, tp, toks):
        h, feats, _ = target.trunk(tp, toks, None, collect=obj.config.feature_layers)
        f = jnp.concatenate(feats, -1)
        p_logits = target.logits_from_hidden(tp, llama_lib.rms_norm(h, tp["final_norm"], target.config.rms_eps))
        if kind == "medusa":
            f_prev = jnp.concatenate([jnp.zeros_like(f[:, :1]), f[:, :-1]], axis=1)
            q = drafters.medusa_logits(obj.config, params, f_prev, 2)
            qs = [q[:, :, j] for j in range(2)]
        else:
            qs = [lg for _, lg in drafters.eagle_train_forward(obj.config, params, toks, f, 2)]
        want_alpha = jnp.sum(jnp.minimum(jax.nn.softmax(p_logits, -1), jax.nn.softmax(qs[0], -1)), -1)
        return qs[0], want_alpha, jnp.stack([jnp.argmax(q, -1) for q in qs], -1), jnp.argmax(p_logits, -1)

    q0, want_alpha, q_want, p_want = jax.device_get(reference(params, tp, toks))
    assert np.isinf(q0[..., np.setdiff1d(np.arange(target.vocab_size), head_ids)]).all()
    np.testing.assert_allclose(np.asarray(alpha), want_alpha, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(q_arg), q_want)
    assert np.isin(np.asarray(q_arg), head_ids).all()
    np.testing.assert_array_equal(np.asarray(p_arg[..., 0]), p_want)


def test_generated_data_gets_features_from_its_teacher_pass(toy_pair, tmp_path):
    """A generated data set for a head is built with one target pass: the teacher states and
    the feature file come out of the same forward and equal the separate computations."""
    target, tp = toy_pair["target"], toy_pair["params"]
    layers = _objective(target, "eagle3").config.feature_layers
    spec = {"layers": list(layers), "dtype": "float32"}
    d = tmp_path / "gen"
    data = distill.generated_data(d, target, tp, target, tp, [[1, 2, 3], [4, 5]], key=jax.random.key(0),
                                   temperature=0.0, samples_per_prompt=1, max_new_tokens=6, batch_size=2, eos_ids=(),
                                   widths=(32, 64), tokens_per_batch=256,
                                   features=(layers, distill.feature_file(spec), "float32"))
    logs = []
    data = distill.with_features(data, d, spec, target, tp, (32, 64), 256, log=logs.append)
    assert any("reusing cached features" in m for m in logs)
    np.testing.assert_allclose(data.hidden, distill.teacher_states(target, tp, data.seqs, widths=(32, 64),
                                                                   tokens_per_batch=256), rtol=1e-5, atol=1e-5)
    alone = distill.feature_states(target, tp, data.seqs, layers, path=tmp_path / "alone.npy", widths=(32, 64),
                                   tokens_per_batch=256)
    np.testing.assert_array_equal(np.asarray(data.features), np.asarray(alone))


def test_corrupt_feature_cache_and_head_description_are_named(toy_pair, tmp_path):
    """A truncated feature file or one for other data is a one-line error naming the file
    (the data beside it untouched); a broken head.json gives head_kind's CheckpointError."""
    from specjax.models.config import CheckpointError
    target, tp, plan = toy_pair["target"], toy_pair["params"], toy_pair["plan"]
    spec = {"layers": [0], "dtype": "float32"}
    path = tmp_path / distill.feature_file(spec)
    distill.with_features(plan.data, tmp_path, spec, target, tp, (32, 64), 256)      # computes and stores it
    good = path.read_bytes()
    path.write_bytes(good[:len(good) // 2])
    with pytest.raises(ValueError, match="unreadable feature cache"):
        distill.with_features(plan.data, tmp_path, spec, target, tp, (32, 64), 256)
    np.save(path, np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="stale feature cache"):
        distill.with_features(plan.data, tmp_path, spec, target, tp, (32, 64), 256)
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "head.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="head.json"):
        drafters.head_kind(tmp_path / "h")
    with pytest.raises(CheckpointError, match="no head.json"):
        drafters.head_kind(tmp_path)


def test_the_shipped_head_is_complete_and_found_by_name(toy_pair):
    """The head shipped for the default target (`build.SHIPPED_HEADS`, copied there by
    experiments/heads/ship.py): a head directory made for SmolLM2-135M's dimensions, within the
    24 MB budget, its tensors matching their sha256; `drafter='head'` without `draft_model`
    loads it for that target name and refuses any other name. (It is run on the real target
    in tests/test_kernels.py.)"""
    from specjax import build
    from specjax.models import draft_artifact
    d = build.shipped_head("smollm2-135m-instruct")
    desc = json.loads((d / "head.json").read_text())
    assert drafters.head_kind(d) == desc["head"]["kind"]
    assert desc["target_dims"] == {"vocab_size": 49152, "hidden_size": 576, "num_layers": 30}
    assert sum(f.stat().st_size for f in d.iterdir()) <= 24_000_000
    own = draft_artifact.read_tensors(d / "head.safetensors", desc["sha256"], jnp.float32)
    assert desc["head"]["head_size"] is None or own["head_ids"].shape == (desc["head"]["head_size"],)
    with pytest.raises(ValueError, match="no draft head ships for target 'elsewhere'"):
        build.shipped_head("elsewhere")
    with pytest.raises(ValueError, match="needs draft_model"):
        build.make_drafter("head", toy_pair["target"], toy_pair["params"], target_name="elsewhere")


def test_a_head_trains_from_streamed_shards_and_resumes_mid_epoch_to_the_same_losses(toy_pair, tmp_path):
    """A head trained on shards (data.shards: 2 directories, 4 shards each, window 2, so an epoch
    is 4 groups), stopped at step 7 and resumed (checkpoint at step 5, mid-epoch), takes the same
    batches and reaches the same losses as an uninterrupted run (two epochs, ~25 steps); a corpus
    that changed under the checkpoints is refused, naming the shards."""
    import ml_collections
    dirs = toy.write_shards(tmp_path / "corpus", toy_pair["data_path"])

    def cfg():
        c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"],
                       data_root=tmp_path / "cache", budget=3000, head_vocab=40)
        c.draft.kind = "eagle"
        c.data.fixed_weight = 0.0
        c.data.draft_weight = 0.0
        c.data.shards.update(dirs=tuple(dirs), weight=1.0, window=2)
        c.head = ml_collections.ConfigDict({"ttt_steps": 1, "feature_weight": 1.0, "num_heads": 3,
                                            "feature_layers": (), "feature_cache": "float32"})
        return c

    c = cfg()
    c.export_dir = str(tmp_path / "head")
    full = distill.train(c, tmp_path / "full", log=lambda m: None)
    stream = distill.ShardStream(dirs, seed=2, tokens_per_batch=256, widths=(32, 64), window=2)
    # The exported head records what it learned from: the shards' loss tokens and what it read.
    info = json.loads((tmp_path / "head" / "head.json").read_text())["info"]
    assert info["data"] == {"loss_tokens": {"shards": stream.loss_tokens_used()},
                            "fingerprints": {"shards": distill.ShardStream(
                                dirs, seed=2, widths=(32, 64), max_prompt=c.data.max_prompt_tokens).fingerprint()}}
    assert full["steps"] > stream.batches_per_epoch > 5        # more than one epoch; the resume at step 5 is mid-epoch
    distill.train(cfg(), tmp_path / "split", log=lambda m: None, stop_after_steps=7)
    distill.train(cfg(), tmp_path / "split", log=lambda m: None)

    def losses(wd):
        recs = [json.loads(l) for l in (wd / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["loss_tokens"]) for r in recs if r["kind"] == "train"}

    a, b = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert set(a) == set(b) and len(a) == full["steps"]
    for step in a:
        assert a[step][1] == b[step][1]
        np.testing.assert_allclose(a[step][0], b[step][0], rtol=1e-6, err_msg=f"step {step}")
    assert sum(n for _, n in a.values()) == full["tokens"] >= 3000
    # The head's reduced vocabulary comes from the shards' loss tokens.
    assert full["data_loss_tokens"]["shards"] == stream.loss_tokens_used()
    # Another shard in a stage: the checkpoints' data order no longer holds.
    sd = distill.shards.ShardDir(tmp_path / "corpus" / "stage0", {"stage": 0}, vocab_size=toy.VOCAB, sources=["toy"])
    sd.write(9, distill.shards.Sequences([np.arange(20) % toy.VOCAB], [np.arange(20) >= 3], ["toy"], [99]))
    c = cfg()
    c.budget_tokens = 8000
    with pytest.raises(ValueError, match="other shards than data.shards names now"):
        distill.train(c, tmp_path / "split", log=lambda m: None)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_streamed_shards_cache_their_features_once_and_train_as_online(toy_pair, tmp_path, kind):
    """With head.feature_cache, a head trained on streamed shards reads the target's features from
    per-(shard, layer) files computed once (the teacher from the last layer's file through the
    final norm) and its steps give the losses of the online loop (which runs the target in every
    step); a second run, and a run of another kind after the union of both kinds' layers was
    cached, compute nothing; a partial file is never read; a file of the wrong length is named."""
    import ml_collections
    dirs = toy.write_shards(tmp_path / "corpus", toy_pair["data_path"])

    def cfg(cache):
        c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"],
                       data_root=tmp_path / "cache", budget=3000, head_vocab=40)
        c.draft.kind = kind
        c.data.fixed_weight = c.data.draft_weight = 0.0
        c.data.shards.update(dirs=tuple(dirs), weight=1.0, window=2)
        # (EAGLE's settings are those of the resume test above: its cached step is the same program)
        c.head = ml_collections.ConfigDict({"ttt_steps": 2 if kind == "eagle3" else 1,
                                            "feature_weight": 1.0 if kind == "eagle" else 0.0,
                                            "num_heads": 3, "feature_layers": (), "feature_cache": cache})
        c.eval.every = 0
        return c

    runs = {}
    for name, cache in (("online", ""), ("cached", "float32"), ("again", "float32")):
        logs = []
        distill.train(cfg(cache), tmp_path / name, log=logs.append, stop_after_steps=4)
        recs = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r["loss"] for r in recs if r["kind"] == "train"], logs)
    files = sorted((tmp_path / "cache").rglob("*-L*.npy"))
    L = toy_pair["target"].config.num_layers
    layers = {int(f.stem.rsplit("-L", 1)[1]) for f in files}
    assert layers == ({L - 1} if kind == "eagle" else {1, 0, L - 1} | {L // 2 - 1})        # the kind's + the last
    assert not list((tmp_path / "cache").rglob("*.partial*"))
    assert any("shard features: shard" in m for m in runs["cached"][1])
    # the fill says up front what it will compute and, after each shard, what is left
    plan = [m for m in runs["cached"][1] if "shards to compute" in m]
    shard_lines = [m for m in runs["cached"][1] if "shard features: shard" in m]
    assert len(plan) == 1 and shard_lines[-1].endswith(" 0:00 left")
    # each shard named with its directory (two directories hold shards of the same file name)
    named = [m.split("(", 1)[1].split(",", 1)[0] for m in shard_lines]
    assert len(set(named)) == len(named) and {n.split("/")[0] for n in named} == {pathlib.Path(d).name for d in dirs}
    total = plan[0].rsplit(", ", 1)[1].removesuffix(" positions")
    assert f"{total}/{total} positions" in shard_lines[-1]
    assert not any("shard features: shard" in m for m in runs["again"][1])
    assert any("features cached in" in m for m in runs["again"][1])
    np.testing.assert_allclose(runs["cached"][0], runs["online"][0], rtol=1e-4)
    assert runs["again"][0] == runs["cached"][0]
    # The cached rows are the target's features of the batch's tokens, position by position.
    s = distill.distill_settings(cfg("float32"))
    stream = distill.ShardStream(dirs, seed=2, tokens_per_batch=256, widths=(32, 64), window=2)
    feats = distill.shard_features(s, stream, toy_pair["target"])
    stream.with_features(feats)
    b = stream.batch(3)
    _, want, _ = toy_pair["target"].trunk(toy_pair["params"], jnp.asarray(b["tokens"]), None,
                                          collect=tuple(feats.layers) + (L - 1,))
    valid = b["tokens"] != 0
    for k, w in enumerate(want[:-1]):
        D = w.shape[-1]
        np.testing.assert_allclose(b["features"][..., k * D:(k + 1) * D][valid], np.asarray(w)[valid], atol=2e-5)
    np.testing.assert_allclose(b["final_residual"][valid], np.asarray(want[-1])[valid], atol=2e-5)
    # Filling the union of both kinds' layers (one pass) leaves nothing for the other kind to compute.
    other = cfg("float32")
    other.draft.kind = "eagle3" if kind == "eagle" else "eagle"
    other.head.ttt_steps = 1
    n = distill.fill_shard_features([cfg("float32"), other], log=lambda m: None)
    assert (n > 0) == (kind == "eagle")         # EAGLE-3 runs had cached the last layer, EAGLE's own
    assert distill.fill_shard_features([other], log=lambda m: None) == 0
    assert not distill.shard_features(distill.distill_settings(other), stream, toy_pair["target"]).missing()
    with pytest.raises(ValueError, match="same target"):
        distill.fill_shard_features([cfg("float32"), cfg("float16")])
    # A forward that fails mid-shard leaves no temporary file and no file under a complete name.
    fresh = distill.shard_features(s.replace(data_root=str(tmp_path / "cache2")), stream, toy_pair["target"])
    calls = []

    def failing(params, tokens_BW, layers):
        calls.append(1)
        if len(calls) > 1:
            raise FloatingPointError("injected")
        return distill.shard_feature_forward(toy_pair["target"])(params, tokens_BW, layers)

    with pytest.raises(FloatingPointError, match="injected"):
        fresh.compute(failing, toy_pair["params"], tokens_per_batch=64)
    assert len(calls) == 2 and not list(fresh.dir.iterdir())
    # A file of the wrong width (another model's) is named when read.
    wide = feats.path(0, L - 1)
    n = np.load(wide, mmap_mode="r").shape[0]
    np.save(wide, np.zeros((n, 3), np.float32))
    with pytest.raises(ValueError, match=r"float32\[\d+, 3\] where the shard needs float32"):
        stream.with_features(distill.shard_features(s, stream, toy_pair["target"]))
    # A file cut short (not a partial one: a complete name) is named when read.
    victim = feats.path(0, L - 1)
    np.save(victim, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="stale feature cache"):
        stream.with_features(distill.shard_features(s, stream, toy_pair["target"]))
    victim.write_bytes(b"not an npy file")
    with pytest.raises(ValueError, match="unreadable feature cache"):
        stream.with_features(distill.shard_features(s, stream, toy_pair["target"]))


def test_streamed_shards_are_for_heads_only(toy_pair, tmp_path):
    dirs = toy.write_shards(tmp_path / "corpus", toy_pair["data_path"])
    c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"], data_root=tmp_path / "cache")
    c.data.shards.update(dirs=tuple(dirs), weight=1.0)
    with pytest.raises(ValueError, match="data.shards .*trains feature heads"):
        distill.train(c, tmp_path / "wd", log=lambda m: None)
    c.data.shards.dirs = ()
    with pytest.raises(ValueError, match="data.shards.dirs is empty"):
        distill.train(c, tmp_path / "wd2", log=lambda m: None)


def test_a_reduced_head_sized_by_coverage(toy_pair, tmp_path):
    """``draft.head_vocab_coverage``: the head holds the fewest most frequent continuation tokens
    whose counts reach that share of the data's continuation tokens (checked against counts made
    here from the data file), and is exported at that size; the rule on hand-made counts, with the
    stop tokens placed first and ``head_vocab`` as a cap; a share outside [0, 1] is refused by name."""
    import ml_collections

    counts = np.array([50, 30, 10, 5, 5, 0])
    assert distill.head_vocabulary(counts, 0, coverage=0.8).tolist() == [0, 1]          # 80 of 100
    assert distill.head_vocabulary(counts, 0, coverage=0.81).tolist() == [0, 1, 2]
    assert distill.head_vocabulary(counts, 0, always=[4], coverage=0.8).tolist() == [0, 1, 4]   # 5 + 50 + 30
    assert distill.head_vocabulary(counts, 0, always=[4], coverage=0.5).tolist() == [0, 4]
    assert distill.head_vocabulary(counts, 2, coverage=0.95).tolist() == [0, 1]          # the cap
    assert distill.head_vocabulary(counts, 0, coverage=1.0).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"config.draft.head_vocab_coverage=1.5"):
        distill.DraftChoice(head_vocab_coverage=1.5)

    c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"], data_root=tmp_path / "cache",
                   budget=600, export_dir=tmp_path / "export")
    c.draft.update(kind="eagle", head_vocab=0, head_vocab_coverage=0.9)
    c.data.draft_weight = 0.0
    c.head = ml_collections.ConfigDict({"ttt_steps": 1, "feature_weight": 0.0, "num_heads": 3, "feature_layers": ()})
    logs = []
    distill.train(c, tmp_path / "wd", log=logs.append)
    recs = [json.loads(line) for line in pathlib.Path(toy_pair["data_path"]).read_text().splitlines()]
    data = np.bincount(np.concatenate([r["tokens"][r["prompt_length"]:] for r in recs]), minlength=toy.VOCAB)
    ranked = np.cumsum(np.sort(data)[::-1])
    want = int(np.searchsorted(ranked, 0.9 * data.sum() * (1 - 1e-12))) + 1
    assert 1 < want < toy.VOCAB
    line = next(m for m in logs if m.startswith("reduced head:"))
    assert line.startswith(f"reduced head: {want} tokens (chosen for coverage >= 0.9)"), line
    drafter, _ = drafters.load_head(tmp_path / "export", toy_pair["target"], toy_pair["params"])
    assert drafter.model.config.head_size == want


BF16_HEADS = {"eagle3": (40, True), "parallel": (None, False)}      # (head_size, input_norm)


@pytest.mark.parametrize("kind", list(BF16_HEADS))
def test_bfloat16_compute_trains_float32_weights(toy_pair, trained, kind):
    """``head.compute_dtype='bfloat16'``: the head's forward and backward run in bf16 while its
    master weights and optimizer state stay float32: the first loss is float32's within bf16's
    rounding (2% relative), the weights stay float32 and move, and 25 steps on one batch lower
    the divergence as float32 compute does; a dtype other than float32/bfloat16 is refused.
    (Both runs: `trained`; EAGLE-3 with a 40-token vocabulary and input norms, the parallel
    drafter plain: the float32 runs are the loss test's.)"""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        t = trained(kind, *BF16_HEADS[kind], dtype)
        loss = functools.partial(distill.head_loss, draft=t.obj, spec=distill.LossSpec("fkl"))
        jaxpr = str(jax.make_jaxpr(loss)(t.start, t.frozen, t.head_UD, t.batch))
        assert ("bf16[" in jaxpr) == (dtype == "bfloat16")        # the head's forward really runs in bf16
        assert all(a["nonfinite"] == 0.0 for a in t.aux)
        leaves = jax.tree.leaves(t.state.params)
        assert all(x.dtype == jnp.float32 for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))
        moved = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), b), t.state.params, t.start)
        assert all(jax.tree.leaves(moved))
        runs[dtype] = [float(a["divergence_step1"]) for a in t.aux]
    f32, bf16 = runs["float32"], runs["bfloat16"]
    assert bf16[0] != f32[0] and abs(bf16[0] - f32[0]) <= 0.02 * f32[0], (bf16[0], f32[0])
    assert bf16[-1] < 0.9 * bf16[0] and bf16[-1] < 1.1 * f32[-1], (bf16, f32)
    with pytest.raises(ValueError, match="head.compute_dtype"):
        distill.HeadObjective(t.obj.config, toy_pair["target"], compute_dtype="float16")
