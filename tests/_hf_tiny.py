"""Test helpers for the model layer: tiny random transformers checkpoints (Llama with llama3/linear
RoPE scaling, Qwen2) and right-padded prompt batches."""
import numpy as np

VOCAB = 101


def hf_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, initializer_range=0.15)
    if kind == "llama3":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    if kind == "llama_linear":
        return LlamaConfig(**common, tie_word_embeddings=False, head_dim=24, rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raise ValueError(kind)


def hf_model(kind: str, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():   # make biases and norm weights non-trivial
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(model, tokens_BT) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens_BT), dtype=torch.long)).logits.double().numpy()


def rel_and_kl(ref, got):
    """Per position max|Δ| / max|ref| and KL(p_ref || p_got)."""
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    rel = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
    lp_ref = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    lp_got = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    kl = (np.exp(lp_ref) * (lp_ref - lp_got)).sum(-1)
    return rel, kl


def right_padded(prompts):
    """(tokens [B, longest] int32 with 0 after each prompt, lengths [B] int32) for ragged prefill."""
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    return tokens, lengths


# ---------------------------------------------------------------------------------------
# The families of issue 41: tiny configs whose features all bite within 40 tokens (windows of
# 6 positions, soft-caps near the scores' size, a scaled global RoPE beside a local one).
# ---------------------------------------------------------------------------------------
FAMILY_KINDS = ("qwen3", "mistral", "gemma2", "gemma3", "qwen2_window", "mixtral", "qwen3_moe")
WINDOW = 6


def family_config(kind: str):
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, initializer_range=0.15, attn_implementation="eager")
    if kind == "qwen3":
        return tf.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if kind == "qwen2_window":
        return tf.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=True,
                              sliding_window=WINDOW, max_window_layers=1,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if kind == "mistral":
        return tf.MistralConfig(**common, head_dim=16, tie_word_embeddings=False, sliding_window=WINDOW,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if kind == "gemma2":
        # (untied heads: with a tied one these tiny models only repeat their last token)
        return tf.Gemma2Config(**common, head_dim=16, tie_word_embeddings=False, query_pre_attn_scalar=24, sliding_window=WINDOW,
                               attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if kind == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=16, tie_word_embeddings=False, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={
                                       "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if kind == "mixtral":
        return tf.MixtralConfig(**common, head_dim=16, tie_word_embeddings=False, sliding_window=WINDOW,
                                num_local_experts=4, num_experts_per_tok=2,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=16, tie_word_embeddings=False, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False,
                                 decoder_sparse_step=1, mlp_only_layers=[],
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raise ValueError(kind)


def family_model(kind: str, seed: int = 0):
    """A tiny random transformers model of `kind` with non-trivial norms (and biases)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:       # Gemma's norms scale by (1 + w): keep w around 0
                p.uniform_(-0.5, 0.5) if kind.startswith("gemma") else p.uniform_(0.5, 1.5)
    return model


def parity_cases(model, params, ref_model, seed: int = 0):
    """(case, reference logits, specjax logits) for every case of the family parity checks, each
    against transformers' full forward of the same sequence: a ragged prefill of two prompts past
    the window (17 and 9 tokens), four cached one-token steps, a 5-token verification block, a
    rollback to 2 of its tokens, then a (2, 2) token tree (root + 6 nodes) after it. The specjax
    side is one compiled program per model (the steps a `lax.scan` over the cache the prefill
    returned)."""
    import jax
    import jax.numpy as jnp
    from specjax import trees
    from specjax.models import TreeBlock
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, 17), rng.integers(0, VOCAB, 9)]
    steps, block = rng.integers(0, VOCAB, (2, 4)), rng.integers(0, VOCAB, (2, 5))
    shape = trees.TreeShape.from_branching((2, 2))
    nodes, roots = rng.integers(0, VOCAB, (2, shape.num_nodes)), rng.integers(0, VOCAB, 2)
    parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (2, shape.num_nodes))
    tree = TreeBlock(rel_positions_BT=jnp.broadcast_to(jnp.asarray((0,) + shape.depths, jnp.int32),
                                                       (2, shape.num_nodes + 1)),
                     visible_BTW=trees.ancestor_mask(parents, jnp.ones((2, shape.num_nodes), bool), shape.max_depth))

    @jax.jit
    def run(params, tokens, lengths, steps_TB, block, tree_tokens, tree):
        prefill, cache = model.apply(params, tokens, model.init_cache(2, 48), lengths)

        def one_step(cache, tok_B):
            logits, cache = model.apply(params, tok_B[:, None], cache)
            return cache, logits[:, 0]
        cache, step_logits = jax.lax.scan(one_step, cache, steps_TB)
        block_logits, block_cache = model.apply(params, block, cache)
        cache = block_cache.replace(lengths_B=cache.lengths_B + 2)          # rollback: keep 2 of the 5
        tree_logits, _ = model.apply(params, tree_tokens, cache, None, tree)
        return prefill, step_logits, block_logits, tree_logits

    tokens, lengths = right_padded(prompts)
    out = run(params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(steps.T), jnp.asarray(block),
              jnp.asarray(np.concatenate([roots[:, None], nodes], axis=1)), tree)
    prefill, step_logits, block_logits, tree_logits = (np.asarray(x) for x in out)
    ref = lambda seq: hf_logits(ref_model, np.asarray(seq)[None])[0]     # noqa: E731
    seqs = [list(map(int, p)) for p in prompts]
    for b in range(2):
        yield "ragged prefill", ref(seqs[b]), prefill[b, :lengths[b]]
    for t in range(steps.shape[1]):
        for b in range(2):
            seqs[b].append(int(steps[b, t]))
            yield "cached one-token step", ref(seqs[b])[-1:], step_logits[t, b][None]
    for b in range(2):
        yield "5-token verification block", ref(seqs[b] + block[b].tolist())[-block.shape[1]:], block_logits[b]
        seqs[b] += block[b, :2].tolist()
    for b in range(2):
        prefix = seqs[b] + [int(roots[b])]
        yield "tree block (after a rollback)", ref(prefix)[-1:], tree_logits[b, :1]
        for n in range(shape.num_nodes):
            path, m = [], n
            while m >= 0:
                path.append(int(nodes[b, m]))
                m = shape.parents[m]
            yield "tree block (after a rollback)", ref(prefix + path[::-1])[-1:], tree_logits[b, n + 1:n + 2]
