"""Distillation: divergences against NumPy, the train step, data plumbing, reduced-head drafts,
the greedy accepted-tokens simulation against the real engine, and the draft artifact."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, distill, models, sampling
from specjax.drafters import ModelDrafter
from specjax.models.draft_artifact import load_draft, save_draft
from specjax.models.reduced_head import reduce_head

import _distill_toy as toy


# ----------------------------------------------------------------------------- divergences

def _np_probs(logits, temperature):
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _np_kl(p, q):
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
    return t.sum(-1)


def _np_div(name, pl, ql, temperature=1.0, beta=0.5):
    p, q = _np_probs(pl, temperature), _np_probs(ql, temperature)
    if name == "fkl":
        return _np_kl(p, q)
    if name == "rkl":
        return _np_kl(q, p)
    if name == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * _np_kl(p, m) + (1 - beta) * _np_kl(q, m)
    return 0.5 * np.abs(p - q).sum(-1)


@pytest.mark.parametrize("name", distill.DIVERGENCES)
@pytest.mark.parametrize("temperature,beta", [(1.0, 0.5), (0.7, 0.1), (2.0, 0.9)])
def test_divergence_matches_numpy(name, temperature, beta):
    rng = np.random.default_rng(0)
    pl = rng.normal(0, 3, (4, 5, 33)).astype(np.float32)
    ql = rng.normal(0, 3, (4, 5, 33)).astype(np.float32)
    got = np.asarray(distill.divergence(name, pl, ql, temperature, beta))
    want = _np_div(name, pl, ql, temperature, beta)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert (got > 1e-4).all()     # different distributions: strictly positive


@pytest.mark.parametrize("name", distill.DIVERGENCES)
def test_divergence_zero_iff_equal(name):
    rng = np.random.default_rng(1)
    pl = rng.normal(0, 3, (6, 50)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(distill.divergence(name, pl, pl)), 0.0, atol=1e-6)
    # Equal up to a per-row shift of the logits: the same distribution.
    np.testing.assert_allclose(np.asarray(distill.divergence(name, pl, pl + 5.0)), 0.0, atol=1e-5)
    # The top logit raised by 1: a different distribution, a positive divergence.
    ql = pl.copy()
    ql[np.arange(6), pl.argmax(-1)] += 1.0
    assert (np.asarray(distill.divergence(name, pl, ql)) > 1e-3).all()


def test_divergence_with_zero_probabilities():
    """-inf logits (tokens off a reduced head): 0 log 0 = 0, finite gradients; FKL is +inf
    only where q = 0 and p > 0."""
    pl = np.array([[0.0, 1.0, -np.inf, 2.0]], np.float32)
    ql = np.array([[0.5, 1.0, -np.inf, 1.0]], np.float32)
    for name in distill.DIVERGENCES:
        got = float(distill.divergence(name, pl, ql)[0])
        want = float(_np_div(name, np.where(np.isinf(pl), -1e30, pl), np.where(np.isinf(ql), -1e30, ql))[0])
        assert np.isfinite(got) and abs(got - want) < 1e-5, name
        g = jax.grad(lambda q: distill.divergence(name, jnp.asarray(pl), q).sum())(jnp.asarray(ql))
        assert np.isfinite(np.asarray(g)).all(), name
    q_missing = np.array([[0.5, 1.0, 3.0, -np.inf]], np.float32)
    assert np.isinf(float(distill.forward_kl(pl, q_missing)[0]))
    # TVD relates to the acceptance rate: 1 - TVD = sum min(p, q).
    p, q = _np_probs(pl, 1.0), _np_probs(ql, 1.0)
    np.testing.assert_allclose(1 - float(distill.total_variation(pl, ql)[0]), np.minimum(p, q).sum(), atol=1e-6)


def test_masked_mean():
    v = jnp.asarray([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    m = jnp.asarray([[1, 1, 0], [1, 0, 0]])
    assert float(distill.masked_mean(v, m)) == pytest.approx(2.0)
    assert float(distill.masked_mean(v, jnp.zeros_like(m))) == 0.0


# ----------------------------------------------------------------------------- toy pair

@pytest.fixture(scope="module")
def toy_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_toy")
    target_dir = toy.write_target(root / "target")
    target, tparams = models.load(str(target_dir))
    data_path = toy.write_data(root / "data.jsonl")
    seqs = distill.from_jsonl(data_path)
    hidden = distill.teacher_states(target, tparams, seqs, widths=(32, 64), tokens_per_batch=256)
    data = distill.TeacherData(seqs, hidden, 64)
    return dict(root=root, target_dir=target_dir, target=target, params=tparams, data_path=data_path, data=data)


def test_teacher_states_are_the_targets_hidden_states(toy_pair):
    t, p, data = toy_pair["target"], toy_pair["params"], toy_pair["data"]
    rows = (0, 5, 17)
    toks = [data.seqs.tokens[i][:64] for i in rows]
    width = max(map(len, toks))
    # The three rows right-padded in one jitted forward (causal: the padding comes after the
    # positions read; op by op, each row's length compiled every op anew).
    hs = np.asarray(jax.jit(lambda params, t_BT: t.hidden_states(params, t_BT, None)[0])(
        p, jnp.asarray([np.pad(x, (0, width - len(x))) for x in toks], jnp.int32)))
    for i, h in zip(rows, hs):
        P = int(data.seqs.prompt_lengths[i])
        got = np.asarray(data.hidden[data.offsets[i]:data.offsets[i + 1]])
        # The teacher's batches vs this batch (both padded, other shapes): float32 reassociation
        # only (up to 1.7e-4 on these O(1) states with the suite's fast-compile XLA options; a
        # state of another position or row differs by O(1)).
        np.testing.assert_allclose(got, h[P - 1:P - 1 + data.counts[i]], rtol=1e-4, atol=5e-4)


def test_batch_plan_is_deterministic_and_masks_the_continuation(toy_pair):
    data = toy_pair["data"]
    a = distill.BatchPlan(data, seed=3, tokens_per_batch=256, widths=(32, 64))
    b = distill.BatchPlan(data, seed=3, tokens_per_batch=256, widths=(32, 64))
    n_epoch = a.batches_per_epoch
    for i in (0, 1, n_epoch - 1, n_epoch, n_epoch + 2):   # also into the second epoch
        x, y = a.batch(i), b.batch(i)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    # One epoch covers every loss token exactly once.
    total = sum(a.batch(i)["mask"].sum() for i in range(n_epoch))
    assert total == data.num_loss_tokens
    c = distill.BatchPlan(data, seed=4, tokens_per_batch=256, widths=(32, 64))
    assert any(not np.array_equal(a.batch(i)["tokens"], c.batch(i)["tokens"]) for i in range(n_epoch))
    # Mask: positions P-1 .. n-2 of each row; the hidden is zero elsewhere.
    bt = a.batch(0)
    m = bt["mask"] > 0
    assert not bt["teacher_hidden"][~m].any()


# Every divergence with the full head, and the reduced head (40 tokens) with FKL: a reduced head
# changes the draft's logits (-inf off the head) and the teacher's head rows, the same code for
# every divergence; each divergence on -inf logits (values, finite gradients) is
# test_divergence_with_zero_probabilities.
@pytest.mark.parametrize("head_vocab,name", [(0, name) for name in distill.DIVERGENCES] + [(40, "fkl")])
def test_train_step_lowers_the_divergence_and_never_touches_the_target(toy_pair, name, head_vocab):
    target, tparams, data = toy_pair["target"], toy_pair["params"], toy_pair["data"]
    tparams_before = jax.tree.map(np.array, tparams)
    head_ids = np.arange(0, 64, 64 // 40 + 1)[:40] if head_vocab else None
    if head_vocab:
        head_ids = np.sort(np.random.default_rng(0).choice(64, 40, replace=False))
    choice = distill.DraftChoice(layers=(0,), head_vocab=head_vocab)
    draft, params = distill.build_draft(choice, target, tparams, key=jax.random.key(0), head_ids=head_ids)
    opt, _ = distill.make_optimizer(learning_rate=3e-3, warmup_steps=2, total_updates=40)
    state, frozen = distill.init_state(params, choice.trainable, opt, jax.random.key(1))
    head = distill.teacher_head(target, tparams, head_ids)
    step = distill.make_train_step(draft, distill.LossSpec(name), opt)
    # One batch width (the batch shape does not matter here): one compiled step per case.
    plan = distill.BatchPlan(data, seed=0, tokens_per_batch=256, widths=(64,))
    fixed = {k: jnp.asarray(v) for k, v in plan.batch(0).items()}
    spec = distill.LossSpec(name)

    @jax.jit          # the loss, and its gradients with respect to the teacher's head and states
    def loss_and_teacher_grads(params, h, th):
        f = lambda h, th: distill.loss_fn(params, frozen, h, {**fixed, "teacher_hidden": th},   # noqa: E731
                                          draft=draft, spec=spec)[0]
        return f(h, th), jax.grad(f, argnums=(0, 1))(h, th)

    loss0 = float(loss_and_teacher_grads(state.params, head, fixed["teacher_hidden"])[0])
    for i in range(40):
        state, aux = step(state, frozen, head, {k: jnp.asarray(v) for k, v in plan.batch(i).items()})
        assert np.isfinite(aux["loss"])
    loss1, (g_head, g_hidden) = loss_and_teacher_grads(state.params, head, fixed["teacher_hidden"])
    loss1 = float(loss1)
    assert loss1 < 0.85 * loss0, (name, loss0, loss1)   # 40 steps: fkl ~-40%, tvd ~-20%
    # The target is frozen: no gradient reaches the teacher's head or states, and its params
    # are unchanged (they are not part of the train state at all).
    assert not np.asarray(g_head).any() and not np.asarray(g_hidden).any()
    jax.tree.map(np.testing.assert_array_equal, tparams_before, jax.tree.map(np.array, tparams))
    assert set(state.params) == set(choice.trainable)


def test_gradient_accumulation_matches_one_big_batch(toy_pair):
    """Two micro-batches with accumulate=2 give the same update as their mean gradient."""
    target, tparams, data = toy_pair["target"], toy_pair["params"], toy_pair["data"]
    choice = distill.DraftChoice(layers=(0,))
    draft, params = distill.build_draft(choice, target, tparams, key=jax.random.key(0))
    head = distill.teacher_head(target, tparams)
    plan = distill.BatchPlan(data, seed=0, tokens_per_batch=256, widths=(64,))       # one batch shape
    b0, b1 = ({k: jnp.asarray(v) for k, v in plan.batch(i).items()} for i in (0, 1))
    spec = distill.LossSpec("fkl")
    acc, _ = distill.make_optimizer(learning_rate=1e-2, warmup_steps=0, total_updates=5, accumulate=2)
    s, frozen = distill.init_state(params, choice.trainable, acc, jax.random.key(1))
    step = distill.make_train_step(draft, spec, acc)
    p_start = jax.tree.map(np.array, s.params)
    s, _ = step(s, frozen, head, b0)
    jax.tree.map(np.testing.assert_array_equal, p_start, jax.tree.map(np.array, s.params))   # no update yet
    s, _ = step(s, frozen, head, b1)
    one, _ = distill.make_optimizer(learning_rate=1e-2, warmup_steps=0, total_updates=5)
    s1, _ = distill.init_state(params, choice.trainable, one, jax.random.key(1))
    # (jitted: op by op, the reference gradients and update compiled hundreds of small programs)
    grad = jax.jit(jax.grad(lambda t, b: distill.loss_fn(t, frozen, head, b, draft=draft, spec=spec)[0]))
    g = [grad(s1.params, b) for b in (b0, b1)]
    mean_g = jax.tree.map(lambda a, b: (a + b) / 2, *g)
    import optax

    @jax.jit
    def update(g, opt_state, params):
        return optax.apply_updates(params, one.update(g, opt_state, params)[0])

    want = update(mean_g, s1.opt_state, s1.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
                 s.params, want)


# ----------------------------------------------------------------------------- reduced head

def test_reduced_head_is_zero_off_the_head_and_exact_on_it(toy_pair):
    target, tparams = toy_pair["target"], toy_pair["params"]
    ids = np.array([1, 5, 7, 20, 33, 63])
    model, params = reduce_head(target, tparams, ids)
    toks = jnp.asarray([[3, 9, 27, 1, 5]])
    full, _ = target.apply(tparams, toks, None)
    red, _ = model.apply(params, toks, None)
    red = np.asarray(red)
    off = np.setdiff1d(np.arange(64), ids)
    assert np.isneginf(red[..., off]).all()
    np.testing.assert_allclose(red[..., ids], np.asarray(full)[..., ids], rtol=1e-5, atol=1e-5)
    q = np.asarray(sampling.probabilities(jnp.asarray(red), sampling.SamplingConfig.make(temperature=1.0)))
    assert (q[..., off] == 0).all() and np.allclose(q.sum(-1), 1.0, atol=1e-6)


def _run_engine(target, tparams, drafter, dparams, prompts, max_new, gamma, samp):
    """The engine's output (drafter None: target-only, gamma 0) on a batch whose capacity is the
    speculative run's, so that target-only and speculative runs see the same batch and keys."""
    config = decoding.GenerationConfig(max_new_tokens=max_new, gamma=gamma if drafter is not None else 0)
    batch = decoding.make_batch(prompts, config, jax.random.key(0), capacity=max(map(len, prompts)) + max_new + gamma + 1)
    return decoding.Engine(target, drafter, config).run(decoding.EngineParams(tparams, dparams), samp, batch)


