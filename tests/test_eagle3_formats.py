"""EAGLE-3 heads that other systems read and write (issue 41 item 3).

* An independent PyTorch forward of the published EAGLE-3 head, written here from the paper and
  the file format (not from specjax): the target's hidden states from transformers at the capture
  layers the file names (in its engine's convention), ``fc``, the two-norm layer, the head's own
  norm and LM head, d2t. It reads the same files and gives the same logits as specjax's head,
  at every prompt position and at the second drafting step (the head's own output in place of
  the fused feature), for a file in each layout and for specjax's export of it in the other;
  the trainer's training-time-test forward gives them too.
* Heads in both layouts (files written here, random weights) for a tiny random Llama target,
  imported through `build.make_drafter`, draft with greedy output equal to target-only.
* A head trained by specjax's train step, exported in both layouts and imported again, drafts
  identically (the same logits, bitwise; the same sampled tokens and acceptances).
* Sampled proposals come from q over the draft vocabulary (zero elsewhere); tree nodes score as
  the chain along their path; the reference's pytorch_model.bin reads as its safetensors.
* Bad d2t / t2d are refused naming the file.
"""
import collections
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _hf_tiny  # noqa: E402
from specjax import build, decoding, distill, drafters, models, sampling, trees  # noqa: E402
from specjax.models import CorruptCheckpointError, TensorShapeError, UnsupportedArchitectureError  # noqa: E402

