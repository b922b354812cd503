"""specjax.models.tokenizer against transformers' tokenizer for the same GGUF file."""
import json
import os
import pathlib

import pytest

from specjax import specbench
from specjax.models import registry
from specjax.models import tokenizer as tk
from specjax.models.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

TRICKY = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "multiple     spaces   inside",
    "newlines\n\nand\r\nwindows\rline ends\n",
    "digits 1234567890 and 3.14159, a  1, x\n\n2, 10,000,000",
    "def f(x):\n\tif x:\n\t\treturn x  # tab\n\treturn None\n",
    "unicode: café naïve Zürich façade — “quotes” … ½ ² ٣",
    "emojis: 👍 👍🏽 👨‍👩‍👧‍👦 🦜🔥 ❤️",
    "CJK: 中文测试，日本語のテキスト、한국어 텍스트。一个",
    "Arabic مرحبا بالعالم and Hebrew שלום",
    "combining: e\u0301 a\u0308 zero\u200bwidth",
    "special tokens inline <|im_start|>user\nhi<|im_end|> and <|endoftext|>",
    "it's they're we've I'm you'll he'd DON'T",
    "<html><body class=\"x\">&amp;</body></html>",
    "\t\t\t",
    " ",
]


@pytest.fixture(scope="module")
def gguf_path():
    return registry.resolve("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tok(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path):
    """transformers' tokenizer for the same GGUF, loaded once (slow)."""
    transformers = pytest.importorskip("transformers")
    path = pathlib.Path(gguf_path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def prompts():
    questions = specbench.load()
    assert len(questions) == 480
    return [q.prompt for q in questions]


def _ref_chat(ref, messages, tokenize):
    kwargs = {"return_dict": False} if tokenize else {}
    return ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize, **kwargs)


# ----------------------------------------------------------------------------- GGUF parity

def test_special_ids_and_sizes(tok, ref):
    assert tok.vocab_size == len(ref) == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
    assert tok.bos_token_id == ref.bos_token_id
    assert tok.eos_token_id == ref.eos_token_id
    assert tok.pad_token_id == ref.pad_token_id
    assert tok.unk_token_id == ref.unk_token_id
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.stop_token_ids[0] == tok.eos_token_id and im_end in tok.stop_token_ids
    assert len(set(tok.stop_token_ids)) == len(tok.stop_token_ids)
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.add_bos_token is False and "<|im_start|>" in tok.chat_template


def test_pipeline_matches_transformers(tok, ref):
    """Same vocabulary, merges, pre-tokenizer, decoder and added tokens as transformers builds."""
    mine = json.loads(tok.backend.to_str())
    theirs = json.loads(ref.backend_tokenizer.to_str())
    assert mine["model"]["vocab"] == theirs["model"]["vocab"]
    assert mine["model"]["merges"] == theirs["model"]["merges"]
    assert mine["pre_tokenizer"] == theirs["pre_tokenizer"]
    assert mine["decoder"] == theirs["decoder"]
    assert mine["normalizer"] == theirs["normalizer"]
    key = lambda t: (t["id"], t["content"], t["special"], t["normalized"])  # noqa: E731
    assert sorted(map(key, mine["added_tokens"])) == sorted(map(key, theirs["added_tokens"]))


def test_encode_parity_all_specbench_prompts(tok, ref, prompts):
    mismatches = [i for i, p in enumerate(prompts) if tok.encode(p) != ref.encode(p)]
    assert mismatches == []
    assert tok.encode_batch(prompts[:20]) == [ref.encode(p) for p in prompts[:20]]


def test_chat_template_parity_all_specbench_prompts(tok, ref, prompts):
    bad_text, bad_ids = [], []
    for i, p in enumerate(prompts):
        messages = [{"role": "user", "content": p}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if text != _ref_chat(ref, messages, tokenize=False):
            bad_text.append(i)
        if tok.apply_chat_template(messages, add_generation_prompt=True) != _ref_chat(ref, messages, tokenize=True):
            bad_ids.append(i)
    assert bad_text == [] and bad_ids == []
    # The rendered prompt is what the template promises, ending in the assistant header.
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_token_id and ids.count(tok.token_to_id("<|im_end|>")) == 2


def test_chat_template_multi_turn_and_system(tok, ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    assert tok.apply_chat_template(messages, tokenize=False) == _ref_chat(ref, messages, tokenize=False)
    assert tok.apply_chat_template(messages) == _ref_chat(ref, messages, tokenize=True)
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == ref.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without.endswith("assistant\n")


@pytest.mark.parametrize("text", TRICKY)
def test_tricky_strings(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.decode(ids) == text == ref.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": text}]
    assert tok.apply_chat_template(messages, tokenize=False) == _ref_chat(ref, messages, tokenize=False)
    assert tok.apply_chat_template(messages) == _ref_chat(ref, messages, tokenize=True)


def test_special_tokens_in_text_and_skipping(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode(tok.encode("x <|endoftext|>"), skip_special_tokens=True) == "x "


def test_llama_cpp_compat_digit_split(gguf_path, tok):
    """llama.cpp's `smollm` pre-tokenizer cuts digits out before the GPT-2 split; transformers'
    GGUF loader does not. They differ on whitespace before a digit only."""
    cpp = Tokenizer.from_gguf(gguf_path, compat="llama.cpp")
    text = "hello  123"
    hf_tokens = [tok.id_to_token(i) for i in tok.encode(text)]
    cpp_tokens = [cpp.id_to_token(i) for i in cpp.encode(text)]
    assert hf_tokens == ["hello", "Ġ", "Ġ", "1", "2", "3"]
    assert cpp_tokens == ["hello", "ĠĠ", "1", "2", "3"]
    assert cpp.decode(cpp.encode(text)) == text
    assert cpp.encode("abc 123 de") == tok.encode("abc 123 de")
    with pytest.raises(ValueError, match="compat"):
        Tokenizer.from_gguf(gguf_path, compat="vllm")


# ----------------------------------------------------------------------------- tokenizer.json

def test_save_and_reload_matches_transformers(tok, prompts, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_config.json"}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tok.chat_template and config["eos_token"] == "<|im_end|>"

    mine = Tokenizer.from_tokenizer_json(tmp_path)
    same_file = Tokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for t in (mine, same_file):
        assert (t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id) == (1, 2, 2, 0)
        assert t.stop_token_ids == tok.stop_token_ids and t.chat_template == tok.chat_template
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 2, 0)
    assert len(hf) == mine.vocab_size == tok.vocab_size

    for text in [*prompts, *TRICKY]:
        ids = tok.encode(text)
        assert mine.encode(text) == ids, text
        assert hf.encode(text) == ids, text
        messages = [{"role": "user", "content": text}]
        rendered = mine.apply_chat_template(messages, tokenize=False)
        assert rendered == tok.apply_chat_template(messages, tokenize=False)
        assert rendered == _ref_chat(hf, messages, tokenize=False)
        assert mine.apply_chat_template(messages) == _ref_chat(hf, messages, tokenize=True)


def test_add_bos_eos_flags_survive_save(gguf_path, tmp_path):
    transformers = pytest.importorskip("transformers")
    meta = tk.read_gguf_tokenizer_metadata(gguf_path)
    meta["tokenizer.ggml.add_bos_token"] = True
    meta["tokenizer.ggml.add_eos_token"] = True
    t = Tokenizer.from_gguf_metadata(meta)
    plain = t.encode("hi there", add_special_tokens=False)
    assert t.encode("hi there") == [t.bos_token_id, *plain, t.eos_token_id]
    t.save(tmp_path)
    assert Tokenizer.from_tokenizer_json(tmp_path).encode("hi there") == t.encode("hi there")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode("hi there") == t.encode("hi there")
    # A chat template writes its own special tokens: no BOS/EOS is added on top.
    chat = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[-1] != t.eos_token_id and chat.count(t.bos_token_id) == 3


def test_tokenizer_config_variants(tok, tmp_path):
    """Special tokens given as AddedToken dicts, and a chat_template.jinja file (newer HF layout)."""
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": None,
              "chat_template": "ignored in favour of the .jinja file"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}")
    t = Tokenizer.from_tokenizer_json(tmp_path)
    assert t.eos_token_id == 2 and t.bos_token_id is None and t.pad_token_id is None
    assert t.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[user]x<|im_end|>"
    # tokenizer.json alone: ids work, no chat template.
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").unlink()
    bare = Tokenizer.from_tokenizer_json(tmp_path)
    assert bare.encode("hello world") == tok.encode("hello world")
    assert bare.eos_token_id is None and bare.stop_token_ids == (2,)  # <|im_end|> from the vocabulary
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_sandbox_and_helpers(tok):
    with pytest.raises(Exception, match="only user roles"):
        tok.apply_chat_template(
            [{"role": "bot", "content": "x"}],
            chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('only user roles') }}{% endif %}")
    # The sandbox refuses attribute access to Python internals.
    import jinja2.exceptions
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}],
                                chat_template="{{ messages.__class__.__mro__ }}", tokenize=False)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "é<b>"}], tokenize=False, tools=[{"name": "f"}],
        chat_template=("{{ messages[0] | tojson }}|{{ tools | tojson }}|{{ bos_token }}"
                       "{% generation %}G{% endgeneration %}{% for i in range(3) %}{% if i == 1 %}"
                       "{% break %}{% endif %}{{ i }}{% endfor %}"))
    assert rendered == '{"role": "user", "content": "é<b>"}|[{"name": "f"}]|<|im_start|>G0'
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])


