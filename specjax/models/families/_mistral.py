"""Mistral: Llama's layers with sliding-window attention in every layer (``sliding_window``;
null in the checkpoints of v0.2 and later, which attend to the whole prefix)."""

from specjax.models import families as f


def _read(cfg):
    f.no_bias(cfg)
    # transformers' Mistral windows every layer and ignores layer_types; so does this reader
    return {"mlp_activation": f.activation(cfg),
            **f.windows(cfg, int(cfg["num_hidden_layers"]), use_layer_types=False)}


def _write(config):
    f.same_window_everywhere(config, "Mistral")
    return {"sliding_window": config.sliding_window or None}


MISTRAL = f.register(f.Family("mistral", ("MistralForCausalLM",), ("mistral",), _read, _write,
                              features=frozenset({"sliding_window"})))