# The prompts and length of the two greedy tests below: their target-only run is one program and
# one output (`target_greedy`).
GREEDY_PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [30, 31, 32, 33, 34, 35, 36]]
GREEDY_N, GREEDY_GAMMA = 40, 3


@pytest.fixture(scope="module")
def target_greedy(toy_pair):
    """The target-only greedy output on GREEDY_PROMPTS (the speculative runs' batch and keys)."""
    return _run_engine(toy_pair["target"], toy_pair["params"], None, None, GREEDY_PROMPTS, GREEDY_N, GREEDY_GAMMA,
                       sampling.SamplingConfig.greedy_config())


def test_reduced_head_draft_in_the_engine_greedy_equals_target_only(toy_pair, target_greedy):
    target, tparams = toy_pair["target"], toy_pair["params"]
    ids = np.sort(np.random.default_rng(2).choice(64, 24, replace=False))
    choice = distill.DraftChoice(layers=(0, 2), head_vocab=24)
    draft, dparams = distill.build_draft(choice, target, tparams, key=jax.random.key(0), head_ids=ids)
    greedy = sampling.SamplingConfig.greedy_config()
    spec = _run_engine(target, tparams, ModelDrafter(draft), dparams, GREEDY_PROMPTS, GREEDY_N, GREEDY_GAMMA, greedy)
    assert target_greedy.generated() == spec.generated()
    # And at temperature 1 the draft's q is a distribution over the head only (the speculative
    # run alone: a target-only run at T = 1 would be one more compiled program, unused).
    t1 = sampling.SamplingConfig.make(temperature=1.0)
    out = _run_engine(target, tparams, ModelDrafter(draft), dparams, GREEDY_PROMPTS, GREEDY_N, GREEDY_GAMMA, t1)
    assert int(out.metrics.summary()["invalid_draft_rounds"]) == 0


