"""Bad input, round 3 (issue 39, minor items): the scheduler's request ids and token ids, its
context error for a prompt that alone fills the context, and prompts whose text is not UTF-8
(the main command's prompt, a bench prompts file).

1. A request id outside [0, 2**32) (a request's key is ``fold_in(key, id)`` with a uint32 id)
   is one ValueError naming the id and the range, not an OverflowError from the key.
2. Token ids must be integers: 1.7 (and 2.0, and True) are refused naming the request and
   the first bad value, not truncated.
3. A prompt that alone fills the target's context is reported as too long (its length
   against the context), never with a suggestion of max_new_tokens <= 0.
4. Text with a byte that is not UTF-8 (a surrogate-escaped byte from argv, or a lone
   surrogate from a JSON escape) is one ValueError naming the setting and the byte offset.
5. A bench prompts file with a non-UTF-8 byte is a ValueError naming the file, the line and
   the byte offset.
"""
from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

from specjax import bench, decoding, models, sampling, serving

GREEDY = sampling.SamplingConfig.make(0.0)
KEY = jax.random.key(0)


@functools.lru_cache(maxsize=None)
def _engine(max_position: int = 16, max_new_tokens: int = 4):
    """A tiny random Llama target-only engine with a short context (nothing is compiled: the
    scheduler refuses bad requests before anything runs)."""
    cfg = models.ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=8, ffn_size=32, max_position=max_position)
    target = models.Llama(cfg)
    return decoding.Engine(target, None, decoding.GenerationConfig(max_new_tokens, gamma=0)), \
        decoding.EngineParams(target=target.init_params(jax.random.key(0)))


def _scheduler():
    engine, params = _engine()
    return serving.Scheduler(engine, params, slots=1, pad_multiple=8)


# ----------------------------------------------------------------------------- 1. request ids

@pytest.mark.parametrize("bad", [-1, 2 ** 32, 2 ** 40])
def test_item1_request_id_outside_uint32_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"request id {bad}\b.*\[0, 2\*\*32\)"):
        serving.Request(bad, [1, 2])
    with pytest.raises(ValueError, match=rf"request id {bad}\b.*\[0, 2\*\*32\)"):
        decoding.make_batch([[1, 2]], _engine()[0].config, KEY, request_ids=[bad])


@pytest.mark.parametrize("bad", [1.5, 2.0, True, "7"])
def test_item1_request_id_must_be_an_integer(bad):
    with pytest.raises(ValueError, match=rf"request id {re.escape(repr(bad))}"):
        serving.Request(bad, [1, 2])


def test_item1_request_ids_at_the_ends_of_the_range_are_served():
    out = _scheduler().run([serving.Request(0, [1, 2]), serving.Request(2 ** 32 - 1, [1, 2]),
                            serving.Request(np.int64(7), [3])], GREEDY, KEY, warmup=False)
    assert [r.id for r in out.results] == [0, 7, 2 ** 32 - 1]
    assert all(type(r.id) is int for r in out.results)


# ----------------------------------------------------------------------------- 2. token ids

@pytest.mark.parametrize("bad, position", [([1, 1.7, 3], 1), ([2.0], 0), ([1, 2, True], 2),
                                           (np.array([1.0, 2.0]), 0), ([1, [2]], 1)])
def test_item2_non_integer_token_ids_are_refused(bad, position):
    shown = re.escape(repr(list(bad)[position]))
    with pytest.raises(ValueError, match=rf"request 5: .*token ids must be integers.*{shown} at position {position}"):
        serving.Request(5, bad)


def test_item2_text_prompt_is_refused():
    with pytest.raises(ValueError, match="request 5: .*token ids.*text"):
        serving.Request(5, "hello")


def test_item2_integer_token_ids_of_any_integer_type_are_kept():
    r = serving.Request(5, np.array([1, 2, 3], np.int32))
    assert r.prompt == (1, 2, 3) and all(type(t) is int for t in r.prompt)
    assert serving.Request(6, [np.int64(4), 5]).prompt == (4, 5)


def test_item2_make_batch_and_generator_refuse_float_token_ids():
    engine, params = _engine()
    with pytest.raises(ValueError, match=r"prompt 1: token ids must be integers, got 1\.7 at position 0"):
        decoding.make_batch([[1, 2], [1.7]], engine.config, KEY)
    with pytest.raises(ValueError, match=r"token ids must be integers, got 2\.5 at position 1"):
        decoding.Generator(engine, params).encode([1, 2.5])
    assert decoding.Generator(engine, params).encode(np.array([1, 2])) == [1, 2]


# ----------------------------------------------------------------------------- 3. context

