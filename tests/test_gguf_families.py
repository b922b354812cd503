"""GGUF files of the families beyond llama / qwen2 / qwen3, written here from tiny random Hugging
Face checkpoints the way llama.cpp's convert_hf_to_gguf.py writes them (`_convert`: its metadata
keys, the tensor names of gguf's own TensorNameMap, 1 added to Gemma's norm weights, the Q/K rows
of the ``llama`` architecture permuted, each layer's experts merged into one tensor, Gemma 2's
lm_head dropped), read back to the same `ModelConfig` semantics and the same logits (float32,
1e-5) as the checkpoint they were written from: Gemma 2, Gemma 3 (llama.cpp's hard-coded sliding
pattern of 6, its local RoPE base beside a linearly scaled global one), Mixtral (``llama`` with
experts), Qwen3-MoE. Negative controls show each check can fail: Gemma read with norm_offset=1,
Mixtral without renormalized top-k weights, a Qwen3-MoE checkpoint with norm_topk_prob=false
converted without ``expert_weights_norm`` (llama.cpp renormalizes it anyway). What llama.cpp
derives instead of storing (Gemma's query scale for the 27B models, Gemma 2's default window and
soft-caps) and what is refused are checked on metadata-only files."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from _hf_tiny import family_config  # noqa: E402
from specjax.models import UnsupportedArchitectureError, gguf_loader, load  # noqa: E402

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 101, 21)[None])     # past the window (6)
ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "llama": gguf.MODEL_ARCH.LLAMA,
        "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}



def _add_field(w, key, value):
    """One metadata field, typed as llama.cpp's converter writes it."""
    if isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_uint32(key, int(value))