def test_greedy_accepted_per_pass_matches_the_engine(toy_pair, target_greedy):
    """The teacher-forced simulation used during training evaluation gives the engine's own
    count of committed tokens per target pass on the target's greedy continuation."""
    target, tparams = toy_pair["target"], toy_pair["params"]
    choice = distill.DraftChoice(layers=(0,))
    draft, dparams = distill.build_draft(choice, target, tparams, key=jax.random.key(0))
    prompts, N, gamma = GREEDY_PROMPTS, GREEDY_N, GREEDY_GAMMA
    greedy = sampling.SamplingConfig.greedy_config()
    ref = target_greedy
    spec = _run_engine(target, tparams, ModelDrafter(draft), dparams, prompts, N, gamma, greedy)
    m = jax.device_get(spec.metrics)
    # the draft's teacher-forced greedy choices on every row at once (right-padded: causal, the
    # padding comes after the positions read; one compiled program)
    seqs = [p + gen for p, gen in zip(prompts, ref.generated())]
    width = max(map(len, seqs))
    preds = np.asarray(jax.jit(lambda d, t: jnp.argmax(draft.apply(d, t, None)[0], -1))(
        dparams, jnp.asarray([s + [0] * (width - len(s)) for s in seqs])))
    for b, (p, gen) in enumerate(zip(prompts, ref.generated())):
        seq = np.asarray(p + gen)
        pred = preds[b][:len(seq)]
        agree = pred[len(p) - 1:len(seq) - 1] == seq[len(p):]
        committed, passes = distill.greedy_accepted_per_pass(agree, gamma)
        assert committed == N == int(m.committed_B[b])
        assert passes == int(m.rounds_B[b]), (b, passes, int(m.rounds_B[b]))


