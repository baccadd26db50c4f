"""A GGUF sentencepiece vocabulary tokenizes as llama.cpp does, and its text streams as it decodes.

The reference is tests/models/data/gemma-3-270m_llama_cpp_tokens.json: what llama.cpp's server
answered for 303 texts and 14 byte-fallback runs with Gemma 3's vocabulary (recorded by
scripts/llama_cpp_tokens.py; llama.cpp is not needed here, the Gemma file is). The merges cache and
byte-run decoding are also checked on a small vocabulary built here, which needs nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.models import spm_merges
from pdserve.models.gguf_file import GgufFile
from pdserve.models.gguf_tokenizer import build_gguf_tokenizer
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

LLAMA_CPP = Path(__file__).parent / "data" / "gemma-3-270m_llama_cpp_tokens.json"
_BYTE, _NORMAL, _CONTROL, _USER_DEFINED = 6, 1, 3, 4


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip_special: bool = False) -> str:
    """The text a request streams for `ids` after `prompt`, one token at a time."""
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip_special))
    text = ""
    for token_id in ids:
        detok.add(token_id)
        text += detok.take_delta(finished=False)
    detok.flush()
    return text + detok.take_delta(finished=True)


# ---- Gemma 3 against llama.cpp ----


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(LLAMA_CPP.read_text())


@pytest.fixture(scope="module")
def gemma(gemma_gguf: Path, tmp_path_factory) -> Tokenizer:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        with GgufFile(gemma_gguf) as f:
            return build_gguf_tokenizer(f.metadata)


def test_gemma_tokenizes_as_llama_cpp(gemma, reference):
    texts = [c for c in reference["cases"] if "text" in c]
    assert len(texts) == reference["n_texts"] == 303
    for case in texts:
        ids = gemma.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert ids[0] == gemma.bos_token_id == 2
        assert gemma.encode(case["text"], add_special_tokens=False) == ids[1:], case["text"]
        assert gemma.decode(ids) == case["detokenized"], case["text"]


def test_gemma_decodes_byte_runs_as_llama_cpp(gemma, reference):
    # Runs of byte-fallback tokens, some of them not valid UTF-8 ("\xbd" then 🫎 is "\ufffd🫎").
    runs = [c for c in reference["cases"] if "text" not in c]
    assert len(runs) == 14
    for case in runs:
        assert gemma.decode(case["ids"]) == case["detokenized"], case["ids"]


def test_gemma_streams_what_it_decodes(gemma, reference):
    """Streamed token by token after prompts ending in whole characters, in a cut one (ids can),
    and whose last tokens start inside one, every text comes out as its tokens decode alone."""
    bos, moose = gemma.bos_token_id, gemma.encode("🫎🫎", add_special_tokens=False)
    assert len(moose) == 8  # byte fallback: four tokens a character
    prompts = [[bos], [bos, *moose], [bos, *moose[:6]], gemma.encode("<start_of_turn>user\nhi")]
    for case in reference["cases"]:
        ids = case["ids"][1:] if "text" in case else case["ids"]
        for prompt in prompts:
            for skip in (False, True):
                assert _stream(gemma, prompt, ids, skip) == gemma.decode(ids, skip), (prompt, ids, skip)


def test_gemma_tokenizer_builds_fast_from_the_cache(gemma_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with GgufFile(gemma_gguf) as f:
        meta = f.metadata
    t0 = time.perf_counter()
    first = build_gguf_tokenizer(meta)
    t1 = time.perf_counter()
    second = build_gguf_tokenizer(meta)
    t2 = time.perf_counter()
    assert len(list((tmp_path / "pdserve" / "tokenizers").iterdir())) == 1
    assert second.encode("Hello  world 🫎") == first.encode("Hello  world 🫎")
    print(f"Gemma 3 tokenizer: {t1 - t0:.2f}s first, {t2 - t1:.2f}s from the merges cache")


# ---- a small sentencepiece vocabulary: merges cache, byte runs ----

_WORDS = "the quick brown fox jumps over lazy dog hello world".split()


def _small_meta() -> dict:
    pieces: dict[str, None] = {}
    for word in _WORDS:
        text = "▁" + word
        for size in range(1, 6):
            for start in range(len(text) - size + 1):
                pieces.setdefault(text[start : start + size])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<think>", *pieces]
    types = [_CONTROL, _CONTROL, _CONTROL, *[_BYTE] * 256, _USER_DEFINED, *[_NORMAL] * len(pieces)]
    scores = [0.0] * 260 + [float(len(p)) - i * 1e-4 for i, p in enumerate(pieces)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": False}


def _merges_by_hand(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    # The ranking spm_merges describes, written plainly: every split into two known tokens, by the
    # made token's score, then the longer left part, the longer right part, the earlier token.
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = [(-scores[i], -len(t[:k]), -len(t[k:]), i, (t[:k], t[k:]))
              for i, t in enumerate(tokens) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
    return [pair for *_, pair in sorted(ranked)]


def test_merges_are_cached_per_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    meta = _small_meta()
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    expected = _merges_by_hand(tokens, scores)
    assert spm_merges.sentencepiece_merges(tokens, scores, vocab) == expected
    (entry,) = (tmp_path / "pdserve" / "tokenizers").iterdir()

    def no_splitting(*args):
        raise AssertionError("derived again instead of read from the cache")

    monkeypatch.setattr(spm_merges, "_splits", no_splitting)
    assert spm_merges.sentencepiece_merges(tokens, scores, vocab) == expected
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    other = [s + 1.0 if i == 300 else s for i, s in enumerate(scores)]  # another vocabulary: its own entry
    spm_merges.sentencepiece_merges(tokens, other, vocab)
    assert len(list(entry.parent.iterdir())) == 2

    entry.write_bytes(b"\x93NUMPY garbage")  # damaged: derived again and rewritten
    assert spm_merges.sentencepiece_merges(tokens, scores, vocab) == expected
    assert spm_merges._load(entry, len(tokens)) is not None


def test_merges_without_a_writable_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache root's parent should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    meta = _small_meta()
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    merges = spm_merges.sentencepiece_merges(tokens, scores, {t: i for i, t in enumerate(tokens)})
    assert merges == _merges_by_hand(tokens, scores)


@pytest.mark.parametrize("raw, text", [
    (b"\xe4\xbd\xa0", "你"),
    (b"\xbd\xf0\x9f\xab\x8e", "\ufffd🫎"),  # tokenizers alone: five U+FFFD
    (b"\xf0\x9f\xab", "\ufffd"),
    (b"\xe4\xbd\xa0\xbd", "你\ufffd"),
    (b"\xef\xbf\xbd\xbd", "\ufffd\ufffd"),  # a real U+FFFD, then a stray byte
    (b"\xc0\x80", "\ufffd\ufffd"),
])
def test_byte_runs_decode_as_utf8(tmp_path, monkeypatch, raw, text):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tok = build_gguf_tokenizer(_small_meta())
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in raw]
    hello = tok.encode("hello", add_special_tokens=False)
    assert tok.decode(byte_ids) == text
    assert tok.decode([*hello, *byte_ids, *hello]) == f"hello{text}hello"
    # A special token skipped between two halves joins them, as the decoder sees them joined.
    eos = tok.token_to_id("</s>")
    assert tok.decode([*byte_ids[:1], eos, *byte_ids[1:]], skip_special_tokens=True) == text
    assert _stream(tok, [1], [*byte_ids, *hello]) == f"{text}hello"


def test_a_prompt_cut_inside_a_character_streams_the_new_bytes_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tok = build_gguf_tokenizer(_small_meta())
    moose = [tok.token_to_id(f"<0x{b:02X}>") for b in "🫎".encode()]
    hello = tok.encode("hello", add_special_tokens=False)
    # The prompt holds the first two bytes; the two generated ones are not a character alone.
    assert _stream(tok, [1, *moose[:2]], [*moose[2:], *hello]) == "\ufffd\ufffdhello"
    # Whole characters in the prompt: the new one comes out whole, though its bytes join theirs.
    assert _stream(tok, [1, *moose, *moose], [*moose, *hello]) == "🫎hello"
