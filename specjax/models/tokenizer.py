"""Tokenizers for the target and draft models: byte-level BPE from a GGUF file or a ``tokenizer.json``.

The BPE itself is done by the ``tokenizers`` package; this module only assembles the pipeline
(vocabulary, merges, pre-tokenizer, decoder, special tokens) from the metadata a GGUF file carries,
renders chat templates with a sandboxed Jinja environment, and streams decoded text through
``tokenizers.decoders.DecodeStream``.

Compatibility: by default ``Tokenizer.from_gguf`` builds exactly the tokenizer that
``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)`` builds for the same file, so a
specjax run and a transformers reference see the same token ids. For ``tokenizer.ggml.pre`` values
such as ``smollm`` or ``starcoder`` llama.cpp (and the model's original ``tokenizer.json``) also cut
every digit into its own piece *before* the GPT-2 split; transformers' GGUF loader does not. The two
differ only on whitespace followed by a digit (``"a  1"``: transformers ``Ġ Ġ 1``, llama.cpp
``ĠĠ 1``). Pass ``compat="llama.cpp"`` for the llama.cpp behaviour.

``Tokenizer.save(directory)`` writes ``tokenizer.json`` (``tokenizers``' own format) and a short
``tokenizer_config.json`` (special tokens, BOS/EOS flags, chat template) so an exported checkpoint
directory loads with ``transformers.AutoTokenizer.from_pretrained(directory)``.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

__all__ = [
    "Tokenizer",
    "IncrementalDecoder",
    "load_tokenizer",
    "read_gguf_tokenizer_metadata",
    "gguf_tokenizer_metadata",
    "check_gguf_tokenizer_model",
    "byte_level_alphabet",
]

# llama.cpp token types (``tokenizer.ggml.token_type``).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

SUPPORTED_GGUF_MODELS = ("gpt2",)

# `tokenizer.ggml.pre` values whose split is the plain GPT-2 regex (what ByteLevel(use_regex=True)
# applies). For the ones in _DIGITS_FIRST llama.cpp cuts each digit out first.
_GPT2_SPLIT_PRES = frozenset({
    "default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "command-r", "codeshell",
    "exaone", "minerva", "olmo", "jais", "bloom", "gpt3-finnish", "poro-chat", "viking",
    "chatglm-bpe", "jais-2", "stablelm2", "mpt", "falcon",
})
_DIGITS_FIRST_PRES = frozenset({
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva",
})

# Split patterns of the two common non-GPT-2 families (applied before a regex-free ByteLevel).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_FAMILY_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_FAMILY_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe"), _LLAMA3_FAMILY_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo"), _QWEN2_FAMILY_SPLIT),
}

# End-of-turn markers that chat templates write after each message; generation must stop on them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")

_COMPAT_MODES = ("transformers", "llama.cpp")


# ----------------------------------------------------------------------------- byte-level helpers

@functools.lru_cache(maxsize=None)
def byte_level_alphabet() -> tuple[str, ...]:
    """The printable character GPT-2's byte-level BPE writes for each byte value 0..255.

    Bytes that are printable Latin-1 characters stand for themselves; the others (control
    characters, space, soft hyphen, ...) are moved, in byte order, to code points 256 and up.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_level_alphabet())}


def _byte_level_spelling(token: str) -> str:
    """A token as byte-level BPE spells it (already spelled tokens are returned unchanged)."""
    table = _char_to_byte()
    if all(c in table for c in token):
        return token
    alphabet = byte_level_alphabet()
    return "".join(alphabet[b] for b in token.encode("utf-8"))


# ----------------------------------------------------------------------------- GGUF metadata

def gguf_tokenizer_metadata(reader) -> dict[str, Any]:
    """The ``tokenizer.*`` fields (plus ``general.architecture``) of an open ``gguf.GGUFReader``."""
    return {key: field.contents() for key, field in reader.fields.items()
            if key.startswith("tokenizer.") or key == "general.architecture"}