V, D, L = 101, 32, 7          # the target: vocabulary, width, layers (7: the published default triple exists)
NAMES = {"input_layernorm": (D,), "hidden_norm": (D,), "post_attention_layernorm": (D,)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama target (transformers writes it; specjax and the reference read it)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=L,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, initializer_range=0.15, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("eagle3_target")
    hf.save_pretrained(path)
    model, params = models.load(str(path))
    return dict(hf=hf, model=model, params=params, path=path)


# ---------------------------------------------------------------------------------------
# Files in the two layouts, written here from the format (torch's [out, in] matrices)
# ---------------------------------------------------------------------------------------
def _layer_cfg(layer):
    return {"model_type": "llama", "hidden_size": D, "intermediate_size": layer["ffn"], "num_hidden_layers": 1,
            "num_attention_heads": layer["heads"], "num_key_value_heads": layer["kv_heads"],
            "head_dim": layer["head_dim"], "rms_norm_eps": 1e-5, "rope_theta": layer["theta"],
            "max_position_embeddings": 256, "vocab_size": V, "hidden_act": "silu", "tie_word_embeddings": False}


def write_head(directory, layout, layer, draft_ids, *, capture=None, seed=0, embed=None, scale=0.3):
    """A random head in `layout` ('eagle' | 'speculators'): `draft_ids` the target token of each
    draft row; `capture` the capture ids in the layout's own convention (None: none written)."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    S, N, K, H, F = len(draft_ids), layer["heads"], layer["kv_heads"], layer["head_dim"], layer["ffn"]
    pre = "midlayer." if layout == "eagle" else "layers.0."
    w = {"fc.weight": (D, 3 * D), pre + "self_attn.q_proj.weight": (N * H, 2 * D),
         pre + "self_attn.k_proj.weight": (K * H, 2 * D), pre + "self_attn.v_proj.weight": (K * H, 2 * D),
         pre + "self_attn.o_proj.weight": (D, N * H), pre + "mlp.gate_proj.weight": (F, D),
         pre + "mlp.up_proj.weight": (F, D), pre + "mlp.down_proj.weight": (D, F), "lm_head.weight": (S, D)}
    t = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in w.items()}
    t["fc.weight"] /= 4.0                     # three features of RMS ~1..3 into one of RMS ~1
    for k, s in NAMES.items():
        t[pre + k + ".weight"] = rng.uniform(0.5, 1.5, s).astype(np.float32)
    t["norm.weight"] = rng.uniform(0.5, 1.5, (D,)).astype(np.float32)
    ids = np.asarray(draft_ids, np.int64)
    t["d2t"] = ids - np.arange(S, dtype=np.int64)
    t["t2d"] = np.isin(np.arange(V), ids)
    if embed is not None:
        t["embed_tokens.weight"] = np.asarray(embed, np.float32)
    if layout == "eagle":
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **_layer_cfg(layer), "draft_vocab_size": S,
               "target_hidden_size": D, "torch_dtype": "float32"}
        if capture is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(capture), "use_aux_hidden_state": True}
    else:
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                      "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
               "transformer_layer_config": _layer_cfg(layer), "draft_vocab_size": S, "target_hidden_size": None,
               "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
        if capture is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(capture)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


# ---------------------------------------------------------------------------------------
# The reference: the published head in PyTorch, from the paper and the format
# ---------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):                       # x [T, heads, hd]; rotate-half pairing (dims i, i + hd/2)
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rot * sin


def reference_logits(directory, hf_target, tokens, second_row=None):
    """(step-1 logits [n - 1, S] of the draft entries (x_{i+1}, f_i), i = 0..n-2, at positions i;
    the second step's logits [S] after feeding the target token of draft row `second_row` (default:
    the last entry's argmax) with the last entry's output as its feature, at position n - 1; that
    token). The reference has no entry for x_0."""
    from safetensors.torch import load_file
    cfg = json.loads((directory / "config.json").read_text())
    W = load_file(str(directory / "model.safetensors"))
    n_layers = hf_target.config.num_hidden_layers
    default_inputs = [2, n_layers // 2, n_layers - 3]          # the reference: inputs of these layers
    if "speculators_config" in cfg:                            # vLLM / speculators: ids are layer inputs
        lc, pre = cfg["transformer_layer_config"], "layers.0."
        inputs = cfg.get("eagle_aux_hidden_state_layer_ids") or default_inputs
    else:                                                      # SGLang / SpecForge: ids are layer outputs
        lc, pre = cfg, "midlayer."
        outs = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        inputs = [i + 1 for i in outs] if outs else default_inputs
    N, K, eps, theta = lc["num_attention_heads"], lc["num_key_value_heads"], lc["rms_norm_eps"], lc["rope_theta"]
    hd = lc.get("head_dim") or lc["hidden_size"] // N
    P = lambda name: W[pre + name]  # noqa: E731
    with torch.no_grad():
        hs = hf_target(torch.as_tensor(np.asarray(tokens))[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in sorted(inputs)], -1)              # hs[i]: the input of layer i
        embed = W["embed_tokens.weight"] if "embed_tokens.weight" in W else hf_target.get_input_embeddings().weight

        def layer(e, g, pos, past):
            T = e.shape[0]
            x = torch.cat([_rms(e, P("input_layernorm.weight"), eps), _rms(g, P("hidden_norm.weight"), eps)], -1)
            q = _rope((x @ P("self_attn.q_proj.weight").T).view(T, N, hd), pos, theta)
            k = _rope((x @ P("self_attn.k_proj.weight").T).view(T, K, hd), pos, theta)
            v = (x @ P("self_attn.v_proj.weight").T).view(T, K, hd)
            if past is not None:
                k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
            kk, vv = k.repeat_interleave(N // K, dim=1), v.repeat_interleave(N // K, dim=1)
            s = torch.einsum("tnh,snh->nts", q, kk) / hd ** 0.5
            first = k.shape[0] - T
            s = s.masked_fill(torch.arange(k.shape[0])[None, :] > first + torch.arange(T)[:, None], float("-inf"))
            o = torch.einsum("nts,snh->tnh", s.softmax(-1), vv).reshape(T, N * hd) @ P("self_attn.o_proj.weight").T
            h = g + o
            y = _rms(h, P("post_attention_layernorm.weight"), eps)
            h = h + (torch.nn.functional.silu(y @ P("mlp.gate_proj.weight").T) * (y @ P("mlp.up_proj.weight").T)) \
                @ P("mlp.down_proj.weight").T
            return h, (k, v)

        def head(h):
            return _rms(h, W["norm.weight"], eps) @ W["lm_head.weight"].T

        n = len(tokens)
        g = feats[:-1] @ W["fc.weight"].T
        h1, kv = layer(embed[torch.as_tensor(tokens[1:])], g, torch.arange(n - 1), None)
        logits1 = head(h1)
        row = int(logits1[-1].argmax()) if second_row is None else second_row
        token = row + int(W["d2t"][row]) if "d2t" in W else row
        h2, _ = layer(embed[torch.as_tensor([token])], h1[-1:], torch.tensor([n - 1]), kv)
        return logits1.numpy(), head(h2)[0].numpy(), token


@functools.partial(jax.jit, static_argnums=(0, 2))
def _specjax_logits(drafter, hp, target, tp, toks_1N, token2_11):
    head = drafter.model
    n = toks_1N.shape[1]
    _, f_1NF, _ = target.apply_with_features(tp, toks_1N, target.init_cache(1, 64), layers=drafter.feature_layers)
    cache = head.init_cache(1, 64)
    cache = cache.replace(true_BSF=jnp.zeros((1, 64, f_1NF.shape[-1])).at[:, :n].set(f_1NF),
                          true_len_B=jnp.asarray([n], jnp.int32))
    s1, ids, cache = head.apply_support(hp, toks_1N, cache)
    cache = cache.replace(true_BSF=None, drafting=True)
    s2, _, _ = head.apply_support(hp, token2_11, cache)
    return s1[0, 1:], s2[0, 0], ids


def specjax_logits(drafter, hp, target, tp, tokens, token2):
    """The same through specjax's head: slot s holds (x_s, feature of s - 1); slot s + 1 is the
    reference's entry s. Then the drafting step (no target feature) on `token2`. One jitted
    program per (drafter, target, prompt length)."""
    out = _specjax_logits(drafter, hp, target, tp, jnp.asarray(tokens, jnp.int32)[None],
                          jnp.asarray([[token2]], jnp.int32))
    return tuple(np.asarray(x) for x in out)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _train_forward_scores(target, hc, tp, hp, seq_1S):
    """The trainer's cache-free forward (training-time test, two steps) on ``seq``: each step's
    head scores at every position."""
    _, feats, _ = target.apply_with_features(tp, seq_1S, None, layers=hc.feature_layers)
    steps = drafters.eagle_train_forward(hc, hp, seq_1S, feats, 2, with_logits=False)
    return [drafters.head_scores(hc, hp, h)[0] for h, _ in steps]


LAYERS = {"eagle": dict(heads=4, kv_heads=2, head_dim=8, ffn=64, theta=10000.0),       # the target's dimensions
          "speculators": dict(heads=8, kv_heads=4, head_dim=12, ffn=40, theta=5000.0)}  # its own
CAPTURE = {"eagle": None,                    # the published default: inputs of layers 2, 3, 4
           "speculators": [1, 3, 6]}         # vLLM ids: inputs of layers 1, 3, 6 = outputs of 0, 2, 5


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_reference_forward_matches(target, tmp_path, layout):
    """The PyTorch reference and specjax compute the same logits from the same files (float32),
    for a file written here and for specjax's export of it in the other layout; the capture
    layers each convention names are the ones specjax reads."""
    rng = np.random.default_rng(1)
    draft_ids = rng.permutation(V)[:40]                    # a draft vocabulary in no particular order
    embed = None if layout == "eagle" else np.asarray(target["params"]["embed"])
    d = write_head(tmp_path / layout, layout, LAYERS[layout], draft_ids, capture=CAPTURE[layout], embed=embed)
    drafter, hp = drafters.load_eagle3(d, target["model"], target["params"])
    hc = drafter.model.config
    assert hc.kind == drafters.EAGLE3_PUBLISHED and not hc.own_embedding
    assert hc.feature_layers == ((1, 2, 3) if layout == "eagle" else (0, 2, 5))
    tokens = [int(x) for x in rng.integers(0, V, 12)]
    ref1, ref2, token2 = reference_logits(d, target["hf"], tokens)
    got1, got2, ids = specjax_logits(drafter, hp, target["model"], target["params"], tokens, token2)
    np.testing.assert_array_equal(ids, draft_ids)
    np.testing.assert_allclose(got1, ref1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got2, ref2, rtol=1e-5, atol=1e-5)
    assert np.abs(ref2 - ref1[-1]).max() > 1e-2           # the second step is not a copy of the first
    # The trainer's cache-free forward (training-time test) computes the same: step 1 at every
    # position, and step 2 from the last origin (its token: the drafted one).
    seq = jnp.asarray(tokens + [token2], jnp.int32)[None]
    step1, step2 = jax.device_get(_train_forward_scores(target["model"], hc, target["params"], hp, seq))
    n = len(tokens)
    np.testing.assert_allclose(step1[0, 1:n], ref1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step2[0, n - 1], ref2, rtol=1e-5, atol=1e-5)
    # specjax's export in the other layout: the reference reads it and agrees again.
    other = "speculators" if layout == "eagle" else "eagle"
    own = {k: hp[k] for k in hc.own_param_names}
    out = tmp_path / f"{layout}-as-{other}"
    drafters.save_eagle3(out, hc, own, target["params"], layout=other, verifier=str(target["path"]))
    assert drafters.eagle3_layout(out) == other
    # (the export writes the draft vocabulary in token order, so that d2t is >= 0 and
    # non-decreasing: its row r is the file's row order[r])
    order = np.argsort(draft_ids, kind="stable")
    ref1b, ref2b, _ = reference_logits(out, target["hf"], tokens,
                                       second_row=int(np.argsort(order)[np.argmax(ref1[-1])]))
    np.testing.assert_allclose(ref1b, ref1[:, order], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref2b, ref2[order], rtol=1e-5, atol=1e-5)
    drafter2, _ = drafters.load_eagle3(out, target["model"], target["params"])
    assert drafter2 == drafter


PROMPTS = [[5, 6, 7, 8, 9], [3], [40, 41, 42, 43, 44, 45, 46]]


def _greedy(model, params, drafter, draft_params, gamma, n=24):
    config = decoding.GenerationConfig(max_new_tokens=n, gamma=gamma)
    batch = decoding.make_batch(PROMPTS, config, jax.random.key(0))
    out = decoding.Engine(model, drafter, config).run(
        decoding.EngineParams(target=params, draft=draft_params), sampling.SamplingConfig.greedy_config(), batch)
    return out.generated(), out.metrics.summary()


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_imported_heads_draft_with_greedy_exactness(target, tmp_path, layout):
    """Speculative greedy with an imported head (through `build.make_drafter`) equals
    target-only greedy. The draft vocabulary is the 4 tokens target-only greedy emits most (in
    reverse order), so a random head is accepted now and then and rejected often."""
    model, params = target["model"], target["params"]
    ref, _ = _greedy(model, params, None, None, 0)
    counts = collections.Counter(t for row in ref for t in row)
    frequent = [t for t, _ in counts.most_common(4)][::-1]
    d = write_head(tmp_path / layout, layout, LAYERS[layout], frequent, capture=CAPTURE[layout], seed=2)
    drafter, hp = build.make_drafter("head", model, params, draft_model=str(d))
    got, stats = _greedy(model, params, drafter, hp, 3)
    assert got == ref
    print(layout, stats["accepted"], stats["proposed"])
    assert 0 < stats["accepted"] < stats["proposed"], stats


def test_trained_head_exports_and_reimports_identically(target, tmp_path):
    """A head trained by specjax's train step (a few steps, two training-time-test steps) is
    exported in both layouts and imported again: the same config, bitwise the same logits, the
    same sampled tokens and acceptances in the engine. specjax's own head.json format too."""
    model, params = target["model"], target["params"]
    hc = drafters.HeadConfig.make(drafters.EAGLE3_PUBLISHED, model.config, head_size=48)
    assert hc.feature_layers == (1, 2, 3)                 # the published default triple for 7 layers
    obj = distill.HeadObjective(hc, model, ttt_steps=2)
    head_ids = np.arange(48) * 2                          # the even tokens
    own = jax.jit(lambda k: drafters.init_head_params(hc, k, head_ids=head_ids))(jax.random.key(0))   # one program
    opt, _ = distill.make_optimizer(learning_rate=3e-3, warmup_steps=0, total_updates=10)
    state, frozen = distill.init_state(own, obj.trainable, opt, jax.random.key(1))
    frozen = {**frozen, "target": params}
    step = distill.make_train_step(obj, distill.LossSpec("fkl"), opt, loss=distill.head_loss)
    head_UD = distill.teacher_head(model, params, head_ids)
    rng = np.random.default_rng(3)
    batch = {"tokens": jnp.asarray(rng.integers(0, V, (4, 32)), jnp.int32),
             "mask": jnp.asarray(np.arange(32)[None].repeat(4, 0) >= 4, jnp.float32)}
    losses = []
    for _ in range(8):
        state, aux = step(state, frozen, head_UD, batch)
        losses.append(float(aux["loss"]))
    assert losses[-1] < losses[0], losses
    trained = {**state.params, "head_ids": frozen["head_ids"]}
    hp = drafters.head_params(hc, trained, params)
    mine = drafters.FeatureHeadDrafter(drafters.EagleHead(hc))

    tokens = [int(x) for x in rng.integers(0, V, 10)]
    want = specjax_logits(mine, hp, model, params, tokens, 7)
    cfg = decoding.GenerationConfig(max_new_tokens=16, gamma=3)
    batch = decoding.make_batch(PROMPTS, cfg, jax.random.key(4))
    samp = sampling.SamplingConfig.make(temperature=1.0)
    engine = decoding.Engine(model, mine, cfg)
    run = lambda p: engine.run(decoding.EngineParams(target=params, draft=p), samp, batch)  # noqa: E731
    a = run(hp)
    drafters.save_head(tmp_path / "native", hc, trained, dtype="float32")
    for layout in ("eagle", "speculators", "native"):
        d = tmp_path / layout
        if layout != "native":
            drafters.save_eagle3(d, hc, trained, params, layout=layout)
        drafter, hp2 = build.make_drafter("head", model, params, draft_model=str(d))
        assert drafter == mine, layout
        for x, y in zip(specjax_logits(drafter, hp2, model, params, tokens, 7), want):
            np.testing.assert_array_equal(x, y)
        b = run(hp2)
        np.testing.assert_array_equal(np.asarray(a.tokens_BS), np.asarray(b.tokens_BS))
        np.testing.assert_array_equal(np.asarray(a.metrics.accepted_B), np.asarray(b.metrics.accepted_B))
    cfg_json = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]     # SGLang: outputs
    assert cfg_json["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]                      # vLLM: inputs
    spec_json = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec_json["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4] and spec_json["norm_before_residual"] is False


def test_bad_vocabulary_maps_are_refused_naming_the_file(target, tmp_path):
    from safetensors.numpy import load_file, save_file
    model = target["model"]
    d = write_head(tmp_path / "good", "eagle", LAYERS["eagle"], np.arange(20) + 5)
    good = load_file(str(d / "model.safetensors"))
    drafters.read_eagle3(d, model.config)           # the good file reads

    def bad(name, **change):
        b = tmp_path / name
        b.mkdir()
        (b / "config.json").write_text((d / "config.json").read_text())
        t = dict(good)
        t.update(change)
        save_file({k: v for k, v in t.items() if v is not None}, str(b / "model.safetensors"))
        return b

    d2t, t2d = good["d2t"], good["t2d"]
    cases = {
        "out_of_range": (dict(d2t=d2t + np.where(np.arange(20) == 3, 500, 0)), r"outside \[0, 101\)"),
        "repeated": (dict(d2t=d2t - np.where(np.arange(20) == 4, 1, 0)), "repeated"),
        "negative": (dict(d2t=d2t - 30), r"outside \[0, 101\)"),
        "t2d_disagrees": (dict(t2d=np.roll(t2d, 1)), "'t2d' disagrees with 'd2t'"),
        "t2d_short": (dict(t2d=t2d[:-1]), "'t2d' has shape"),
        "d2t_short": (dict(d2t=d2t[:-1]), "'d2t' has shape"),
        "no_d2t": (dict(d2t=None), "no 'd2t' tensor"),
    }
    for name, (change, message) in cases.items():
        b = bad(name, **change)
        with pytest.raises(CorruptCheckpointError if name != "no_d2t" else models.MissingTensorError,
                           match=message) as e:
            drafters.read_eagle3(b, model.config)
        assert str(b) in str(e.value), (name, str(e.value))
    # the shapes and the variants are named too
    with pytest.raises(TensorShapeError, match="lm_head.weight"):
        drafters.read_eagle3(bad("short_head", **{"lm_head.weight": good["lm_head.weight"][:, :-1]}), model.config)
    cfg = json.loads((d / "config.json").read_text())
    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    (tmp_path / "variant" / "config.json").write_text(json.dumps({**cfg, "fc_norm": True}))
    with pytest.raises(UnsupportedArchitectureError, match="fc_norm"):
        drafters.read_eagle3(tmp_path / "variant", model.config)


@pytest.fixture(scope="module")
def drafting(target, tmp_path_factory):
    """An imported head (a reversed draft vocabulary of 40 tokens) after its prefill on two
    prompts, and the context of its first round (each step one jitted program)."""
    model, params = target["model"], target["params"]
    d = write_head(tmp_path_factory.mktemp("drafting") / "h", "eagle", LAYERS["speculators"], np.arange(60, 20, -1),
                   capture=[0, 2, 5], seed=5)
    drafter, hp = drafters.load_eagle3(d, model, params)
    cap = 32
    tokens, lengths = _hf_tiny.right_padded([[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45, 46, 47, 48]])
    tokens_BS = jnp.zeros((2, cap), jnp.int32).at[:, :tokens.shape[1]].set(tokens)
    _, f_BLF, _ = jax.jit(model.apply_with_features, static_argnames="layers")(params, tokens_BS, None,
                                                                               layers=drafter.feature_layers)
    lengths = jnp.asarray(lengths)
    P = tokens.shape[1]
    state = jax.jit(lambda hp, t, n, f: drafter.init(hp, t, n, cap, features_BPF=f[:, :P]))(
        hp, jnp.asarray(tokens), lengths, f_BLF)
    ctx = drafters.DraftContext(tokens_BS=tokens_BS, lengths_B=lengths, target_cache=None, features=f_BLF)
    return drafter, hp, state, ctx


def test_proposals_are_drawn_from_q_over_the_draft_vocabulary(drafting):
    """Sampled drafting: q is the distribution each proposal was drawn from: the head's softmax
    (after the sampling settings) over its draft vocabulary, placed at the rows' target tokens
    (d2t), zero elsewhere; every proposal is a draft-vocabulary token."""
    drafter, hp, state, ctx = drafting
    samp = sampling.SamplingConfig.make(temperature=0.7, top_k=10)

    @jax.jit          # one program: the proposals, and the first step's scores by the catch-up alone
    def run(hp, state, ctx, keys):
        toks, q_BGV, _ = drafter.propose(hp, state, ctx, keys, 3, samp)
        scores_BU, got_ids, _ = drafter._catch_up_support(hp, drafter._with_features(state, ctx), ctx)
        return toks, q_BGV, got_ids, sampling.probabilities(scores_BU, samp)

    toks, q, got_ids, first = jax.device_get(run(hp, state, ctx, jax.random.split(jax.random.key(1), 2)))
    ids = np.arange(60, 20, -1)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    off = np.setdiff1d(np.arange(V), ids)
    assert (q[..., off] == 0).all() and np.isin(toks, ids).all()
    assert (q[np.arange(2)[:, None], np.arange(3)[None], toks] > 0).all()
    np.testing.assert_array_equal(got_ids, ids)
    want = np.zeros((2, V), np.float32)
    want[:, ids] = first
    np.testing.assert_allclose(q[:, 0], want, rtol=1e-5, atol=1e-7)


@functools.cache
def _chain_fns(drafter):
    """(the catch-up's root distribution and cache, one chain step's logits): jitted once per drafter."""
    @jax.jit
    def catch_up(hp, state, ctx):
        root_BV, cache = drafter._catch_up(hp, drafter._with_features(state, ctx), ctx)
        return jax.nn.softmax(root_BV, -1), cache.replace(true_BSF=None, drafting=True)
    return catch_up, jax.jit(lambda p, t, c: drafter.model.apply(p, t, c))


@pytest.mark.parametrize("shape", [trees.DynamicTree(depth=3, topk=2, node_budget=6),
                                   trees.TreeShape.from_branching((2, 2, 1))], ids=["dynamic", "static"])
def test_tree_nodes_score_as_the_chain_along_their_path(drafting, shape):
    """An imported head drafting a token tree (EAGLE-2's dynamic tree, a static one): each
    node's distribution equals what the head gives drafting the node's path as a chain, one
    token at a time in feature space (a tree call reads its parent's output at its path's
    position, and no node sees slot 0)."""
    drafter, hp, state, ctx = drafting
    greedy = sampling.SamplingConfig.greedy_config()
    draft, q_BN1V, _ = jax.jit(lambda p, s, c, k: drafter.propose_tree(p, s, c, k, shape, greedy, "deterministic"))(
        hp, state, ctx, jax.random.split(jax.random.key(0), 2))
    catch_up, step = _chain_fns(drafter)
    root_p, chain_cache = catch_up(hp, state, ctx)
    np.testing.assert_allclose(np.asarray(q_BN1V[:, 0]), np.asarray(root_p), rtol=2e-5, atol=2e-6)
    toks, parents, valid = (np.asarray(x) for x in (draft.tokens_BN, draft.parents_BN, draft.valid_BN))
    B, N = toks.shape
    checked = 0
    for b in range(B):
        paths = []
        for n in range(N):
            paths.append((paths[parents[b, n]] if parents[b, n] >= 0 else []) + [n])
        for n in range(N):
            if not valid[b, n] or np.asarray(q_BN1V[b, n + 1]).sum() == 0:     # leaves are never forwarded
                continue
            c = chain_cache
            for j in paths[n]:
                col = np.zeros((B, 1), np.int32)
                col[b, 0] = toks[b, j]
                lg, c = step(hp, jnp.asarray(col), c)
            np.testing.assert_allclose(np.asarray(q_BN1V[b, n + 1]), np.asarray(jax.nn.softmax(lg[b, 0], -1)),
                                       rtol=2e-5, atol=2e-6)
            checked += 1
    assert checked >= 2 * B, checked


def test_reference_pytorch_model_bin_reads_as_its_safetensors(target, tmp_path):
    """The reference's releases hold pytorch_model.bin: read (with torch) to the same head."""
    from safetensors.torch import load_file
    d = write_head(tmp_path / "st", "eagle", LAYERS["eagle"], np.arange(30) * 3, capture=[0, 2, 5])
    b = tmp_path / "bin"
    b.mkdir()
    (b / "config.json").write_text((d / "config.json").read_text())
    torch.save(load_file(str(d / "model.safetensors")), str(b / "pytorch_model.bin"))
    hc1, own1, _ = drafters.read_eagle3(d, target["model"].config)
    hc2, own2, _ = drafters.read_eagle3(b, target["model"].config)
    assert hc1 == hc2 and hc1.feature_layers == (0, 2, 5)
    jax.tree.map(np.testing.assert_array_equal, own1, own2)