@pytest.mark.parametrize("head_vocab", [0, 24])
def test_evaluate_scores_exactly_the_continuation_positions(toy_pair, head_vocab):
    """`distill.evaluate` (which runs the vocabulary-sized work at the continuation positions
    only) equals the definition computed at every position and then masked: alpha = mean of
    sum_x min(p, q) at temperature 1, agreement = mean of [argmax q = argmax p], and the greedy
    committed tokens per pass of each row's agreement sequence."""
    target, tparams, data = toy_pair["target"], toy_pair["params"], toy_pair["data"]
    ids = np.sort(np.random.default_rng(3).choice(64, 24, replace=False)) if head_vocab else None
    choice = distill.DraftChoice(layers=(1,), head_vocab=head_vocab)
    draft, dparams = distill.build_draft(choice, target, tparams, key=jax.random.key(0), head_ids=ids)
    plan = distill.BatchPlan(data, 0, 256, (32, 64))
    full_head = distill.teacher_head(target, tparams, None)
    got = distill.evaluate(draft, dparams, full_head, plan, (1, 3))
    a_sum = g_sum = n = 0.0
    committed = {1: 0, 3: 0}
    passes = {1: 0, 3: 0}

    @jax.jit          # (one program per batch width: op by op, each op compiled on its own)
    def p_and_q(dparams, tokens, hidden):
        return (jax.nn.softmax(jnp.einsum("btd,vd->btv", hidden, full_head), -1),
                jax.nn.softmax(draft.apply(dparams, tokens, None)[0], -1))

    for i in range(plan.batches_per_epoch):
        b = plan.batch(i)
        p, q = (np.asarray(x) for x in p_and_q(dparams, jnp.asarray(b["tokens"]), jnp.asarray(b["teacher_hidden"])))
        m = b["mask"] > 0
        a_sum += float(np.minimum(p, q).sum(-1)[m].sum())
        agree = p.argmax(-1) == q.argmax(-1)
        g_sum += float(agree[m].sum())
        n += float(m.sum())
        for r in range(m.shape[0]):
            if m[r].any():
                for g in (1, 3):
                    c, ps = distill.greedy_accepted_per_pass(agree[r][m[r]], g)
                    committed[g] += c
                    passes[g] += ps
    assert got["eval_tokens"] == n > 0
    assert got["alpha_t1"] == pytest.approx(a_sum / n, rel=1e-5)
    assert got["greedy_agreement"] == pytest.approx(g_sum / n, abs=1e-9)
    for g in (1, 3):
        assert got[f"greedy_tokens_per_pass_g{g}"] == pytest.approx(committed[g] / passes[g], abs=1e-9)