def read_gguf_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """`gguf_tokenizer_metadata` of the GGUF file at ``path``.

    Parsing a GGUF is slow, so results are cached per (file, size, mtime); each call returns
    a fresh dict (whose list values are shared: do not mutate them in place).
    """
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = path.stat()
    return dict(_read_gguf_tokenizer_metadata(str(path.resolve()), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _read_gguf_tokenizer_metadata(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    import gguf  # imported lazily: only GGUF loading needs it

    return gguf_tokenizer_metadata(gguf.GGUFReader(path))


def check_gguf_tokenizer_model(metadata: Mapping[str, Any]) -> str:
    """Check that GGUF tokenizer metadata describes a byte-level BPE; returns the model type.

    Raises ValueError naming the model type otherwise (e.g. ``llama`` = sentencepiece, ``t5`` =
    unigram), or when vocabulary or merges are missing.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError("GGUF file has no tokenizer (metadata key 'tokenizer.ggml.model' is missing)")
    if model not in SUPPORTED_GGUF_MODELS:
        raise ValueError(
            f"unsupported GGUF tokenizer model {model!r}: specjax builds byte-level BPE tokenizers "
            f"only (tokenizer.ggml.model in {list(SUPPORTED_GGUF_MODELS)}). Export the model's "
            f"tokenizer.json and use Tokenizer.from_tokenizer_json instead.")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if not metadata.get(key):
            raise ValueError(f"GGUF tokenizer model {model!r} has no {key!r}: cannot build a BPE tokenizer")
    return model


def _pre_tokenizer_for(pre: str | None, compat: str) -> pre_tokenizers.PreTokenizer:
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre is not None and pre not in _GPT2_SPLIT_PRES:
        logger.warning("GGUF pre-tokenizer %r is not known to specjax; using the GPT-2 split "
                       "(as transformers does)", pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if compat == "llama.cpp" and pre in _DIGITS_FIRST_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _special_template(bos: str | None, eos: str | None, add_bos: bool, add_eos: bool,
                      token_to_id) -> processors.PostProcessor:
    """A TemplateProcessing that adds BOS/EOS as configured (nothing when neither is set)."""
    head = [bos] if add_bos and bos is not None else []
    tail = [eos] if add_eos and eos is not None else []
    single = [*head, "$A", *tail]
    pair = [*head, "$A", *tail, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)]
    specials = [(t, token_to_id(t)) for t in dict.fromkeys([*head, *tail])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# ----------------------------------------------------------------------------- chat templates

def _raise_exception(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_chat_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        """Accepts ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) as a no-op."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise TypeError(f"chat messages must be mappings with 'role' and 'content', got {m!r}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


# ----------------------------------------------------------------------------- the tokenizer

def _token_content(value) -> str | None:
    """A special token given as a string or as an HF AddedToken dict ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return value.get("content")
    return str(value)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus special tokens and a chat template.

    Build one with ``Tokenizer.from_gguf(path)`` or ``Tokenizer.from_tokenizer_json(path_or_dir)``
    (or ``load_tokenizer(name_or_path)``).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        name_or_path: str | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        self.name_or_path = name_or_path
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            tok = getattr(self, name)
            if tok is not None and backend.token_to_id(tok) is None:
                raise ValueError(f"{name} {tok!r} is not in the vocabulary")
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, *, compat: str = "transformers") -> "Tokenizer":
        """The tokenizer stored in a GGUF file's metadata (``tokenizer.ggml.model = gpt2`` only).

        ``compat="transformers"`` (default) matches ``AutoTokenizer.from_pretrained(dir,
        gguf_file=...)`` token for token; ``compat="llama.cpp"`` adds llama.cpp's individual-digit
        split for the ``pre`` types that have one (see the module docstring).
        """
        return cls.from_gguf_metadata(read_gguf_tokenizer_metadata(path), compat=compat,
                                      name_or_path=str(path))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, compat: str = "transformers",
                           name_or_path: str | None = None) -> "Tokenizer":
        """Like ``from_gguf``, from already-read metadata (keys as in the file: ``tokenizer.ggml.*``)."""
        if compat not in _COMPAT_MODES:
            raise ValueError(f"compat must be one of {_COMPAT_MODES}, got {compat!r}")
        check_gguf_tokenizer_model(metadata)
        tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
        if len(token_types) != len(tokens):
            raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")

        # Every token as byte-level BPE spells it; a file may store a few in plain text.
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(_byte_level_spelling(token), index)
        merges = []
        for line in metadata["tokenizer.ggml.merges"]:
            parts = str(line).split(" ")
            if len(parts) != 2:
                raise ValueError(f"malformed GGUF merge {line!r}: expected two tokens separated by a space")
            merges.append((parts[0], parts[1]))

        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer_for(metadata.get("tokenizer.ggml.pre"), compat)
        backend.decoder = decoders.ByteLevel()

        # Control tokens are matched whole in the text and are "special" (skippable on decode);
        # user-defined ones are matched whole but are ordinary text. A control token spelled
        # outside the byte alphabet is a mislabel and would get a new id past the vocabulary, so
        # it is left out (as transformers does).
        alphabet = _char_to_byte()
        control = [AddedToken(t, normalized=False, special=True)
                   for t, kind in zip(tokens, token_types)
                   if kind == TOKEN_TYPE_CONTROL and all(c in alphabet for c in t)]
        if control:
            backend.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, kind in zip(tokens, token_types)
                if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
        if user:
            backend.add_tokens(user)
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError(f"building the tokenizer changed the vocabulary size from {len(tokens)} "
                             f"to {backend.get_vocab_size(with_added_tokens=True)}")

        def special(key):
            index = metadata.get(f"tokenizer.ggml.{key}")
            if index is None:
                return None
            index = int(index)
            if not 0 <= index < len(tokens):
                raise ValueError(f"tokenizer.ggml.{key} = {index} is outside the vocabulary")
            return backend.id_to_token(index)

        bos, eos = special("bos_token_id"), special("eos_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _special_template(bos, eos, add_bos, add_eos, backend.token_to_id)
        return cls(
            backend,
            bos_token=bos, eos_token=eos,
            pad_token=special("padding_token_id"), unk_token=special("unknown_token_id"),
            chat_template=metadata.get("tokenizer.chat_template"),
            add_bos_token=add_bos, add_eos_token=add_eos,
            name_or_path=name_or_path,
        )

    @classmethod
    def from_tokenizer_json(cls, path_or_dir: str | os.PathLike) -> "Tokenizer":
        """A ``tokenizer.json`` (a file, or a checkpoint directory holding one).

        Next to it, an optional ``tokenizer_config.json`` gives the special tokens, the BOS/EOS
        flags and the chat template (a ``chat_template.jinja`` file, as newer transformers
        versions write, takes precedence); ``special_tokens_map.json`` is read as a fallback.
        """
        path = pathlib.Path(path_or_dir).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            where = f"in directory {path}" if path.is_dir() else f"at {file}"
            raise FileNotFoundError(f"no tokenizer.json found {where}")
        folder = file.parent
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:   # tokenizers raises a bare Exception that does not name the file
            raise ValueError(f"cannot read the tokenizer in {file} (truncated or corrupt?): {e}") from e

        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        specials: dict[str, Any] = {}
        if (folder / "special_tokens_map.json").is_file():
            specials = json.loads((folder / "special_tokens_map.json").read_text(encoding="utf-8"))

        def token(name):
            value = _token_content(config.get(name))
            if value is None:
                value = _token_content(specials.get(name))
            return value if value is not None and backend.token_to_id(value) is not None else None

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # the named-templates form: [{"name":..., "template":...}]
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default", next(iter(named.values()), None))
        if (folder / "chat_template.jinja").is_file():
            chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token=token("bos_token"), eos_token=token("eos_token"),
            pad_token=token("pad_token"), unk_token=token("unk_token"),
            chat_template=chat_template,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            name_or_path=str(folder),
        )

    # -- ids and sizes ------------------------------------------------------------------------

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the size of the model's embedding table)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: EOS, plus the end-of-turn marker the chat template writes
        (``<|im_end|>`` and friends) when the vocabulary has it. EOS first, no duplicates."""
        ids = [self.eos_token_id]
        for marker in END_OF_TURN_TOKENS:
            index = self.backend.token_to_id(marker)
            if index is not None and (self.chat_template is None or marker in self.chat_template):
                ids.append(index)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        return self.backend.id_to_token(int(index))

    def token_bytes(self) -> list[bytes | None]:
        """The bytes each id stands for in decoded text (byte-level BPE spelling undone), None
        for special tokens (they are not text). Token automata (`specjax.constraints`) read it."""
        table, out = _char_to_byte(), []
        for i in range(self.vocab_size):
            token = self.id_to_token(i)
            if token is None or i in self._special_ids or not all(c in table for c in token):
                out.append(None)
            else:
                out.append(bytes(table[c] for c in token))
        return out

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text (``<|im_start|>``) map to their
        ids; ``add_special_tokens`` adds BOS/EOS only where the tokenizer is configured to."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        *,
        chat_template: str | None = None,
        **template_kwargs,
    ) -> list[int] | str:
        """Render ``messages`` with the chat template; token ids if ``tokenize`` else the text.

        The template sees ``messages``, ``add_generation_prompt``, the special tokens
        (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) and ``template_kwargs``
        (e.g. ``tools``). Rendered text is encoded without adding BOS/EOS: the template writes
        whatever special tokens it wants.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError(f"tokenizer {self.name_or_path or ''} has no chat template; "
                             f"pass chat_template=... explicitly")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        variables = {name: getattr(self, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                     if getattr(self, name) is not None}
        variables.update(template_kwargs)
        variables["messages"] = _plain_messages(messages)
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        text = _compile_chat_template(source).render(**variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- export -------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> pathlib.Path:
        """Write ``tokenizer.json`` (``tokenizers.Tokenizer.save``) and ``tokenizer_config.json``
        (what tokenizer.json has no place for: special-token names, BOS/EOS flags, the chat
        template) to ``directory``, loadable by ``transformers.AutoTokenizer``."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "add_bos_token": self.add_bos_token,
                                  "add_eos_token": self.add_eos_token,
                                  "clean_up_tokenization_spaces": False}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if getattr(self, name) is not None:
                config[name] = getattr(self, name)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return directory

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, chat_template={'yes' if self.chat_template else 'no'})")


