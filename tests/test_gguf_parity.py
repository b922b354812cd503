"""SmolLM2-135M-Instruct from its GGUF: specjax vs transformers (PyTorch CPU, float32).

Both sides load the same GGUF file (transformers dequantizes it and undoes llama.cpp's Q/K
permutation itself). Prompts are held-out Spec-Bench questions in the model's chat template
(tokenized by transformers from the same GGUF). specjax prefills (the short prompts as one
ragged batch) and decodes 16 steps through its KV cache, teacher-forced on transformers'
greedy tokens; transformers' reference logits are its own prefill + incremental decode.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_tiny import right_padded  # noqa: E402
from specjax import specbench  # noqa: E402
from specjax.models import (gguf_loader, load, load_tokenizer, load_with_tokenizer,  # noqa: E402
                            names, resolve)

N_DECODE = 16
SHORT = ("qa", "stem", "reasoning", "math")
LONG = ("rag",)
REL_TOL = 1e-4
KL_TOL = 1e-5


@pytest.fixture(scope="module")
def gguf_path():
    return resolve("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def hf(gguf_path):
    # One intra-op thread: on a small shared CPU, torch's thread pool mostly spins.
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def sj():
    model, params = load("smollm2-135m-instruct", dtype="float32", scan_layers=True)
    return model, params


def _prompt_ids(tok, question):
    ids = tok.apply_chat_template([{"role": "user", "content": question.prompt}],
                                  add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


@torch.no_grad()
def _hf_reference(model, ids):
    """transformers' greedy tokens and logits [P + N_DECODE, V]: its prefill over the prompt,
    then N_DECODE incremental steps through its own cache, each fed its greedy token."""
    out = model(torch.tensor([ids]), use_cache=True)
    logits = [out.logits[0].double().numpy()]
    past, greedy = out.past_key_values, []
    for _ in range(N_DECODE):
        greedy.append(int(np.argmax(logits[-1][-1])))
        out = model(torch.tensor([[greedy[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0].double().numpy())
    return greedy, np.concatenate(logits)


def _specjax_logits(model, params, prompts, greedy):
    """Ragged prefill then N_DECODE teacher-forced decode steps; per-row logits [P+N, V]."""
    tokens, lengths = right_padded(prompts)
    capacity = int(-(-(tokens.shape[1] + N_DECODE + 1) // 64) * 64)
    step = jax.jit(model.apply, donate_argnums=(2,))
    cache = model.init_cache(len(prompts), capacity)
    logits, cache = step(params, jnp.asarray(tokens), cache, jnp.asarray(lengths))
    logits = np.asarray(logits)
    rows = [[logits[b, :lengths[b]]] for b in range(len(prompts))]
    for i in range(N_DECODE):
        tok = jnp.asarray([[g[i]] for g in greedy], jnp.int32)
        logits, cache = step(params, tok, cache)
        logits = np.asarray(logits)
        for b in range(len(prompts)):
            rows[b].append(logits[b])
    assert np.asarray(cache.lengths_B).tolist() == [int(n) + N_DECODE for n in lengths]
    return [np.concatenate(r).astype(np.float64) for r in rows]


def _metrics(ref, got):
    rel = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
    lp_ref = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    lp_got = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    kl = (np.exp(lp_ref) * (lp_ref - lp_got)).sum(-1)
    return rel, kl


@pytest.mark.parametrize("cats", [SHORT, LONG], ids=["short_ragged_batch", "rag_long"])
def test_gguf_matches_transformers(hf, sj, cats):
    tok, hf_model = hf
    model, params = sj
    questions = {q.category: q for q in specbench.one_per_category()}
    prompts = [_prompt_ids(tok, questions[c]) for c in cats]
    refs = [_hf_reference(hf_model, ids) for ids in prompts]
    greedy = [g for g, _ in refs]
    got = _specjax_logits(model, params, prompts, greedy)
    for c, ids, (g, ref), mine in zip(cats, prompts, refs, got):
        assert mine.shape == ref.shape, (c, mine.shape, ref.shape)
        rel, kl = _metrics(ref, mine)
        print(f"\n{c}: {len(ids)} prompt tokens, max rel logit err {rel.max():.2e}, "
              f"max KL {kl.max():.2e}")
        assert rel.max() <= REL_TOL, (c, rel.max(), int(rel.argmax()))
        assert kl.max() <= KL_TOL, (c, kl.max(), int(kl.argmax()))
        # Same greedy tokens: specjax's argmax at the last prompt position and after each
        # teacher-forced decode step reproduces transformers' greedy continuation.
        mine_greedy = mine[len(ids) - 1:len(ids) - 1 + N_DECODE].argmax(-1).tolist()
        assert mine_greedy == g, c


def test_gguf_config_and_unpermute(gguf_path):
    reader = gguf_loader.open_gguf(gguf_path)
    c = gguf_loader.config_from_gguf(reader, path=gguf_path)
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.ffn_size, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == 1e5 and abs(c.rms_eps - 1e-5) < 1e-9 and c.tie_embeddings
    assert not c.attention_bias and (c.bos_token_id, c.eos_token_id) == (1, 2)
    w = np.arange(2 * 3 * 8 * 5, dtype=np.float32).reshape(3 * 16 // 2 * 2, 5)
    np.testing.assert_array_equal(names.unpermute_qk(names.permute_qk(w, 3), 3), w)


def test_load_with_tokenizer_matches_separate_loads(sj):
    model, params, tok = load_with_tokenizer("smollm2-135m-instruct")
    assert model == sj[0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sj[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    alone = load_tokenizer("smollm2-135m-instruct")
    text = "Grüße, 123 <|im_end|>"
    assert tok.encode(text) == alone.encode(text) and tok.stop_token_ids == alone.stop_token_ids
    assert tok.chat_template == alone.chat_template and tok.vocab_size == model.vocab_size
