"""Mistral: Llama's layers with sliding-window attention in every layer (``sliding_window``;
null in the checkpoints of v0.2 and later, which attend to the whole prefix)."""

from specjax.models import families as f


def _read(cfg):
    f.no_bias(cfg)
    return {"mlp_activation": f.activation(cfg), **f.windows(cfg, int(cfg["num_hidden_layers"]))}


def _write(config):
    out = {"sliding_window": config.sliding_window or None}
    if config.window_layers is not None:
        out["layer_types"] = f.layer_types(config)
    return out


MISTRAL = f.register(f.Family("mistral", ("MistralForCausalLM",), ("mistral",), _read, _write))