# ----------------------------------------------------------------------------- data + artifact

def test_sequence_set_round_trip_and_validation(tmp_path):
    s = distill.SequenceSet([[1, 2, 3], [4, 5, 6, 7]], [1, 2], "x")
    s.save(tmp_path / "s.npz")
    t = distill.SequenceSet.load(tmp_path / "s.npz")
    assert [a.tolist() for a in t.tokens] == [[1, 2, 3], [4, 5, 6, 7]] and t.num_loss_tokens == 4
    with pytest.raises(ValueError, match="prompt length"):
        distill.SequenceSet([[1, 2]], [3])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="needs 'tokens'"):
        distill.from_jsonl(tmp_path / "bad.jsonl")


def test_generate_does_not_depend_on_batching(toy_pair):
    target, tparams = toy_pair["target"], toy_pair["params"]
    prompts = [[1, 2, 3], [4] * 9, [5, 6], [7, 8, 9, 10, 11]]
    t1 = sampling.SamplingConfig.make(temperature=1.0)
    kw = dict(key=jax.random.key(3), sampling=t1, max_new_tokens=12, samples_per_prompt=2)
    # All 8 requests in one batch, padded to 16.
    a = distill.generate(target, tparams, prompts, batch_size=8, width_multiple=16, slots=False, **kw)
    # Batches of 4 requests (sorted by prompt length): other rows beside each request.
    b = distill.generate(target, tparams, prompts, batch_size=4, width_multiple=16, slots=False, **kw)
    assert [x.tolist() for x in a.tokens] == [x.tolist() for x in b.tokens]
    # The slot-refilling scheduler (per-width groups of slots: widths 8 and 16, 2 slots each; 6
    # requests refill the first: other rows, other padding) gives the same data.
    c = distill.generate(target, tparams, prompts, batch_size=2, width_multiple=8, slots=True, **kw)
    assert [x.tolist() for x in a.tokens] == [x.tolist() for x in c.tokens]
    assert a.prompt_lengths.tolist() == [3, 3, 9, 9, 2, 2, 5, 5]
    assert all(len(x) == p + 12 for x, p in zip(a.tokens, a.prompt_lengths))