@pytest.mark.parametrize("length", [16, 17, 40])
def test_item3_prompt_that_fills_the_context_is_called_too_long(length):
    """The context is 16 positions: a prompt of 16 or more leaves no room for a new token."""
    requests = [serving.Request(1, [1, 2]), serving.Request(2, [1] * length)]
    with pytest.raises(ValueError) as e:
        _scheduler().run(requests, GREEDY, KEY, warmup=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert re.search(rf"request 2: its prompt is too long: {length} tokens, the target's context length is 16\b", msg), msg
    assert "<= 0" not in msg and "max_new_tokens <=" not in msg


def test_item3_prompt_that_leaves_room_still_suggests_a_positive_max_new_tokens():
    """15 tokens + max_new_tokens 4 > 16: the suggestion (max_new_tokens <= 1) is a valid one."""
    with pytest.raises(ValueError, match=r"request 2: .*max_new_tokens <= 1\b"):
        _scheduler().run([serving.Request(2, [1] * 15)], GREEDY, KEY, warmup=False)


# ----------------------------------------------------------------------------- 4. prompt text

class _Tok:
    """A stand-in for the tokenizer: byte-level ids, and a chat template around them."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] + [b for m in messages for b in m["content"].encode("utf-8")] + [2]


def _argv_text(raw: bytes) -> str:
    """What Python gives for a command-line argument of these bytes (surrogateescape)."""
    return raw.decode("utf-8", "surrogateescape")


@pytest.mark.parametrize("chat", [True, False])
def test_item4_prompt_with_a_non_utf8_byte_names_the_byte_offset(chat):
    text = _argv_text("héllo ".encode() + b"\xff world")       # 'héllo ' is 7 bytes
    with pytest.raises(ValueError, match=r"^prompt: byte 0xff at byte offset 7 is not UTF-8"):
        decoding.encode_prompt(_Tok(), text, chat=chat)
    with pytest.raises(ValueError, match=r"^system: byte 0xe9 at byte offset 0 is not UTF-8"):
        decoding.encode_prompt(_Tok(), "fine", system=_argv_text(b"\xe9t\xe9"))


def test_item4_lone_surrogate_from_a_json_escape_is_named():
    with pytest.raises(ValueError, match=r"^prompt: .*U\+D800 at byte offset 2"):
        decoding.encode_prompt(_Tok(), "ab\ud800c", chat=False)


def test_item4_real_tokenizer_gets_a_one_line_error_not_a_type_error():
    """The shipped tokenizer raised `TypeError: TextInputSequence must be str` (a traceback in
    the CLI): now a ValueError, which the CLI shows as one line."""
    tok = models.load_tokenizer("smollm2-135m-instruct")
    with pytest.raises(ValueError, match=r"byte 0xff at byte offset 3"):
        decoding.encode_prompt(tok, _argv_text(b"hi \xff"))
    assert decoding.encode_prompt(tok, "hi", chat=False) == list(tok.encode("hi"))


def test_item4_bench_prompt_with_a_lone_surrogate_names_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "bad \\udcff"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: .*U\+DCFF at byte offset 4"):
        bench.load_prompts(str(path))


# ----------------------------------------------------------------------------- 5. bench file

def test_item5_bench_prompts_file_with_a_non_utf8_byte_names_the_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "one"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError) as e:
        bench.load_prompts(str(path))
    assert type(e.value) is ValueError          # not a bare UnicodeDecodeError
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: byte 0xe9 at byte offset 33 is not UTF-8"), msg
    assert "\n" not in msg


def test_item5_utf8_prompts_file_still_loads(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "café", "category": "x"}\r\n\n{"turns": ["naïve"], "question_id": 9}\n',
                    encoding="utf-8")
    assert bench.load_prompts(str(path)) == [{"id": 1, "category": "x", "prompt": "café"},
                                             {"id": 9, "category": "all", "prompt": "naïve"}]


def test_item5_a_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path):
    """U+2028 / U+2029 / U+0085 are legal raw in a JSON string; str.splitlines split the line
    there ('not JSON (Unterminated string)')."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a\u2028b\u0085c"}\n{"prompt": "d"}', encoding="utf-8")
    assert [r["prompt"] for r in bench.load_prompts(str(path))] == ["a\u2028b\u0085c", "d"]
    assert [r["id"] for r in bench.load_prompts(str(path))] == [1, 2]


def test_item4_cli_prompt_with_a_non_utf8_byte_is_one_line_and_exit_2(tmp_path):
    """End to end: `specjax generate --config.prompt=<bytes>`. It was a `TypeError` traceback
    from the tokenizer once the model had loaded (exit 1); now one line naming the setting and
    the byte offset, exit 2, before anything loads: the target named here does not exist, and
    the prompt is still what is reported."""
    import os
    import subprocess
    import sys

    target = tmp_path / "no-such-model.gguf"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, "-c", "from specjax import cli; cli.run()", "generate", "--config=configs/generate.py",
            f"--config.target={target}", "--config.drafter=ngram", "--config.max_new_tokens=4",
            "--config.compilation_cache_dir=", "--config.calibration_cache=", b"--config.prompt=hi \xff there"]
    out = subprocess.run(args, cwd=repo, env=dict(os.environ, JAX_PLATFORMS=""), capture_output=True, timeout=300)
    stderr = out.stderr.decode("utf-8", "backslashreplace")
    assert out.returncode == 2, stderr
    assert "Traceback" not in stderr
    last = [ln for ln in stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("specjax: error: prompt: byte 0xff at byte offset 3 is not UTF-8"), last
