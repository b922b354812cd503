"""Bad model checkpoints (issue 53, items 5, 6, 7, 12's loader parts, 17's model parts): stale
tensors beside the checkpoint, headers that declare fewer layers than the weights hold, absurd
numbers, malformed headers and zero counts. Each must be one clear error (a ValueError /
`specjax.models.CheckpointError`, which the CLI shows as one line) naming the key, the value and
the file, raised before any weight is read; a stale file the checkpoint does not name is not
read at all. Tiny checkpoints are written here (`export_hf`, `gguf.GGUFWriter`)."""
import json

import jax
import numpy as np
import pytest

from specjax.models import CheckpointError, Llama, ModelConfig, canonical_params, export_hf, load
from specjax.models import hf_loader
from specjax.models.hf_loader import config_from_hf
from specjax.models.names import permute_qk, tensor_names

CFG = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  ffn_size=48, rope_theta=10000.0, rms_eps=1e-5, bos_token_id=1, eos_token_id=2)


def _family(kind: str) -> ModelConfig:
    """The tiny config of `_hf_tiny.family_config(kind)` as specjax reads it."""
    from _hf_tiny import family_config
    return config_from_hf(family_config(kind).to_dict())


def _params(config, seed=0):
    return Llama(config).init_params(jax.random.key(seed))


def _hf_dir(tmp_path, config=CFG, name="ckpt"):
    d = tmp_path / name
    export_hf(config, _params(config), d)
    return d


def _edit_config(d, **changes):
    """Rewrite d/config.json with ``changes`` (None: drop the key)."""
    f = d / "config.json"
    cfg = json.loads(f.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    f.write_text(json.dumps(cfg))
    return f


def _tensors(d, fname="model.safetensors"):
    from safetensors.numpy import load_file
    return load_file(str(d / fname))


def _save(tensors, path):
    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if any tensor's data is read: the error must come first."""
    import gguf

    def refuse(*a, **k):
        raise AssertionError("a weight was read before the bad input was refused")

    monkeypatch.setattr(hf_loader._SafetensorsDir, "get", refuse)
    monkeypatch.setattr(hf_loader, "_slice_reader", refuse)
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)


def _refused(path, *parts):
    """load(path) raises a CheckpointError (a ValueError) whose message holds every part."""
    with pytest.raises(CheckpointError) as e:
        load(str(path))
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    for p in parts:
        assert str(p) in msg, (p, msg)
    return msg


# ----------------------------------------------------------------------- GGUF files
def _gguf_meta(config):
    """A `llama` GGUF header of `config` (keys without the arch prefix), as llama.cpp writes it."""
    return {"block_count": config.num_layers, "context_length": config.max_position,
            "embedding_length": config.hidden_size, "feed_forward_length": config.ffn_size,
            "attention.head_count": config.num_heads, "attention.head_count_kv": config.num_kv_heads,
            "rope.freq_base": float(config.rope_theta), "attention.layer_norm_rms_epsilon": float(config.rms_eps),
            "vocab_size": config.vocab_size}


def _write_gguf(path, config, params, **meta_changes):
    """A float32 `llama` GGUF of ``params`` (Q/K rows permuted as llama.cpp's converter stores
    them), its header `_gguf_meta(config)` with ``meta_changes`` ("__" for "."; None: drop)."""
    import gguf
    meta = _gguf_meta(config)
    for k, v in meta_changes.items():
        k = k.replace("__", ".")
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in meta.items():
        key = f"llama.{key}"
        if isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif v < 0:
            w.add_int32(key, v)
        else:
            w.add_uint32(key, v)
    p = canonical_params(params, config)
    heads = {"wq": config.num_heads, "wk": config.num_kv_heads}
    for t in tensor_names(config):
        for i in range(config.num_layers) if t.per_layer else [None]:
            arr = np.asarray(p["layers"][t.key][i] if t.per_layer else p[t.key], np.float32)
            arr = arr.T if t.transpose else arr
            if t.key in heads:
                arr = permute_qk(arr, heads[t.key])
            w.add_tensor(t.gguf.format(i=i), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model, params):
    toks = np.asarray([[5, 9, 1, 33, 60, 7, 11, 3, 20, 40, 2, 8]], np.int32)
    return np.asarray(model.apply(params, toks, None)[0])


# ============================================================ item 5: stale tensors win silently
def test_item5_stale_copy_beside_model_safetensors_is_not_read(tmp_path):
    """Old: with no index every *.safetensors was read and the alphabetically last copy won, so a
    ``zz-stale-copy.safetensors`` holding ``model.norm.weight`` = 7 loaded as the final norm. Now
    ``model.safetensors`` is read alone, as transformers reads it."""
    d = _hf_dir(tmp_path)
    good = _tensors(d)["model.norm.weight"]
    _save({"model.norm.weight": np.full_like(good, 7.0)}, d / "zz-stale-copy.safetensors")
    model, params = load(str(d))
    np.testing.assert_array_equal(np.asarray(canonical_params(params, model.config)["final_norm"]), good)
    assert not np.any(np.asarray(params["final_norm"]) == 7.0)


