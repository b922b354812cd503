"""Model families (issue 41): specjax against transformers on tiny random checkpoints that
transformers itself writes, one per family: Qwen3 (q/k norms), Mistral (a sliding window in
every layer), Gemma 2 (scaled embeddings, (1 + w) and sandwich norms, GeGLU, query scalar,
attention and logit soft-capping, alternating windows), Gemma 3 (q/k norms, a local RoPE base
beside a scaled global one), Qwen2 with its windowed upper layers, Mixtral (4 experts, top 2,
renormalized, windowed) and Qwen3-MoE (4 experts, top 2, not renormalized).

For each: the logits of a ragged prefill, of cached one-token steps, of a k-token verification
block and of a token-tree block equal transformers' full forward of the same sequences (max
|Δ| / max |logit| <= 1e-4 per position, KL <= 1e-5); the sequences run past the window (6) so
windows change the result; speculative greedy decoding with an early-exit draft equals
target-only greedy (transformers' greedy tokens, each chosen by a margin over rounding; on one
device, and on a mesh for the families whose parameter layouts differ); the exported checkpoint
loads in transformers with the same logits. The parity cases of one model and layout run as one
compiled program.
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_tiny import FAMILY_KINDS, family_model, hf_logits, parity_cases, rel_and_kl  # noqa: E402
from specjax import decoding, drafters, models, sampling, trees  # noqa: E402
from specjax.models import UnsupportedArchitectureError, export_hf, load  # noqa: E402

REL_TOL, KL_TOL = 1e-4, 1e-5
ARCH = {"qwen3": "qwen3", "mistral": "mistral", "gemma2": "gemma2", "gemma3": "gemma3_text", "qwen2_window": "qwen2",
        "mixtral": "mixtral", "qwen3_moe": "qwen3_moe"}
PROMPTS = [np.random.default_rng(0).integers(0, 101, n) for n in (17, 9)]    # ragged, both past the window
SHAPE = trees.TreeShape.from_branching((2, 2))


def _check(ref, got, what):
    rel, kl = rel_and_kl(ref, got)
    assert rel.max() <= REL_TOL and kl.max() <= KL_TOL, (what, float(rel.max()), float(kl.max()))
    return float(rel.max())


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory):
    """kind -> (checkpoint directory written by transformers, transformers' model read back from it)."""
    made = {}

    def get(kind):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            family_model(kind).save_pretrained(path, safe_serialization=True)
            made[kind] = path, transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
        return made[kind]
    return get


@pytest.fixture(scope="module", params=FAMILY_KINDS)
def family(request, family_paths):
    kind = request.param
    return (kind, *family_paths(kind))


def _reference(ref_model, seq):
    return hf_logits(ref_model, np.asarray(seq)[None])[0]


def _load(path: str, scan_layers: bool = True):
    """`load` of a family checkpoint in one layout, read once for the module's tests (none
    changes the params it gets)."""
    return _load_once(path, bool(scan_layers))


@functools.lru_cache(maxsize=None)
def _load_once(path, scan_layers):
    return load(path, scan_layers=scan_layers)


# The stacked `lax.scan` layout for the families whose scanned layers differ from another's:
# per-layer windows (gemma2, qwen2_window; gemma3 also with its local RoPE stacked beside the
# global one), attention biases (qwen2_window), sandwich norms and soft-caps (gemma2), q/k norms
# (gemma3, qwen3_moe), stacked experts (mixtral renormalized, qwen3_moe not). Not scanned here:
# qwen3 (its layers are qwen3_moe's attention with a dense MLP, Llama's scanned layout) and
# mistral (one window in every layer, as mixtral's). Every family runs unrolled.
SCAN_KINDS = ("gemma2", "gemma3", "qwen2_window", "mixtral", "qwen3_moe")


def test_logits_match_transformers(family):
    """Every parity case (`parity_cases`) in the unrolled layout, and in the scanned one for the
    families of SCAN_KINDS."""
    kind, path, ref_model = family
    for scan_layers in (False, True) if kind in SCAN_KINDS else (False,):
        model, params = _load(str(path), scan_layers=scan_layers)
        c = model.config
        assert c.arch == ARCH[kind]
        assert any(c.layer_windows) == (kind not in ("qwen3", "qwen3_moe"))
        assert bool(c.num_experts) == (kind in ("mixtral", "qwen3_moe"))
        layout = "scan" if scan_layers else "unrolled"
        cases = 0
        for case, ref, got in parity_cases(model, params, ref_model):
            _check(ref, got, f"{kind} {layout} {case}")
            cases += 1
        assert cases == 2 + 8 + 2 + 2 * (1 + SHAPE.num_nodes)


def test_windows_change_the_logits(family):
    """Negative control: the same checkpoint read without its windows (or, for Qwen3, without its
    q/k norms) gives other logits, so the comparisons above see the feature."""
    kind, path, ref_model = family
    model, params = _load(str(path))
    if kind == "qwen3_moe":      # the other routing rule: renormalized top-k weights
        broken = models.Llama(model.config.replace(normalize_topk=True))
    else:
        broken = models.Llama(model.config.replace(sliding_window=0) if kind != "qwen3"
                              else model.config.replace(qk_norm=False))
    seq = PROMPTS[0]
    if kind == "qwen3":
        params = dict(params, layers={k: v for k, v in params["layers"].items() if k not in ("q_norm", "k_norm")})
    got = np.asarray(jax.jit(broken.apply)(params, jnp.asarray(seq)[None], None)[0][0])
    rel, _ = rel_and_kl(_reference(ref_model, seq), got)
    assert rel.max() > 10 * REL_TOL, rel.max()


@pytest.fixture(scope="module")
def greedy_refs(family_paths):
    """(kind, prompts, n) -> the target's greedy continuations of `n` tokens: transformers' full
    forward of each sequence so far, argmax, memoised. Every chosen token beats the runner-up by
    more than 2 REL_TOL of the row's largest |logit| (a near-tie fails here): specjax's logits
    are within REL_TOL of transformers' (the parity checks), so a target-only greedy run of the
    specjax model picks the same tokens, and the speculative runs below are compared with it."""
    made = {}

    def get(kind, prompts, n):
        key = (kind, tuple(map(tuple, prompts)), n)
        if key not in made:
            _, ref_model = family_paths(kind)
            outs = []
            for p in prompts:
                seq = list(map(int, p))
                for _ in range(n):
                    last = _reference(ref_model, seq)[-1]
                    second, first = np.sort(last)[-2:]
                    assert first - second > 2 * REL_TOL * np.abs(last).max(), (kind, p, len(seq), first - second)
                    seq.append(int(last.argmax()))
                outs.append(seq[len(p):])
            made[key] = outs
        return made[key]
    return get


def test_speculative_greedy_equals_target_only(family, greedy_refs):
    """Speculative greedy decoding (an early-exit draft of 1 layer, gamma 3, the two ragged
    PROMPTS, 16 new tokens) gives the target's greedy tokens (`greedy_refs`, transformers' greedy
    with a margin over rounding), with both accepted and rolled-back proposals."""
    kind, path, _ = family
    target, params = _load(str(path), scan_layers=False)
    drafter, dparams = drafters.EarlyExitDrafter.from_target(target, params, 1)
    greedy = sampling.SamplingConfig.greedy_config()
    prompts = [list(map(int, p)) for p in PROMPTS]
    config = decoding.GenerationConfig(max_new_tokens=16, gamma=3)
    engine = decoding.Engine(target, drafter, config)
    batch = decoding.make_batch(prompts, config, jax.random.key(0))
    out = engine.run(decoding.EngineParams(target=params, draft=dparams), greedy, batch)
    assert out.generated() == greedy_refs(kind, prompts, 16), kind
    stats = out.metrics.summary()
    print(kind, stats["accepted"], stats["proposed"])
    assert 0 < stats["accepted"] < stats["proposed"], stats       # both accepted and rolled-back proposals


def test_export_round_trip(family, tmp_path):
    kind, path, ref_model = family
    model, params = _load(str(path))
    export_hf(model, params, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == list(ref_model.config.architectures)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    seq = np.asarray(PROMPTS[0])[None]
    _check(hf_logits(ref_model, seq), hf_logits(hf, seq), f"{kind} export")
    model2, _ = load(str(tmp_path / "out"))
    assert model2.config == model.config


def test_unsupported_options_are_named(tmp_path):
    from specjax.models.hf_loader import config_from_hf
    base = family_model("gemma2").config.to_dict()
    with pytest.raises(UnsupportedArchitectureError, match="chunked_attention"):
        config_from_hf(dict(base, layer_types=["chunked_attention", "full_attention"]))
    with pytest.raises(UnsupportedArchitectureError, match="gelu_new"):
        config_from_hf(dict(base, hidden_activation="gelu_new"))
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        config_from_hf(dict(family_model("qwen3").config.to_dict(), rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedArchitectureError, match="FalconForCausalLM"):
        config_from_hf(dict(base, architectures=["FalconForCausalLM"]))


_SHARDED = """
import json, sys
import jax
from specjax import decoding, drafters, sampling, sharding
from specjax.models import load
assert jax.device_count() == 8
prompts = json.loads(sys.argv[1])
for kind, path in zip(sys.argv[2::2], sys.argv[3::2]):
    model, params = load(path)
    mesh = sharding.make_mesh(data=2, model=4)
    placed = sharding.shard_params(params, model, mesh)
    if kind == "mixtral":      # experts split over the model axis: one expert per shard
        spec = tuple(placed["layers"]["we_gate"].sharding.spec)
        assert spec[:2] == (None, "model"), spec
    config = decoding.GenerationConfig(max_new_tokens=8, gamma=3)
    drafter, dparams = drafters.EarlyExitDrafter.from_target(model, params, 1)
    engine = decoding.Engine(model, drafter, config, mesh=mesh)
    batch = decoding.make_batch(prompts, config, jax.random.key(0))
    greedy = sampling.SamplingConfig.greedy_config()
    out = engine.run(decoding.EngineParams(target=params, draft=dparams), greedy, batch)
    print("OUT", kind, json.dumps(out.generated()))
"""


# The families on the mesh: every parameter layout the families add to Llama's
# (`specjax.models.param_specs`), each sharded by its logical axes: q/k norms (Qwen3,
# Qwen3-MoE), sandwich norms (Gemma 2, with its soft-caps, GeGLU and scaled embeddings),
# attention biases with tied embeddings (Qwen2), experts (Mixtral, renormalized; Qwen3-MoE, not
# renormalized, its own expert width). Mistral's layout is Llama's (on meshes in
# tests/test_sharded_engine.py) and Gemma 3's is Gemma 2's plus q/k norms; windows and RoPE bases
# are no parameters, and every family's logits and speculative greedy output are checked on one
# device above.
MESH_KINDS = ("qwen3", "gemma2", "qwen2_window", "mixtral", "qwen3_moe")
MESH_PROMPTS = [[5, 9, 3, 7, 1, 8, 2, 4, 6], [2, 4], [8, 8, 1, 30, 12, 7, 22], [3, 3, 3]]


def test_families_on_a_mesh(family_paths, greedy_refs):
    """The families of MESH_KINDS on a 2 x 4 mesh of 8 simulated CPU devices (a subprocess;
    Mixtral's experts over the model axis): speculative greedy output (4 ragged prompts, 8 new
    tokens, gamma 3) equal to the target's greedy tokens (`greedy_refs`; one device's speculative
    output equals them too, test_speculative_greedy_equals_target_only)."""
    from _bench_run import run_script_on_devices
    assert set(MESH_KINDS) <= set(FAMILY_KINDS)
    args = [json.dumps(MESH_PROMPTS)]
    for kind in MESH_KINDS:
        args += [kind, str(family_paths(kind)[0])]
    out = run_script_on_devices(_SHARDED, *args, devices=8)
    got = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2]) for line in out.splitlines()
           if line.startswith("OUT ")}
    assert set(got) == set(MESH_KINDS), out
    for kind in MESH_KINDS:
        assert got[kind] == greedy_refs(kind, MESH_PROMPTS, 8), kind