@pytest.mark.parametrize("head_vocab", [0, 24])
def test_draft_artifact_round_trip(toy_pair, tmp_path, head_vocab):
    target, tparams = toy_pair["target"], toy_pair["params"]
    ids = np.arange(24) * 2 if head_vocab else None
    choice = distill.DraftChoice(layers=(1, 2), head_vocab=head_vocab)
    draft, params = distill.build_draft(choice, target, tparams, key=jax.random.key(0), head_ids=ids)
    desc = save_draft(tmp_path / "d", draft, params, shared=choice.shared, dtype="float32")
    # Shared tensors are not stored.
    from safetensors.numpy import load_file
    names = set(load_file(str(tmp_path / "d" / "draft.safetensors")))
    assert "embed" not in names and ("head" not in names) and ("head_ids" in names) == bool(head_vocab)
    model, loaded = load_draft(tmp_path / "d", target, tparams, scan_layers=True)
    assert type(model) is type(draft) and desc["head_size"] == head_vocab
    toks = jnp.asarray([[1, 2, 3, 4]])
    np.testing.assert_array_equal(np.asarray(draft.apply(params, toks, None)[0]),
                                  np.asarray(model.apply(loaded, toks, None)[0]))
    # The default (unrolled layers) computes the same function, up to float32 reassociation.
    model_u, loaded_u = load_draft(tmp_path / "d", target, tparams)
    assert not model_u.config.scan_layers and isinstance(loaded_u["layers"], tuple)
    np.testing.assert_allclose(np.asarray(model_u.apply(loaded_u, toks, None)[0]),
                               np.asarray(draft.apply(params, toks, None)[0]), rtol=1e-5, atol=1e-5)
    # As a standalone HF checkpoint (full head): the same logits on the head's tokens.
    from specjax.models.draft_artifact import export_draft_hf
    export_draft_hf(tmp_path / "d", target, tparams, tmp_path / "hf")
    hf_model, hf_params = models.load(str(tmp_path / "hf"))
    got = np.asarray(hf_model.apply(hf_params, toks, None)[0])
    want = np.asarray(draft.apply(params, toks, None)[0])
    on = np.isfinite(want)
    np.testing.assert_allclose(got[on], want[on], rtol=1e-5, atol=1e-5)
    # A draft written before ModelConfig.linear_op names packed_projections (false) in its config.
    meta_path = tmp_path / "d" / "draft.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["packed_projections"] = False
    meta_path.write_text(json.dumps(meta))
    model_o, loaded_o = load_draft(tmp_path / "d", target, tparams, scan_layers=True)
    np.testing.assert_array_equal(np.asarray(model_o.apply(loaded_o, toks, None)[0]),
                                  np.asarray(model.apply(loaded, toks, None)[0]))
    # bfloat16 storage: close, smaller.
    desc16 = save_draft(tmp_path / "d16", draft, params, shared=choice.shared, dtype="bfloat16")
    assert desc16["bytes"] < 0.6 * desc["bytes"]
    # A flipped byte is caught by the recorded sha256.
    blob = bytearray((tmp_path / "d" / "draft.safetensors").read_bytes())
    blob[-3] ^= 0xFF
    (tmp_path / "d" / "draft.safetensors").write_bytes(bytes(blob))
    with pytest.raises(models.CorruptCheckpointError, match="sha256"):
        load_draft(tmp_path / "d", target, tparams)