def _checkpoint(path, kind, **changes):
    """A tiny random transformers checkpoint of `kind` (tests/_hf_tiny.py) with `changes` to its
    config, non-trivial norms; written to `path`."""
    torch.manual_seed(0)
    cfg = family_config(kind)
    for k, v in changes.items():
        setattr(cfg, k, v)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:           # Gemma's norms scale by (1 + w): keep w around 0
                p.uniform_(-0.5, 0.5) if kind.startswith("gemma") else p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of each head: [2, half] -> [half, 2])."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert(hf_dir, out, arch, **extra):
    """A float32 GGUF of the checkpoint in `hf_dir` as llama.cpp's converter writes `arch`
    (Gemma2Model, Gemma3Model, LlamaModel for Mixtral, Qwen3MoeModel), plus metadata `extra`
    (key without the "{arch}." prefix -> value; None drops a key)."""
    from safetensors.numpy import load_file
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    L, H, K, hd = (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                   cfg["head_dim"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    meta = {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "block_count": L, "feed_forward_length": cfg["intermediate_size"], "attention.head_count": H,
            "attention.head_count_kv": K, "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
            "attention.key_length": hd, "attention.value_length": hd}
    if arch != "gemma2":                  # Gemma2Model writes no RoPE base (llama.cpp: 10000)
        meta["rope.freq_base"] = rope["rope_theta"]
    if rope.get("rope_type") == "linear":
        meta["rope.scaling.type"], meta["rope.scaling.factor"] = "linear", rope["factor"]
    if arch == "gemma2":
        meta.update({"attn_logit_softcapping": cfg["attn_logit_softcapping"],
                     "final_logit_softcapping": cfg["final_logit_softcapping"],
                     "attention.sliding_window": cfg["sliding_window"]})
    if arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            meta["final_logit_softcapping"] = cfg["final_logit_softcapping"]
        meta["attention.sliding_window"] = cfg["sliding_window"]
    if arch == "llama":
        meta.update({"vocab_size": cfg["vocab_size"], "rope.dimension_count": hd})
    if "num_experts_per_tok" in cfg:
        meta["expert_count"] = cfg.get("num_local_experts") or cfg["num_experts"]
        meta["expert_used_count"] = cfg["num_experts_per_tok"]
    if arch == "qwen3moe":
        meta["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    meta.update(extra)

    w = gguf.GGUFWriter(str(out), arch)
    for key, value in meta.items():
        if value is not None:
            _add_field(w, f"{arch}.{key}", value)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        w.add_eos_token_id(cfg["eos_token_id"])

    names = gguf.get_tensor_name_map(ARCH[arch], L)
    experts = {}
    E = meta.get("expert_count") or 0
    for name, arr in state.items():
        arr = np.asarray(arr, np.float32)
        if arch == "gemma2" and name == "lm_head.weight":      # Gemma2Model drops it: llama.cpp ties
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _permute(arr, H)
        if arch == "llama" and name.endswith("k_proj.weight"):
            arr = _permute(arr, K)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + 1                                       # Gemma's RMSNorm scales by 1 + w
        if ".experts." in name:                                 # merged per layer, experts stacked
            layer = name.split(".layers.")[1].split(".", 1)[0]
            experts[name] = arr
            mine = [n for n in experts if n.split(".layers.")[1].split(".", 1)[0] == layer]
            if len(mine) < 3 * E:
                continue
            for wid in (("w1", "w2", "w3") if arch == "llama" else ("gate_proj", "down_proj", "up_proj")):
                if arch == "llama":
                    parts = [f"model.layers.{layer}.block_sparse_moe.experts.{x}.{wid}.weight" for x in range(E)]
                    merged = f"layers.{layer}.feed_forward.experts.{wid}.weight"
                else:
                    parts = [f"model.layers.{layer}.mlp.experts.{x}.{wid}.weight" for x in range(E)]
                    merged = f"model.layers.{layer}.mlp.experts.{wid}.weight"
                w.add_tensor(names.get_name(merged, try_suffixes=(".weight",)),
                             np.ascontiguousarray(np.stack([experts.pop(p) for p in parts])))
            continue
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(arr))
    assert not experts
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _logits(model, params):
    return np.asarray(jax.jit(model.apply)(params, TOKENS, None)[0])


def _read_both(tmp_path, kind, arch, changes=(), **extra):
    hf = _checkpoint(tmp_path / "hf", kind, **dict(changes))
    hmodel, hparams = load(str(hf))
    gmodel, gparams = load(str(_convert(hf, tmp_path / "m.gguf", arch, **extra)))
    return hmodel, hparams, gmodel, gparams


# tiny checkpoints as llama.cpp can run them: Gemma 2's query scalar its head_dim (llama.cpp's rule
# below 27B) and its head tied (the converter drops lm_head); Gemma 3 windowing all layers but
# every 6th (llama.cpp's hard-coded pattern); Mixtral without a window (llama.cpp's `llama` has none)
CASES = {
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16, "tie_word_embeddings": True}),
    "gemma3": ("gemma3", {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "mixtral": ("llama", {"sliding_window": None}),
    "qwen3_moe": ("qwen3moe", {"norm_topk_prob": True}),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_gguf_reads_like_its_checkpoint(tmp_path, kind):
    arch, changes = CASES[kind]
    hmodel, hparams, gmodel, gparams = _read_both(tmp_path, kind, arch, changes)
    hcfg, gcfg = hmodel.config, gmodel.config
    if kind.startswith("gemma"):
        assert hcfg.norm_offset == 1.0 and gcfg.norm_offset == 0.0      # the 1 is in the GGUF's weights
        hcfg = hcfg.replace(norm_offset=0.0)
    assert gcfg == hcfg, (gcfg, hcfg)
    if kind == "gemma3":
        assert gcfg.window_layers == (True,) * 5 + (False,) and gcfg.local_rope_theta == 1e4
        assert gcfg.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    ref = _logits(hmodel, hparams)
    np.testing.assert_allclose(_logits(gmodel, gparams), ref, rtol=1e-5, atol=1e-5)

    # negative controls: a reading that misses the family's GGUF convention changes the logits
    wrong = {"gemma2": dict(norm_offset=1.0), "gemma3": dict(norm_offset=1.0),
             "mixtral": dict(normalize_topk=False), "qwen3_moe": dict(normalize_topk=False)}[kind]
    bad = _logits(type(gmodel)(gcfg.replace(**wrong)), gparams)
    assert np.abs(bad - ref).max() > 1e-2, kind


def test_qwen3_moe_renormalization_follows_llama_cpp(tmp_path):
    """A checkpoint with norm_topk_prob=false: converted as llama.cpp does (no expert_weights_norm),
    it reads renormalized as llama.cpp runs it, so unlike the checkpoint; with the key stated
    false it reads like the checkpoint."""
    hf = _checkpoint(tmp_path / "hf", "qwen3_moe")          # tests/_hf_tiny.py: norm_topk_prob=False
    hmodel, hparams = load(str(hf))
    assert not hmodel.config.normalize_topk
    ref = _logits(hmodel, hparams)
    as_llama_cpp, _ = load(str(_convert(hf, tmp_path / "a.gguf", "qwen3moe")))
    assert as_llama_cpp.config.normalize_topk
    stated, sparams = load(str(_convert(hf, tmp_path / "b.gguf", "qwen3moe", expert_weights_norm=False)))
    assert stated.config == hmodel.config
    np.testing.assert_allclose(_logits(stated, sparams), ref, rtol=1e-5, atol=1e-5)
    assert np.abs(_logits(as_llama_cpp, sparams) - ref).max() > 1e-2


# ---------------------------------------------------------------------------------------
# metadata-only files: what llama.cpp derives, what is refused
# ---------------------------------------------------------------------------------------
def _meta_file(path, arch, tensors=(), **meta):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        _add_field(w, f"{arch}.{key.replace('__', '.')}", value)
    for name in tensors:
        w.add_tensor(name, np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_loader.config_from_gguf(gguf_loader.open_gguf(path), path=path)


def _shape(layers, width, heads, head_dim, **more):
    return dict(block_count=layers, embedding_length=width, feed_forward_length=4 * width, vocab_size=256,
                attention__head_count=heads, attention__head_count_kv=heads // 2,
                attention__key_length=head_dim, attention__value_length=head_dim, **more)


def test_gemma_derived_settings(tmp_path):
    # the 27B models (46 layers for Gemma 2, 62 for Gemma 3) scale queries by n_embd / n_head
    c = _meta_file(tmp_path / "a.gguf", "gemma2", **_shape(46, 4608, 32, 128))
    assert c.arch == "gemma2" and c.query_pre_attn_scalar == 144.0 and c.attention_scale == 144 ** -0.5
    assert c.tie_embeddings and c.norm_offset == 0.0 and c.sandwich_norms and c.scale_embeddings
    assert (c.attn_softcap, c.final_softcap, c.sliding_window) == (50.0, 30.0, 4096)   # llama.cpp's defaults
    assert c.window_layers == tuple(i % 2 == 0 for i in range(46)) and c.local_rope_theta is None
    c = _meta_file(tmp_path / "b.gguf", "gemma2", **_shape(42, 3584, 16, 256))
    assert c.query_pre_attn_scalar == 256.0                     # 9B: head_dim (its n_embd / n_head is 224)
    c = _meta_file(tmp_path / "c.gguf", "gemma3", **_shape(62, 5376, 32, 128, attention__sliding_window=1024))
    assert c.arch == "gemma3_text" and c.query_pre_attn_scalar == 168.0 and c.qk_norm
    assert c.window_layers == tuple(i % 6 != 5 for i in range(62)) and c.local_rope_theta == 1e4
    assert c.attn_softcap is None and c.final_softcap is None
    c = _meta_file(tmp_path / "d.gguf", "gemma3", **_shape(26, 1152, 4, 256))
    assert c.query_pre_attn_scalar == 256.0 and c.sliding_window == 0   # 1B (288 = n_embd / n_head); no window
    c = _meta_file(tmp_path / "e.gguf", "gemma3", **_shape(4, 64, 4, 16, attention__sliding_window=8,
                                                           attention__sliding_window_pattern=2,
                                                           rope__freq_base_swa=5e4))
    assert c.window_layers == (True, False, True, False) and c.local_rope_theta == 5e4
    c = _meta_file(tmp_path / "f.gguf", "gemma3", **_shape(3, 64, 4, 16, attention__sliding_window=8,
                                                           attention__sliding_window_pattern=[False, True, True]))
    assert c.window_layers == (False, True, True)


def test_moe_and_mistral_metadata(tmp_path):
    c = _meta_file(tmp_path / "m.gguf", "llama", **_shape(2, 64, 4, 16, expert_count=8, expert_used_count=2))
    assert (c.arch, c.num_experts, c.experts_per_token, c.normalize_topk, c.ffn_size) == ("mixtral", 8, 2, True, 256)
    c = _meta_file(tmp_path / "l.gguf", "llama", **_shape(2, 64, 4, 16))    # Mistral: arch llama, no window
    assert (c.arch, c.num_experts, c.sliding_window) == ("llama", 0, 0)
    c = _meta_file(tmp_path / "q.gguf", "qwen3moe", **_shape(2, 64, 4, 16, expert_count=8, expert_used_count=2))
    assert (c.arch, c.ffn_size, c.normalize_topk, c.qk_norm) == ("qwen3_moe", 128, True, True)   # 256 / 2


@pytest.mark.parametrize("arch,meta,tensors,match", [
    ("qwen3moe", dict(expert_gating_func=2), (), "expert_gating_func=2"),
    ("qwen3moe", dict(expert_shared_count=1), (), "expert_shared_count"),
    ("qwen3moe", dict(leading_dense_block_count=1), (), "leading_dense_block_count"),
    ("qwen3moe", dict(expert_weights_scale=2.5), (), "expert_weights_scale"),
    ("llama", {}, ("blk.0.ffn_gate.0.weight",), "one tensor per expert"),
])
def test_moe_unsupported_options_are_named(tmp_path, arch, meta, tensors, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        _meta_file(tmp_path / "x.gguf", arch, tensors,
                   **_shape(2, 64, 4, 16, expert_count=4, expert_used_count=2, **meta))


def test_partial_rope_and_unknown_arch_are_named(tmp_path):
    with pytest.raises(UnsupportedArchitectureError, match="rope.dimension_count"):
        _meta_file(tmp_path / "p.gguf", "qwen3", **_shape(2, 64, 4, 16, rope__dimension_count=8))
    with pytest.raises(UnsupportedArchitectureError, match="'gemma3n'.*gemma2, gemma3, llama, qwen3moe"):
        _meta_file(tmp_path / "u.gguf", "gemma3n", **_shape(2, 64, 4, 16))
