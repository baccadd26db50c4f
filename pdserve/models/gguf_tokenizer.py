"""Rebuild a `tokenizers` tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

From the vocabulary, merges (or scores) and token types, with the pre-tokenizer the file's
`tokenizer.ggml.pre` names. Where transformers does not know that name (SmolLM2's "smollm") it
falls back to GPT-2's split; we split as llama.cpp and the original model do. A sentencepiece
vocabulary without merges gets them from its scores (`spm_merges`); Gemma 3's tokenizes as
llama.cpp's does, token for token (tests/models/test_gguf_tokenizer.py).

Limits: with `add_space_prefix` (Llama 2-style files) the prefix space follows transformers
(`Metaspace`, once, not before a text that starts with a space), while llama.cpp puts one before
every stretch of text, after each special or user-defined token too.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from pdserve.models.spm_merges import sentencepiece_merges
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# tokenizer_config.json name -> `tokenizer.ggml.{key}_token_id`.
_SPECIAL_TOKEN_KEYS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
# llama.cpp token types (`tokenizer.ggml.token_type`).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# How each `tokenizer.ggml.pre` splits text before byte-level BPE, as llama.cpp does it. Names not
# listed (and "default", "gpt-2") use GPT-2's split, which `ByteLevel(use_regex=True)` applies itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}
# These isolate every digit first, then split the rest the GPT-2 way.
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_SPLIT = {"default", "gpt-2", "gpt2"}



def build_gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    ids = {name: meta.get(f"tokenizer.ggml.{key}_token_id") for name, key in _SPECIAL_TOKEN_KEYS.items()}
    special = {name: tokens[i] if i is not None and i < len(tokens) else None for name, i in ids.items()}
    if kind == "gpt2":
        backend, vocab = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre", "default"))
        add_bos_default = False
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        backend, vocab = _sentencepiece_bpe(tokens, scores, merges, special["unk_token"], add_prefix)
        add_bos_default = True  # llama.cpp adds BOS to sentencepiece vocabularies unless told not to
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    _add_special_tokens(backend, vocab, tokens, types, {t for t in special.values() if t is not None})

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = special["bos_token"] if add_bos else None, special["eos_token"] if add_eos else None
    backend.post_processor = _post_processor(backend, bos, eos)
    config: dict[str, Any] = {
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return Tokenizer(backend, config)


def _add_special_tokens(backend: _HFTokenizer, vocab: dict[str, int], tokens: list[str], types: list[int],
                        named: set[str]) -> None:
    # Control tokens (and the named ones: bos, eos, ...) match whole and are skipped on decode.
    # Byte-level vocabularies respell a token with characters outside the byte alphabet, so its
    # plain form is not in the vocabulary: llama.cpp mislabelled it, and no text can reach it.
    special = [t for t, ty in zip(tokens, types) if (ty in (_CONTROL, _UNKNOWN) or t in named) and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
    # User-defined tokens (like `<think>`) also match whole in llama.cpp, but are ordinary text.
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in dict.fromkeys(user)])


def _byte_level_bpe(
    tokens: list[str], merges: list[tuple[str, ...]], pre: str
) -> tuple[_HFTokenizer, dict[str, int]]:
    # Byte-level vocabularies spell every byte as a printable character; a token written in plain
    # text (llama.cpp does that for some added tokens) is respelled so the BPE model can find it.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    backend = _HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's split
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_SPLIT:
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        if pre not in _GPT2_SPLIT:
            logger.warning("GGUF pre-tokenizer %r is unknown; splitting text the GPT-2 way", pre)
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], merges: list[tuple[str, ...]], unk: str | None, add_prefix: bool
) -> tuple[_HFTokenizer, dict[str, int]]:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = merges or sentencepiece_merges(tokens, scores, vocab)
    backend = _HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # A space goes in front of the text, and every space becomes "▁", as sentencepiece does.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return backend, vocab


def _post_processor(backend: _HFTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    single = (f"{bos}:0 " if bos else "") + "$A:0" + (f" {eos}:0" if eos else "")
    pair = single + (f" {bos}:1" if bos else "") + " $B:1" + (f" {eos}:1" if eos else "")
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte alphabet: printable bytes stand for themselves, the rest move up past U+00FF.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    spelling = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + extra)
    return spelling