def test_loss_spec_and_draft_choice_errors():
    with pytest.raises(ValueError, match="unknown divergence"):
        distill.LossSpec("kl")
    with pytest.raises(ValueError, match="beta"):
        distill.LossSpec("jsd", beta=1.0)
    with pytest.raises(ValueError, match="layer ids"):
        distill.select_layers({"layers": {"w": jnp.zeros((2, 1))}}, models.ModelConfig(
            vocab_size=8, hidden_size=4, num_layers=2, num_heads=1, num_kv_heads=1, head_dim=4, ffn_size=8), [2])


# The two training runs with on-policy data below: a budget, a batch shape (one width: one compiled
# step and one teacher program) and an on-policy refresh (prompts, new tokens, batch: 8 x 16 in one
# batch) in common.
ON_POLICY_BUDGET = 1500
ON_POLICY_WIDTHS = (64,)
ON_POLICY_REFRESH = (8, 16, 8)


def test_on_policy_mixture_run(toy_pair, tmp_path):
    """A run mixing fixed data with the draft's own generations: refreshed every 4 steps from
    the current draft, cached in the workdir, teacher states from the target. (The budget, batch
    shape and refresh size of test_metrics_read_one_step_late_are_the_same_records: the same
    compiled programs.)"""
    c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"], data_root=tmp_path / "cache",
                   budget=ON_POLICY_BUDGET)
    c.data.draft_weight = 1.0
    c.data.draft_refresh_every = 4
    c.data.draft_prompts, c.data.draft_max_new_tokens, c.data.gen_batch_size = ON_POLICY_REFRESH
    c.data.widths = ON_POLICY_WIDTHS
    data = toy_pair["data"]
    c.data.max_prompt_tokens = int(np.median(data.seqs.prompt_lengths))     # leaves some sequences out
    summary = distill.train(c, tmp_path / "work", log=lambda *_: None)
    assert summary["tokens"] >= ON_POLICY_BUDGET
    # One pass over the fixed data as trained on (long prompts left out) is reported; on-policy
    # data has no fixed size.
    used = sum(int(n) for n, p in zip(data.counts, data.seqs.prompt_lengths) if p <= c.data.max_prompt_tokens)
    assert 0 < used < data.num_loss_tokens
    assert summary["data_loss_tokens"] == {"fixed": used}
    recs = [json.loads(l) for l in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    refreshes = [r for r in recs if r.get("event") == "onpolicy_refresh"]
    assert {r["source"] for r in train} == {"fixed", "draft"}
    n_draft = sum(r["source"] == "draft" for r in train)
    assert len(refreshes) == len({(r["step"] - 1) // 4 for r in train if r["source"] == "draft"}) >= 2
    assert n_draft > len(train) // 4
    # The cached on-policy sets: prompts from the training data, 16 generated tokens each (or EOS),
    # and the teacher states are the target's.
    prompts = {tuple(t[:p].tolist()) for t, p in zip(toy_pair["data"].seqs.tokens, toy_pair["data"].seqs.prompt_lengths)}
    d0 = sorted((tmp_path / "work" / "onpolicy").iterdir())[0]
    data = distill.TeacherData.load(d0, 64)
    n_prompts, max_new, _ = ON_POLICY_REFRESH
    assert len(data.seqs) == n_prompts
    for t, p in zip(data.seqs.tokens, data.seqs.prompt_lengths):
        assert tuple(t[:p].tolist()) in prompts and len(t) - p <= max_new
    t0 = data.seqs.tokens[0]
    target = toy_pair["target"]
    hidden = jax.jit(lambda p, t: target.hidden_states(p, t, None)[0])       # (one program, not op by op)
    h = np.asarray(hidden(toy_pair["params"], jnp.asarray(t0)[None])[0])
    P = int(data.seqs.prompt_lengths[0])
    np.testing.assert_allclose(np.asarray(data.hidden[:data.counts[0]]), h[P - 1:P - 1 + data.counts[0]],
                               rtol=1e-4, atol=1e-4)


def test_fresh_draft_shares_the_embedding_and_learns(toy_pair):
    """A fresh small config: random layers, the target's embedding (frozen, shared)."""
    target, tparams, data = toy_pair["target"], toy_pair["params"], toy_pair["data"]
    choice = distill.DraftChoice(kind="fresh", num_layers=1, ffn_size=48)
    draft, params = distill.build_draft(choice, target, tparams, key=jax.random.key(5))
    assert draft.config.num_layers == 1 and draft.config.ffn_size == 48
    assert params["embed"] is distill.teacher_head(target, tparams)   # the target's own array
    assert "embed" in choice.shared and "embed" not in choice.trainable
    opt, _ = distill.make_optimizer(learning_rate=1e-2, warmup_steps=2, total_updates=30)
    state, frozen = distill.init_state(params, choice.trainable, opt, jax.random.key(1))
    head = distill.teacher_head(target, tparams)
    step = distill.make_train_step(draft, distill.LossSpec("fkl"), opt)
    plan = distill.BatchPlan(data, seed=0, tokens_per_batch=256, widths=(64,))       # one compiled step
    b0 = {k: jnp.asarray(v) for k, v in plan.batch(0).items()}
    spec = distill.LossSpec("fkl")
    loss0 = float(distill.loss_fn(state.params, frozen, head, b0, draft=draft, spec=spec)[0])
    for i in range(30):
        state, _ = step(state, frozen, head, {k: jnp.asarray(v) for k, v in plan.batch(i).items()})
    assert float(distill.loss_fn(state.params, frozen, head, b0, draft=draft, spec=spec)[0]) < 0.85 * loss0


def test_metrics_read_one_step_late_are_the_same_records(toy_pair, tmp_path):
    """`metrics_lag` = 1 (the host dispatches the next step before reading this one's metrics)
    writes the same training records as reading every step at once, in the same order, with
    the token counts the host derives from its batches equal to the device's loss_tokens, and
    checkpoints at the same steps. A non-finite step is reported at its own step number
    (test_bad_input_distill covers stopping and skipping)."""
    runs = {}
    for lag in (0, 1):
        c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"],
                       data_root=tmp_path / "cache", budget=ON_POLICY_BUDGET, checkpoint_every=4)
        c.metrics_lag = lag
        # configs/distill.py's on-policy share stays; its refresh made small (8 prompts x 16 tokens,
        # one batch: not 48 x 128 in two)
        c.data.draft_prompts, c.data.draft_max_new_tokens, c.data.gen_batch_size = ON_POLICY_REFRESH
        c.data.widths = ON_POLICY_WIDTHS
        work = tmp_path / f"work{lag}"
        distill.train(c, work, log=lambda *_: None)
        recs = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        runs[lag] = ([r for r in recs if r["kind"] == "train"], sorted(p.name for p in (work / "checkpoints").iterdir()))
    (sync, ck0), (lagged, ck1) = runs[0], runs[1]
    assert len(sync) >= 6 and [r["step"] for r in sync] == list(range(1, len(sync) + 1))
    assert ck0 == ck1
    drop = ("tokens_per_s", "elapsed_s")              # wall-clock
    assert [{k: v for k, v in r.items() if k not in drop} for r in lagged] == \
        [{k: v for k, v in r.items() if k not in drop} for r in sync]
    for r in sync:
        assert r["tokens"] == sum(int(x["loss_tokens"]) for x in sync if x["step"] <= r["step"])
    c = toy.config(target_dir=toy_pair["target_dir"], data_path=toy_pair["data_path"], data_root=tmp_path / "cache")
    c.metrics_lag = 2
    with pytest.raises(ValueError, match="metrics_lag=2"):
        distill.train(c, tmp_path / "bad", log=lambda *_: None)