def test_item5_tensor_in_two_files_without_index_is_refused(tmp_path, no_weight_reads):
    """Old: shards without ``model.safetensors`` or an index, one tensor in two of them: the
    alphabetically last file's copy (7) loaded silently. Now refused naming the tensor and both
    files; shards that hold each tensor once still load (below)."""
    d = _hf_dir(tmp_path)
    t = _tensors(d)
    (d / "model.safetensors").unlink()
    names = sorted(t)
    _save({k: t[k] for k in names[: len(names) // 2]}, d / "part-a.safetensors")
    _save({k: t[k] for k in names[len(names) // 2:]}, d / "part-b.safetensors")
    _save({"model.norm.weight": np.full_like(t["model.norm.weight"], 7.0)}, d / "zz-stale-copy.safetensors")
    _refused(d, "'model.norm.weight'", "zz-stale-copy.safetensors", "part-", "in both")


def test_item5_disjoint_shards_without_index_still_load(tmp_path):
    """The control of the test above: the same shards with no second copy load exactly."""
    d = _hf_dir(tmp_path)
    t = _tensors(d)
    (d / "model.safetensors").unlink()
    names = sorted(t)
    _save({k: t[k] for k in names[: len(names) // 2]}, d / "part-a.safetensors")
    _save({k: t[k] for k in names[len(names) // 2:]}, d / "part-b.safetensors")
    model, params = load(str(d))
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), t["model.norm.weight"])


def _sharded(tmp_path):
    """A checkpoint in two shards and an index (no model.safetensors); returns (dir, tensors)."""
    d = _hf_dir(tmp_path)
    t = _tensors(d)
    (d / "model.safetensors").unlink()
    names = sorted(t)
    first = set(names[: len(names) // 2])
    _save({k: t[k] for k in first}, d / "model-00001-of-00002.safetensors")
    _save({k: t[k] for k in names if k not in first}, d / "model-00002-of-00002.safetensors")
    weight_map = {k: ("model-00001-of-00002.safetensors" if k in first else "model-00002-of-00002.safetensors")
                  for k in names}
    return d, t, weight_map


def test_item5_index_listing_a_tensor_twice_is_refused(tmp_path, no_weight_reads):
    """Old: an index whose weight_map names ``model.norm.weight`` twice took the last entry (here
    a stale shard holding 7). Now the duplicate key is refused naming it and the index."""
    d, t, weight_map = _sharded(tmp_path)
    _save({"model.norm.weight": np.full_like(t["model.norm.weight"], 7.0)}, d / "stale.safetensors")
    entries = [f'"{k}": "{v}"' for k, v in weight_map.items()] + ['"model.norm.weight": "stale.safetensors"']
    (d / "model.safetensors.index.json").write_text(
        '{"metadata": {"total_size": 0}, "weight_map": {' + ", ".join(entries) + "}}")
    _refused(d, "'model.norm.weight'", "twice", "model.safetensors.index.json")


# ============================================= item 6: a header with fewer layers than the file
@pytest.mark.parametrize("kind", ["llama", "mixtral", "gemma3"])
def test_item6_hf_header_with_fewer_layers_is_refused(tmp_path, kind, no_weight_reads):
    """Old: ``num_hidden_layers: 1`` over two layers' tensors loaded a 1-layer (truncated) model
    for llama, mixtral and gemma3 (transformers warns of the unused weights). Now refused naming
    the header's count, the file and the layers found, in `load` and in the sharded reader."""
    config = CFG if kind == "llama" else _family(kind)
    d = _hf_dir(tmp_path, config)
    changes = {"num_hidden_layers": 1}
    if kind == "gemma3":
        changes["layer_types"] = json.loads((d / "config.json").read_text())["layer_types"][:1]
    _edit_config(d, **changes)
    _refused(d, "num_hidden_layers=1", "config.json", "layers 0-1", "model.layers.1.")
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=1 .*layers 0-1"):
        hf_loader.read_hf_placed(d, lambda *a: jax.sharding.SingleDeviceSharding(jax.devices()[0]), "float32")


def test_item6_gguf_block_count_below_the_tensors_is_refused(tmp_path, no_weight_reads):
    """Old: ``llama.block_count=1`` over two layers' tensors loaded a 1-layer model (llama.cpp
    refuses the tensor-count mismatch). Now refused naming the key, the file and the layers."""
    path = _write_gguf(tmp_path / "short.gguf", CFG, _params(CFG), block_count=1)
    _refused(path, "llama.block_count=1", "short.gguf", "layers 0-1", "blk.1.")


# =========================================================== item 7: absurd numbers
@pytest.mark.parametrize("theta", [0, -10000.0])
def test_item7_hf_rope_theta_not_positive_is_refused(tmp_path, theta, no_weight_reads):
    """Old: rope_theta 0 or negative loaded and gave 100% NaN logits. Now refused naming the key
    (``rope_parameters.rope_theta`` as transformers 5 writes it, ``rope_theta`` in older files)."""
    d = _hf_dir(tmp_path)
    _edit_config(d, rope_parameters={"rope_type": "default", "rope_theta": theta})
    _refused(d, f"rope_parameters.rope_theta={float(theta)!r}", "config.json", "> 0")
    _edit_config(d, rope_parameters=None, rope_theta=theta)
    _refused(d, f"rope_theta={float(theta)!r} in", "config.json")


@pytest.mark.parametrize("factor", [0, -2.0])
def test_item7_hf_linear_rope_factor_not_positive_is_refused(tmp_path, factor, no_weight_reads):
    """Old: a linear RoPE ``factor`` of 0 gave NaN logits, -2 finite but wrong ones. Now refused
    naming the factor's key and the file."""
    d = _hf_dir(tmp_path)
    _edit_config(d, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": factor})
    _refused(d, f"rope_parameters.factor={factor!r}", "config.json", "> 0")
    _edit_config(d, rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": factor})
    _refused(d, f"rope_scaling.factor={factor!r}", "config.json")


@pytest.mark.parametrize("eps", [-1e-5, float("nan")])
def test_item7_hf_rms_norm_eps_negative_or_nan_is_refused(tmp_path, eps, no_weight_reads):
    """Old: a negative or NaN ``rms_norm_eps`` loaded (NaN: NaN logits; negative: wrong ones, NaN
    where a row's mean square is below -eps). Now refused naming it."""
    d = _hf_dir(tmp_path)
    _edit_config(d, rms_norm_eps=eps)
    _refused(d, f"rms_norm_eps={eps!r}", "config.json", ">= 0")


def test_item7_gguf_rope_freq_base_zero_is_refused(tmp_path, no_weight_reads):
    """Old: ``llama.rope.freq_base=0`` loaded (NaN logits). Now refused naming the key and file."""
    path = _write_gguf(tmp_path / "base0.gguf", CFG, _params(CFG), rope__freq_base=0.0)
    _refused(path, "llama.rope.freq_base=0.0", "base0.gguf", "> 0")
    path = _write_gguf(tmp_path / "eps.gguf", CFG, _params(CFG), attention__layer_norm_rms_epsilon=-1e-5)
    _refused(path, "llama.attention.layer_norm_rms_epsilon=-1e-05", "eps.gguf", ">= 0")


def test_item7_gguf_rope_scaling_factor_zero_reads_as_llama_cpp_does(tmp_path):
    """Old: ``rope.scaling.factor=0`` (linear) divided the frequencies by 0: NaN logits. llama.cpp
    reads a factor of 0 as no scaling (src/llama-model.cpp: ``ropescale == 0.0f ? 1.0f :
    1.0f/ropescale``); so does specjax now: the logits are the unscaled file's, finite. A negative
    factor is refused naming the key."""
    params = _params(CFG)
    plain = load(str(_write_gguf(tmp_path / "plain.gguf", CFG, params)))
    zero = load(str(_write_gguf(tmp_path / "zero.gguf", CFG, params, rope__scaling__type="linear",
                                rope__scaling__factor=0.0)))
    assert zero[0].config.rope_scaling_dict == {"rope_type": "linear", "factor": 1.0}
    a, b = _logits(*plain), _logits(*zero)
    assert np.isfinite(b).all()
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    path = _write_gguf(tmp_path / "neg.gguf", CFG, params, rope__scaling__type="linear", rope__scaling__factor=-2.0)
    _refused(path, "llama.rope.scaling.factor=-2.0", "neg.gguf")


def test_item7_presets_and_code_built_configs_get_the_checks():
    """`ModelConfig` itself refuses the absurd numbers (every path: HF, GGUF, presets, code).
    Old: each of these built, and the model gave NaN (or wrong) logits at its first forward."""
    bad = {"rope_theta": [0.0, -1.0, float("nan"), float("inf")], "rms_eps": [-1e-6, float("nan")],
           "local_rope_theta": [0.0], "num_layers": [0, -1], "num_heads": [0], "num_kv_heads": [0, -2],
           "head_dim": [0], "hidden_size": [0], "vocab_size": [0], "ffn_size": [0], "num_experts": [-1]}
    for field, values in bad.items():
        for v in values:
            with pytest.raises(ValueError, match=rf"^{field}="):
                CFG.replace(**{field: v})
    for scaling, key in (({"rope_type": "linear", "factor": 0}, "rope_scaling.factor=0"),
                         ({"rope_type": "linear"}, "rope_scaling.factor=None"),
                         ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
                          "rope_scaling.high_freq_factor=1.0")):
        with pytest.raises(ValueError, match=rf"^{key}"):
            CFG.replace(rope_scaling=scaling)
    with pytest.raises(ValueError, match=r"^experts_per_token=3: must be in \[1, num_experts=2\]"):
        CFG.replace(num_experts=2, experts_per_token=3)


# ============================================================ item 12: malformed headers
@pytest.mark.parametrize("key,field", [("attention__head_count_kv", "llama.attention.head_count_kv=0"),
                                       ("attention__head_count", "llama.attention.head_count=0")])
def test_item12_gguf_zero_head_count_is_refused(tmp_path, key, field, no_weight_reads):
    """Old: ``attention.head_count_kv=0`` / ``attention.head_count=0`` raised a ZeroDivisionError
    (a traceback). Now a CheckpointError naming the key and the file."""
    path = _write_gguf(tmp_path / "heads.gguf", CFG, _params(CFG), **{key: 0})
    _refused(path, field, "heads.gguf", ">= 1")


def test_item12_gemma3_sliding_window_pattern_zero_is_refused(tmp_path, no_weight_reads):
    """Old: Gemma 3 ``sliding_window_pattern: 0`` (no layer_types) raised a ZeroDivisionError.
    Now refused naming the key and the file."""
    d = _hf_dir(tmp_path, _family("gemma3"))
    _edit_config(d, layer_types=None, sliding_window_pattern=0)
    _refused(d, "sliding_window_pattern=0", "config.json", ">= 1")


def test_item12_linear_rope_without_factor_is_refused_at_load(tmp_path, no_weight_reads):
    """Old: a linear RoPE scaling without ``factor`` loaded and raised KeyError('factor') at the
    first forward. Now refused at load naming the missing factor and the file."""
    d = _hf_dir(tmp_path)
    _edit_config(d, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0})
    _refused(d, "rope_parameters.factor=None", "config.json", "needs a factor")


def test_item12_index_whose_weight_map_is_a_list_is_refused(tmp_path, no_weight_reads):
    """Old: an index whose ``weight_map`` is a list raised AttributeError ('list' object has no
    attribute 'items'). Now a CheckpointError naming weight_map and the index."""
    d, _, weight_map = _sharded(tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": list(weight_map.items())}))
    _refused(d, "weight_map is a list", "model.safetensors.index.json")


# ============================================================ item 17: unhelpful errors
def test_item17_zero_experts_is_refused_by_name(tmp_path, no_weight_reads):
    """Old: Mixtral ``num_local_experts: 0`` read as a dense model and failed on the missing
    ``mlp.gate_proj``; Qwen3-MoE's ``num_experts: 0`` fell back to ``num_local_experts`` (or a
    KeyError). Now refused naming the key."""
    d = _hf_dir(tmp_path, _family("mixtral"), "mixtral")
    _edit_config(d, num_local_experts=0)
    _refused(d, "num_local_experts=0", "config.json", "at least 1 expert")
    d = _hf_dir(tmp_path, _family("qwen3_moe"), "qwen3_moe")
    _edit_config(d, num_experts=0)
    _refused(d, "num_experts=0", "config.json", "at least 1 expert")
    _edit_config(d, num_experts=None, num_local_experts=4, num_experts_per_tok=0)
    _refused(d, "num_experts_per_tok=0", "config.json", "must be in [1, num_experts=4]")


@pytest.mark.parametrize("key,value", [("num_attention_heads", 0), ("num_attention_heads", -4),
                                       ("num_key_value_heads", 0), ("num_key_value_heads", -2),
                                       ("num_hidden_layers", 0), ("num_hidden_layers", -1),
                                       ("head_dim", 0), ("hidden_size", 0), ("vocab_size", 0)])
def test_item17_zero_or_negative_counts_are_refused_by_name(tmp_path, key, value, no_weight_reads):
    """Old: zero or negative head and layer counts gave a ZeroDivisionError or shape errors
    (``num_key_value_heads: 0`` was replaced by the query heads, then k_proj's shape failed).
    Now refused naming config.json's key and value before any weight is read."""
    d = _hf_dir(tmp_path)
    _edit_config(d, **{key: value})
    _refused(d, f"{key}={value} in", "config.json", ">= 1")