# ----------------------------------------------------------------------------- streaming

class IncrementalDecoder:
    """Text pieces for a growing sequence of ids, never splitting a UTF-8 character.

    A thin wrapper over ``tokenizers.decoders.DecodeStream``: ``add(ids)`` takes the *new* ids and
    returns the text they complete (``""`` while a character is still incomplete); ``finish()``
    returns what the stream still holds back (an incomplete character at the very end becomes
    U+FFFD, as a full decode makes it). The pieces joined equal
    ``tokenizer.decode(all_ids, skip_special_tokens)``, except where new ids change text already
    emitted: a byte-fallback decoder turns every byte of an invalid UTF-8 run into U+FFFD, the
    valid bytes before it included. ``DecodeStream`` raises on that; the stream then restarts
    after the text already emitted (which cannot be taken back) instead of failing.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []   # the ids of the last piece the stream emitted
        self._pending: list[int] = []   # ids the stream holds back
        self._finished = False

    def add(self, ids: int | Iterable[int]) -> str:
        if self._finished:
            raise RuntimeError("IncrementalDecoder.add after finish()")
        try:
            new = [int(i) for i in ids]
        except TypeError:  # a single id (int or numpy integer)
            new = [int(ids)]
        if not new:
            return ""
        self._pending.extend(new)
        try:
            piece = self._stream.step(self.tokenizer.backend, new)
        except Exception:   # tokenizers' "Invalid prefix encountered while decoding stream"
            self._stream = decoders.DecodeStream(skip_special_tokens=self.skip_special_tokens)
            self._context = []
            piece = self._stream.step(self.tokenizer.backend, self._pending)
        if piece is None:
            return ""
        self._context, self._pending = self._pending, []
        return piece

    def finish(self) -> str:
        """Flush: the held-back text, decoded after the last emitted piece as the stream would."""
        if self._finished:
            return ""
        self._finished = True
        if not self._pending:
            return ""
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=self.skip_special_tokens)
        context = decode(self._context)
        full = decode(self._context + self._pending)
        return full[len(context):] if full.startswith(context) else decode(self._pending)


# ----------------------------------------------------------------------------- loading by name

def load_tokenizer(name_or_path: str | os.PathLike | None = None, **kwargs) -> Tokenizer:
    """A tokenizer from a registry name, a ``.gguf`` file, a ``tokenizer.json`` file, or a
    directory holding ``tokenizer.json`` (or exactly one ``.gguf`` file). ``kwargs`` go to
    ``Tokenizer.from_gguf``."""
    from specjax.models import registry

    if name_or_path is None:
        name_or_path = registry.DEFAULT_MODEL
    if str(name_or_path) in registry.KNOWN:
        return Tokenizer.from_gguf(registry.resolve(str(name_or_path)), **kwargs)
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_tokenizer_json(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Tokenizer.from_gguf(ggufs[0], **kwargs)
        raise FileNotFoundError(
            f"no tokenizer.json in directory {path}"
            + (f" and {len(ggufs)} .gguf files (pass one of them)" if ggufs else ""))
    if path.is_file():
        if path.suffix == ".gguf":
            return Tokenizer.from_gguf(path, **kwargs)
        if path.suffix == ".json":
            return Tokenizer.from_tokenizer_json(path)
        raise ValueError(f"cannot tell how to load a tokenizer from {path}: expected a .gguf or "
                         f"tokenizer.json file, or a directory")
    raise FileNotFoundError(
        f"{str(name_or_path)!r} is neither an existing path nor a known model "
        f"(known: {', '.join(sorted(registry.KNOWN))})")