def test_qwen3_gguf_reads_like_its_checkpoint(tmp_path):
    """A Qwen3 GGUF (general.architecture 'qwen3', q/k norms as attn_q_norm / attn_k_norm, as
    llama.cpp's converter writes them) loads to the same model and logits as the Hugging Face
    checkpoint it was written from (which matches transformers, above)."""
    from test_loader_errors import write_gguf
    family_model("qwen3").save_pretrained(tmp_path / "hf", safe_serialization=True)
    model, params = load(str(tmp_path / "hf"))
    write_gguf(tmp_path / "m.gguf", model.config, params, arch="qwen3")
    gmodel, gparams = load(str(tmp_path / "m.gguf"))
    assert gmodel.config.arch == "qwen3" and gmodel.config.qk_norm and gmodel.config.head_dim == 24
    tokens = jnp.asarray(np.asarray(PROMPTS[0])[None])
    np.testing.assert_allclose(np.asarray(jax.jit(gmodel.apply)(gparams, tokens, None)[0]),
                               np.asarray(jax.jit(model.apply)(params, tokens, None)[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gemma3", "mixtral"])
def test_chunked_prefill_and_features(family_paths, kind):
    """Chunked prefill (chunks of 4 over a fresh cache, each attending to the slots before it)
    leaves the cache of a one-call prefill, so the next step's logits match transformers; the
    features a head reads (`apply_with_features`, layer 0's output) are transformers' hidden
    state after layer 0. Gemma 3 (windows of 6 with a local RoPE) and Mixtral (windows, experts)."""
    path, ref_model = family_paths(kind)
    model, params = _load(str(path))
    prompt = np.asarray(PROMPTS[0])
    P = len(prompt)

    @jax.jit          # (one program: op by op, every chunk's ops compiled anew)
    def run(params, prompt_1P):
        cache = models.prefill(model, params, prompt_1P[:, :-1], model.init_cache(1, 32),
                               jnp.asarray([P - 1]), chunk=4, start_bound=0)
        logits, _ = model.apply(params, prompt_1P[:, -1:], cache)
        _, feats, _ = model.apply_with_features(params, prompt_1P, None, layers=(0,))
        return logits, feats

    logits, feats = run(params, jnp.asarray(prompt[None]))
    _check(_reference(ref_model, prompt)[-1:], np.asarray(logits[0]), f"{kind} chunked prefill")
    with torch.no_grad():
        hidden = ref_model(torch.as_tensor(prompt[None], dtype=torch.long), output_hidden_states=True).hidden_states
    np.testing.assert_allclose(np.asarray(feats[0]), hidden[1][0].numpy(), rtol=1e-4, atol=1e-4)


def test_configs_read_and_export_as_transformers_does(tmp_path):
    """transformers' own rules: Llama has no window (a stray sliding_window key is ignored),
    Mistral and Mixtral window every layer whatever layer_types says, Gemma's absent keys mean
    its defaults (soft-caps 50 / 30 for Gemma 2, window 4096, head_dim 256); an export refuses
    what its family cannot express instead of dropping it."""
    from specjax.models import ModelConfig, UnsupportedArchitectureError
    from specjax.models.hf_loader import config_from_hf
    llama = family_model("mistral").config.to_dict()
    assert not config_from_hf(dict(llama, architectures=["LlamaForCausalLM"], model_type="llama",
                                   sliding_window=8)).sliding_window
    mixed = config_from_hf(dict(llama, layer_types=["sliding_attention", "full_attention"]))
    assert mixed.layer_windows == (mixed.sliding_window,) * 2
    gemma = {k: v for k, v in family_model("gemma2").config.to_dict().items()
             if k not in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "head_dim")}
    g = config_from_hf(gemma)
    assert (g.attn_softcap, g.final_softcap, g.head_dim, g.sliding_window) == (50.0, 30.0, 256, 4096)
    base = ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       ffn_size=48)
    for arch, extra, named in (("llama", dict(qk_norm=True), "qk_norm"), ("llama", dict(num_experts=4, experts_per_token=2), "experts"),
                               ("qwen3", dict(attn_softcap=5.0), "attn_softcap"),
                               ("mistral", dict(sliding_window=4, window_layers=(True, False)), "windows every layer")):
        model = models.Llama(base.replace(arch=arch, **extra))
        with pytest.raises(UnsupportedArchitectureError, match=named):
            export_hf(model, model.init_params(jax.random.key(0)), tmp_path / arch)
    gelu = models.Llama(base.replace(arch="gemma2", norm_offset=1.0, sandwich_norms=True, scale_embeddings=True,
                                     mlp_activation="gelu_tanh"))
    export_hf(gelu, gelu.init_params(jax.random.key(0)), tmp_path / "g")
    assert json.loads((tmp_path / "g" / "config.json").read_text())["hidden_act"] == "gelu_pytorch_tanh"


def test_final_softcap_on_every_logits_path(family_paths):
    """Gemma 2 soft-caps its logits; so does every other path to a target distribution: a
    reduced-vocabulary head (its rows of the capped logits) and the distillation teacher (the
    target distilled into itself has zero loss; uncapped teacher logits would not)."""
    from specjax import distill
    from specjax.models.reduced_head import reduce_head
    path, _ = family_paths("gemma2")
    model, params = _load(str(path))
    tokens = jnp.asarray(np.asarray(PROMPTS[0])[None])
    ids = np.arange(0, model.vocab_size, 3)
    reduced, rparams = reduce_head(model, params, ids)

    @jax.jit          # (one program: op by op, every op compiled on its own)
    def run(params, rparams, head, tokens):
        h, _ = model.hidden_states(params, tokens, None)
        batch = {"tokens": tokens, "mask": jnp.ones(tokens.shape, jnp.float32), "teacher_hidden": h}
        loss, _ = distill.loss_fn(params, {}, head, batch, draft=model, spec=distill.LossSpec("fkl", 0.5, 1.0))
        return model.logits_from_hidden(params, h), reduced.head_logits(rparams, h), loss

    full, got, loss = run(params, rparams, distill.teacher_head(model, params), tokens)
    full = np.asarray(full)
    assert np.abs(full).max() <= model.config.final_softcap
    np.testing.assert_allclose(np.asarray(got), full[..., ids], rtol=1e-5, atol=1e-5)
    assert abs(float(loss)) < 1e-5, float(loss)


def test_moe_loads_in_the_cpu_profile(family_paths):
    """The CPU profile asks for the panels linear op (the kernel layout); it holds no experts, so a
    mixture-of-experts target keeps XLA's matmuls (unrolled and fused as asked) and the same logits."""
    path, ref_model = family_paths("mixtral")
    model, params = load(str(path), scan_layers=False, fuse_projections=True, linear_op="panels")
    assert model.config.linear_op == "xla" and model.config.fuse_projections
    seq = np.asarray(PROMPTS[1])
    _check(_reference(ref_model, seq), np.asarray(jax.jit(model.apply)(params, jnp.asarray(seq[None]), None)[0][0]),
           "mixtral cpu profile")
