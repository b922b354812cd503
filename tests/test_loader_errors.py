"""Loader errors are clear (typed, naming the tensor / file / architecture), a tiny GGUF
written here (llama with llama.cpp's Q/K permutation, and qwen2) loads back exactly, and
`load_with_tokenizer` reads weights and tokenizer from one open GGUF (or a HF directory)."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import (CheckpointError, CorruptCheckpointError, Llama, MissingTensorError,
                            ModelConfig, TensorShapeError, Tokenizer, UnsupportedArchitectureError,
                            canonical_params, export_hf, load, load_with_tokenizer)
from specjax.models.names import permute_qk, tensor_names
from specjax.models.tokenizer import byte_level_alphabet

CFG = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, ffn_size=48, rope_theta=10000.0, rms_eps=1e-5, bos_token_id=1,
                  eos_token_id=2)


def _random(config, seed=0):
    model = Llama(config)
    return model, jax.tree.map(lambda x: 3.0 * x, model.init_params(jax.random.key(seed)))


def _tiny_tokenizer_metadata(vocab_size):
    """A byte-level BPE vocabulary of `vocab_size` tokens: three control tokens (BOS 1, EOS 2),
    bytes from "a" on, and one merge."""
    tokens = ["<unk>", "<s>", "</s>", *byte_level_alphabet()[ord("a"):ord("a") + vocab_size - 4], "ab"]
    return {"tokens": tokens, "types": [3, 3, 3] + [1] * (vocab_size - 3), "merges": ["a b"]}


def write_gguf(path, config, params, arch=None, drop=(), reshape=None, tokenizer=False):
    """A float32 GGUF of `params` laid out the way llama.cpp's converter writes them."""
    import gguf
    arch = arch or config.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.ffn_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    if config.head_dim != config.hidden_size // config.num_heads:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokenizer:
        meta = _tiny_tokenizer_metadata(config.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(meta["tokens"])
        w.add_token_types(meta["types"])
        w.add_token_merges(meta["merges"])
    p = canonical_params(params, config)
    heads = {"wq": config.num_heads, "wk": config.num_kv_heads} if arch == "llama" else {}
    for t in tensor_names(config):
        for i in range(config.num_layers) if t.per_layer else [None]:
            arr = np.asarray(p["layers"][t.key][i] if t.per_layer else p[t.key], np.float32)
            arr = arr.T if t.transpose else arr          # as stored: [out, in]
            name = t.gguf.format(i=i)
            if name in drop:
                continue
            if t.key in heads:
                arr = permute_qk(arr, heads[t.key])
            if reshape and name == reshape:
                arr = arr[:-1]
            w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("config", [CFG, CFG.replace(arch="qwen2", attention_bias=True,
                                                     tie_embeddings=False)],
                         ids=["llama", "qwen2"])
def test_tiny_gguf_round_trip(tmp_path, config):
    model, params = _random(config)
    path = write_gguf(tmp_path / "tiny.gguf", config, params)
    model2, params2 = load(str(path))
    assert model2.config.replace(max_position=config.max_position) == config
    toks = jnp.asarray([[5, 9, 1, 33, 60, 7]])
    a, _ = model.apply(params, toks, None)
    b, _ = model2.apply(params2, toks, None)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_gguf_missing_and_misshapen_tensor(tmp_path):
    _, params = _random(CFG)
    path = write_gguf(tmp_path / "a.gguf", CFG, params, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(MissingTensorError, match=r"blk\.1\.ffn_up\.weight"):
        load(str(path))
    path = write_gguf(tmp_path / "b.gguf", CFG, params, reshape="blk.0.ffn_down.weight")
    with pytest.raises(TensorShapeError, match=r"blk\.0\.ffn_down\.weight.*\(31, 48\).*\(32, 48\)"):
        load(str(path))


def test_gguf_unsupported_architecture(tmp_path):
    _, params = _random(CFG)
    path = write_gguf(tmp_path / "g.gguf", CFG, params, arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        load(str(path))


def test_truncated_gguf(tmp_path):
    _, params = _random(CFG)
    path = write_gguf(tmp_path / "full.gguf", CFG, params)
    data = path.read_bytes()
    for cut in (len(data) // 2, 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError, match=str(bad.name)):
            load(str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CorruptCheckpointError, match="junk.gguf"):
        load(str(junk))


def _hf_dir(tmp_path, config=CFG):
    model, params = _random(config)
    d = tmp_path / "ckpt"
    export_hf(model, params, d)
    return d


def _rewrite(d, fn):
    from safetensors.numpy import load_file, save_file
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))


def test_hf_missing_tensor(tmp_path):
    d = _hf_dir(tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        load(str(d))


def test_hf_misshapen_tensor(tmp_path):
    d = _hf_dir(tmp_path)

    def shrink(t):
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][:, :30]
    _rewrite(d, shrink)
    with pytest.raises(TensorShapeError) as e:
        load(str(d))
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_proj.weight" in msg
    assert "(32, 30)" in msg and "(32, 32)" in msg


def test_hf_config_without_a_required_key(tmp_path):
    d = _hf_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    without = {k: v for k, v in cfg.items() if k != "num_attention_heads"}
    for broken, what in ((without, "num_attention_heads"), ({**cfg, "hidden_size": None}, "NoneType"),
                         ([], "list")):
        (d / "config.json").write_text(json.dumps(broken))
        with pytest.raises(CorruptCheckpointError, match=rf"config\.json is not a model config.*{what}"):
            load(str(d))


def test_tensor_names_cover_exactly_the_params_of_a_config():
    """`names` holds only names: which tensors exist, and their shapes, are `param_specs`'s."""
    from specjax.models.llama import param_shapes
    for config in (CFG, CFG.replace(tie_embeddings=False, attention_bias=True)):
        shapes = param_shapes(config)
        keys = {t.key for t in tensor_names(config)}
        assert keys == (set(shapes) - {"layers"}) | set(shapes["layers"])


def test_hf_unsupported_architecture(tmp_path):
    d = _hf_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        load(str(d))


def test_truncated_safetensors(tmp_path):
    d = _hf_dir(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load(str(d))
    f.write_bytes(data[:5])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load(str(d))


def test_not_a_checkpoint(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError):
        load(str(f))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError):
        load(str(tmp_path / "empty"))
    assert issubclass(CheckpointError, ValueError)
    shutil.rmtree(tmp_path / "empty")


def test_load_with_tokenizer_opens_the_gguf_once(tmp_path, monkeypatch):
    import gguf
    model, params = _random(CFG)
    path = write_gguf(tmp_path / "tok.gguf", CFG, params, tokenizer=True)
    opened = []
    reader_cls = gguf.GGUFReader

    def counting_reader(*args, **kwargs):
        opened.append(args)
        return reader_cls(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    model2, params2, tok = load_with_tokenizer(str(path), scan_layers=False, fuse_projections=True)
    assert len(opened) == 1
    assert tok.vocab_size == CFG.vocab_size and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.encode("abba") == [60, 4, 3] and tok.decode([60, 4, 3]) == "abba"   # "ab" merged
    assert not model2.config.scan_layers and model2.config.fuse_projections
    assert isinstance(params2["layers"], tuple) and "wqkv" in params2["layers"][0]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 canonical_params(params2, model2.config), canonical_params(params, CFG))

    # A Hugging Face directory: the weights, and the directory's tokenizer.json.
    d = _hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_with_tokenizer(str(d))
    tok.save(d)
    model3, params3, tok3 = load_with_tokenizer(str(d))
    assert isinstance(tok3, Tokenizer) and tok3.encode("abba") == tok.encode("abba")
    assert model3.config.scan_layers and "wq" in params3["layers"]
