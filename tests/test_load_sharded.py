"""Checkpoints read straight onto a mesh (issue 41 item 4): `sharding.load_sharded` on 8
simulated CPU devices (a subprocess) reads sharded safetensors (`model-0000i-of-0000n` + index,
written by transformers) tensor by tensor, each device's block from its slice of the file:
the placed values equal `models.load`'s bit for bit, bfloat16 stays bfloat16, every tensor has
the spec the rules give it (vocab, heads, kv, mlp and experts over "model"), and the logits of
a forward agree with the single-device ones within 2% of their scale (bfloat16 sums in another
order). A wrong shape or a missing tensor is named."""
import json

import pytest

torch = pytest.importorskip("torch")

from _hf_tiny import family_model, hf_model  # noqa: E402

_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from specjax import models, sharding
assert jax.device_count() == 8
mesh = sharding.make_mesh(data=2, model=4)
for path in sys.argv[1:]:
    model, placed = sharding.load_sharded(path, mesh, dtype="bfloat16")
    ref_model, ref = models.load(path, dtype="bfloat16")
    assert model.config == ref_model.config, (model.config, ref_model.config)
    flat, _ = jax.tree_util.tree_flatten_with_path(placed)
    ref_flat = dict(jax.tree_util.tree_flatten_with_path(ref)[0])
    axes = dict(jax.tree_util.tree_flatten_with_path(models.param_logical_axes(model.config),
                                                     is_leaf=lambda x: isinstance(x, tuple))[0])
    for key, x in flat:
        assert x.dtype == jnp.bfloat16, (key, x.dtype)
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(ref_flat[key], np.float32))
        want = sharding.logical_to_spec(axes[key], sharding.DEFAULT_RULES, mesh, x.shape)
        assert x.sharding.spec == want, (key, x.sharding.spec, want)
    if model.config.num_experts:
        assert tuple(placed["layers"]["we_gate"].sharding.spec)[:2] == (None, "model")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 101, (2, 12)))
    got = jax.jit(model.apply)(placed, tokens, None)[0]
    want = jax.jit(ref_model.apply)(ref, tokens, None)[0]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bfloat16 matmuls summed in another order on 4 shards: within 2% of the logits' scale
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max(), np.abs(got - want).max()
    print("OK", path)
"""


def _save(model, path):
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2


def test_load_sharded_equals_load_on_a_mesh(tmp_path):
    from _bench_run import run_script_on_devices
    paths = []
    for name, model in (("llama", hf_model("llama_linear")), ("mixtral", family_model("mixtral"))):
        _save(model, tmp_path / name)
        paths.append(str(tmp_path / name))
    out = run_script_on_devices(_SCRIPT, *paths, devices=8)
    assert out.count("OK") == 2, out


def test_bad_tensors_are_named(tmp_path):
    import jax
    from safetensors.torch import load_file, save_file
    from specjax import sharding
    from specjax.models import CorruptCheckpointError, MissingTensorError, TensorShapeError
    _save(hf_model("llama_linear"), tmp_path / "m")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    shard = tmp_path / "m" / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    mesh = sharding.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    with pytest.raises(TensorShapeError, match="up_proj"):
        sharding.load_sharded(tmp_path / "m", mesh)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match="up_proj"):      # the index names a file that lacks it
        sharding.load_sharded(tmp_path / "m", mesh)
    del index["weight_map"][name]
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match="up_proj"):
        sharding.load_sharded(tmp_path / "m", mesh)
