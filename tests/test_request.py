"""The request path (`decoding.Generator`): prompts in, completions out, through the engine.

The tokenizer here is a stand-in with a fixed character-level vocabulary and a chat template
that wraps the text in marker ids, so the test checks what the path does with text (template,
encode, detokenize) without loading a real tokenizer; the model is the tabular toy target.
"""

import jax
import numpy as np
import pytest

from specjax import decoding, drafters, sampling

from _toy import TabularModel, random_table

V = 12


class CharTokenizer:
    """ids 2.. are the letters a.., 0 and 1 are the chat markers."""

    def encode(self, text):
        return [2 + ord(ch) - ord("a") for ch in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = []
        for m in messages:
            ids += [0] + self.encode(m["content"]) + [1]
        return ids

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i - 2) if i >= 2 else ("" if skip_special_tokens else "|") for i in ids)


@pytest.fixture(scope="module")
def generator():
    table = random_table(jax.random.key(3), V)
    config = decoding.GenerationConfig(max_new_tokens=9, gamma=3)
    engine = decoding.Engine(TabularModel(V), drafters.NGramDrafter(V), config)
    return decoding.Generator(engine, decoding.EngineParams(target=table), CharTokenizer(), pad_multiple=8)


def test_generate_equals_the_engine_run_on_the_templated_prompts(generator):
    samp = sampling.SamplingConfig.make(temperature=1.0)
    key = jax.random.key(7)
    texts = ["abc", "hij"]
    done = generator.generate(texts, samp, key)
    ids = [[0] + CharTokenizer().encode(t) + [1] for t in texts]
    batch = decoding.make_batch(ids, generator.config, key, pad_multiple=8)
    out = generator.engine.run(generator.params, samp, batch)
    assert [c.tokens for c in done] == out.generated()
    assert [c.prompt_tokens for c in done] == [5, 5]
    assert [c.status for c in done] == out.statuses() == ["max_new_tokens"] * 2
    assert [c.text for c in done] == [generator.detokenize(t) for t in out.generated()]
    # raw ids skip the template; chat=False encodes the text as it is
    assert generator.encode([4, 5]) == [4, 5]
    assert generator.encode("ab", chat=False) == [2, 3]


def test_target_only_shares_the_batch_and_greedy_tokens(generator):
    greedy = sampling.SamplingConfig.greedy_config()
    batch = generator.batch(["abcabc", "fed"], jax.random.key(0))
    spec = generator.run(batch, greedy)
    base = generator.target_only()
    assert base.engine.drafter is None and base.config.gamma == 0
    assert base.run(batch, greedy).generated() == spec.generated()


def test_calibrate_keeps_one_round_time_per_gamma():
    table = random_table(jax.random.key(3), V)
    config = decoding.GenerationConfig(max_new_tokens=6, gamma=decoding.AdaptiveGamma(gammas=(0, 2)))
    gen = decoding.Generator(decoding.Engine(TabularModel(V), drafters.NGramDrafter(V), config),
                             decoding.EngineParams(target=table), pad_multiple=8)
    batch = gen.batch([[3, 4, 5]], jax.random.key(0))
    times = gen.calibrate(batch, sampling.SamplingConfig.greedy_config(), repeats=2)
    assert gen.round_time_s == times and len(times) == 2 and all(np.isfinite(times)) and min(times) > 0


def test_text_needs_a_tokenizer():
    gen = decoding.Generator(decoding.Engine(TabularModel(V), None, decoding.GenerationConfig(4, gamma=0)),
                             decoding.EngineParams(target=random_table(jax.random.key(0), V)))
    with pytest.raises(ValueError, match="tokenizer"):
        gen.batch(["abc"], jax.random.key(0))
    assert gen.detokenize([2, 3]) is None