# ----------------------------------------------------------------------------- streaming

def _stream(tok, ids, skip=False):
    dec = tok.incremental_decoder(skip_special_tokens=skip)
    pieces = [dec.add(i) for i in ids]
    pieces.append(dec.finish())
    return pieces, dec


def test_incremental_decoding_multibyte(tok, prompts):
    texts = [t for t in TRICKY if any(ord(c) > 127 for c in t)] + prompts[::8]
    assert any(any(ord(c) > 0xFFFF for c in t) for t in texts)
    naive_would_break = 0
    for text in texts:
        ids = tok.encode(text)
        naive_would_break += any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
        for skip in (False, True):
            pieces, _ = _stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in p for p in pieces), text
    assert naive_would_break >= 3  # the test does exercise characters split across tokens


def test_incremental_decoding_chat_and_batches(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Grüße 🌍 中文"}]) + tok.encode("答え: 👍🏽!")
    dec = IncrementalDecoder(tok, skip_special_tokens=True)
    out = dec.add(ids[:5]) + dec.add(ids[5:7]) + dec.add(ids[7:]) + dec.finish()
    assert out == tok.decode(ids, skip_special_tokens=True)
    plain = IncrementalDecoder(tok)
    assert "".join([plain.add(ids), plain.finish()]) == tok.decode(ids)
    assert dec.finish() == ""  # finished once already
    with pytest.raises(RuntimeError):
        dec.add(1)


def test_incremental_decoding_truncated_character(tok):
    """An incomplete character at the very end is held back, then flushed as a full decode has it."""
    ids = tok.encode("ok 🦜")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    pieces, _ = _stream(tok, ids[:cut])
    assert "".join(pieces) == tok.decode(ids[:cut])
    assert "\ufffd" not in "".join(pieces[:-1]) and pieces[-1].endswith("\ufffd")


def _byte_fallback_tokenizer():
    """A sentencepiece-style tokenizer: ids 2..7 are ``▁ h i ▁h ▁hi x``, id 8 + b is byte b."""
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers
    vocab = {"<unk>": 0, "<s>": 1, "▁": 2, "h": 3, "i": 4, "▁h": 5, "▁hi": 6, "x": 7}
    vocab.update({f"<0x{b:02X}>": 8 + b for b in range(256)})
    backend = Backend(models.BPE(vocab, [("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(backend, unk_token="<unk>")


def test_incremental_decoding_byte_fallback():
    """A non-byte-level (sentencepiece-style, byte-fallback) tokenizer streams as well."""
    t = _byte_fallback_tokenizer()
    text = "hi 中文 hi x🦜x é"
    ids = t.encode(text)
    assert t.decode(ids) == text and len(ids) > 15
    pieces, _ = _stream(t, ids)
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert "" in pieces[:-1]  # multi-byte characters were held back


def test_incremental_decoding_goes_on_after_an_invalid_byte_run():
    """Under a byte-fallback decoder an invalid byte turns the whole byte run, valid bytes already
    emitted included, into U+FFFD; ``DecodeStream`` raises on that ("Invalid prefix"). The
    decoder keeps what it emitted and goes on: no exception, and no text dropped at the end."""
    t = _byte_fallback_tokenizer()
    x, a, bad, hi = 7, 8 + ord("A"), 8 + 0xA6, 6     # 0xA6 alone is not UTF-8
    ids = [x, a, bad, hi, x]
    assert t.decode(ids) == "x\ufffd\ufffd hix"
    pieces, _ = _stream(t, ids)
    assert pieces[:2] == ["x", "A"] and "".join(pieces) == "xA\ufffd hix"
    pieces, _ = _stream(t, ids[:3])                   # the bad byte is the last id
    assert "".join(pieces) == "xA\ufffd"


# ----------------------------------------------------------------------------- errors and loading

def test_unsupported_gguf_model_is_a_clear_error():
    for model in ("llama", "t5", "bert"):
        with pytest.raises(ValueError, match=repr(model)):
            tk.check_gguf_tokenizer_model({"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a"]})
        with pytest.raises(ValueError, match=repr(model)):
            Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        tk.check_gguf_tokenizer_model({})
    with pytest.raises(ValueError, match="merges"):
        tk.check_gguf_tokenizer_model({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
    assert tk.check_gguf_tokenizer_model(
        {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
         "tokenizer.ggml.merges": ["a b"]}) == "gpt2"


def test_unsupported_model_in_a_real_gguf_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "▁a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'llama'"):
        Tokenizer.from_gguf(path)
    with pytest.raises(ValueError, match="'llama'"):
        load_tokenizer(path)


def test_tiny_gguf_metadata_builds(tmp_path):
    """User-defined tokens stay whole; a control token spelled outside the byte alphabet is skipped."""
    alphabet = tk.byte_level_alphabet()
    assert len(set(alphabet)) == 256 and alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"
    tokens = ["<eos>", "a", "b", "Ġ", "ab", "Ġab", "<think>", "bad control", *(c for c in alphabet if c not in "abĠ")]
    types = [3, 1, 1, 1, 1, 1, 4, 3] + [1] * (len(tokens) - 8)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["a b", "Ġ ab"],
            "tokenizer.ggml.eos_token_id": 0}
    t = Tokenizer.from_gguf_metadata(meta)
    assert t.vocab_size == len(tokens) and t.eos_token_id == 0
    assert t.encode("ab ab<think>b<eos>") == [4, 5, 6, 2, 0]
    assert t.special_token_ids == frozenset({0})
    assert t.decode([4, 5, 6, 2, 0], skip_special_tokens=True) == "ab ab<think>b"


def test_missing_tokenizer_json_and_load_tokenizer(tmp_path, gguf_path, tok):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_tokenizer_json(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="not-a-model"):
        load_tokenizer("not-a-model")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    tok.save(tmp_path / "ckpt")
    from_dir = load_tokenizer(tmp_path / "ckpt")
    assert from_dir.encode("héllo 12") == tok.encode("héllo 12")
    assert load_tokenizer(os.fspath(gguf_path)).encode("héllo 12") == tok.encode("héllo 12")
    by_name = load_tokenizer("smollm2-135m-instruct")
    assert by_name.encode("héllo 12") == tok.encode("héllo 12") and by_name.stop_token_ids == tok.stop_token_ids
    text = (tmp_path / "ckpt" / "tokenizer.json").read_text(encoding="utf-8")
    (tmp_path / "ckpt" / "tokenizer.json").write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(ValueError, match=r"ckpt/tokenizer\.json \(truncated or corrupt\?\)"):
        load_tokenizer(tmp_path / "ckpt")
