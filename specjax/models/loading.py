"""One entry point for every checkpoint kind: a known name, a GGUF file, a Hugging Face directory.

The readers (`gguf_loader.read_gguf`, `hf_loader.read_hf`) return a `ModelConfig` and canonical
params; here the layout is chosen (``scan_layers``, ``fuse_projections``) and the params are put
into it once, consuming the canonical arrays as they are converted (see `Llama.prepare_params`).
"""

from __future__ import annotations

import pathlib

from specjax.models import registry
from specjax.models.config import CheckpointError, ModelConfig
from specjax.models.gguf_loader import open_gguf, read_gguf
from specjax.models.hf_loader import read_hf
from specjax.models.llama import Llama, _relayout
from specjax.models.tokenizer import Tokenizer, gguf_tokenizer_metadata


def _checkpoint(name_or_path) -> tuple[str, pathlib.Path]:
    """("hf" | "gguf", path) of a known name or a path."""
    path = pathlib.Path(registry.resolve(str(name_or_path)))
    if path.is_dir():
        return "hf", path
    if path.suffix == ".safetensors" or path.name == "config.json":
        return "hf", path.parent
    with open(path, "rb") as f:
        magic = f.read(4)
    if path.suffix == ".gguf" or magic == b"GGUF":
        return "gguf", path
    raise CheckpointError(f"{path} is neither a GGUF file nor a Hugging Face checkpoint directory")


def _model(config: ModelConfig, params: dict, scan_layers: bool, fuse_projections: bool,
           linear_op: str = "xla"):
    """The model in the asked layout. Only the plain linear op holds expert weights: a
    mixture-of-experts model asked for another keeps XLA's matmuls (``linear_op="xla"``)."""
    config = config.replace(scan_layers=scan_layers, fuse_projections=fuse_projections,
                            linear_op="xla" if config.num_experts else linear_op)
    return Llama(config), _relayout(params, config)


def load(name_or_path: str = registry.DEFAULT_MODEL, dtype: str = "float32",
         scan_layers: bool = True, fuse_projections: bool = False,
         linear_op: str = "xla") -> tuple[Llama, dict]:
    """(model, params) from a known name, a GGUF file, or a Hugging Face checkpoint dir.

    Known names go through `specjax.models.registry.resolve` (fetched and sha256-checked).
    Params come in the layout of the model's config (`specjax.models.llama`): layers stacked
    along a leading axis for ``scan_layers=True``, a tuple of per-layer dicts for
    ``scan_layers=False``; with ``fuse_projections`` the projections fused; with
    ``linear_op`` (`specjax.kernels.LINEAR_OPS`; "panels" needs ``scan_layers=False``) in that
    op's stored form.
    """
    kind, path = _checkpoint(name_or_path)
    if kind == "hf":
        config, params = read_hf(path, dtype=dtype)
    else:
        config, params = read_gguf(open_gguf(path), dtype=dtype, path=path)
    return _model(config, params, scan_layers, fuse_projections, linear_op)


def load_with_tokenizer(name_or_path: str = registry.DEFAULT_MODEL, dtype: str = "float32",
                        scan_layers: bool = True, fuse_projections: bool = False,
                        linear_op: str = "xla") -> tuple[Llama, dict, Tokenizer]:
    """(model, params, tokenizer) as `load` gives, plus the checkpoint's tokenizer.

    A GGUF file is opened once for both; a Hugging Face directory's tokenizer is its
    ``tokenizer.json`` (with ``tokenizer_config.json``, see `Tokenizer.from_tokenizer_json`).
    """
    kind, path = _checkpoint(name_or_path)
    if kind == "hf":
        tokenizer = Tokenizer.from_tokenizer_json(path)
        config, params = read_hf(path, dtype=dtype)
    else:
        reader = open_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(reader), name_or_path=str(path))
        config, params = read_gguf(reader, dtype=dtype, path=path)
        del reader
    model, params = _model(config, params, scan_layers, fuse_projections, linear_op)
    return model, params, tokenizer
