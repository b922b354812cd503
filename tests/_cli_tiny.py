"""A tiny random target/draft pair with the default target's tokenizer (SmolLM2's 49,152 tokens),
written as Hugging Face checkpoint directories, for running every `specjax` command end to end
in seconds."""
import pathlib

import jax

from specjax import models

VOCAB = 49152


def _config(num_layers: int) -> models.ModelConfig:
    return models.ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                              head_dim=8, ffn_size=64, max_position=1024, tie_embeddings=True)


def write_pair(directory) -> tuple[pathlib.Path, pathlib.Path]:
    """(target_dir, draft_dir): a 2-layer target and a 1-layer draft made of the target's first
    layer (so that it agrees with the target now and then), both with tokenizer.json."""
    d = pathlib.Path(directory)
    tok = models.load_tokenizer("smollm2-135m-instruct")
    target = models.Llama(_config(2))
    params = target.init_params(jax.random.key(0))
    params = jax.tree.map(lambda x: x * 6.0 if x.ndim >= 2 else x, params)    # peaked distributions
    models.export_hf(target, params, d / "target")
    draft_params, draft_cfg = models.truncate_layers(params, target.config, 1)
    models.export_hf(models.Llama(draft_cfg), draft_params, d / "draft")
    for sub in ("target", "draft"):
        tok.save(d / sub)
    return d / "target", d / "draft"


def data_config_and_generator(tmp_path_factory):
    """(configs/data.py's config on a tiny pair's target, XLA's matmuls, its loaded generator):
    what the data-engine tests run on."""
    from configs import data
    from specjax import build
    target_dir, _ = write_pair(tmp_path_factory.mktemp("pair"))
    c = data.get_config()
    c.generate.target = str(target_dir)
    c.generate.cpu_kernel = "off"
    return c, build.load_generator(build.generate_settings(c.generate))
