"""Record how llama.cpp tokenizes a varied set of texts with a GGUF model's vocabulary: the
reference `tests/models/test_gguf_tokenizer.py` checks our tokenizer against, without llama.cpp.

    llama-server -m gemma-3-270m-q4_k_m.gguf --host 127.0.0.1 --port 8190 -t 1 &
    .venv/bin/python scripts/llama_cpp_tokens.py http://127.0.0.1:8190 \\
        tests/models/data/gemma-3-270m_llama_cpp_tokens.json

For each text it asks the server's POST /tokenize (special tokens added, and special-token strings
in the text parsed as the tokens, as llama.cpp's server always does) and POST /detokenize of those
ids; then /detokenize of byte-fallback runs, some not valid UTF-8. It writes {"model", "n_texts",
"cases": [{"text", "ids", "detokenized"}, ..., {"ids", "detokenized"}, ...]}. Seeded: the same
server gives the same file.
"""

from __future__ import annotations

import json
import random
import sys
import urllib.request
from pathlib import Path

# Whole texts, each aimed at one behaviour: byte fallback, whitespace runs (Gemma's vocabulary has
# user-defined tokens for runs of up to 31 spaces, tabs and newlines), special-token strings.
HAND = [
    "", " ", "  ", "a", "Hello world", " Hello world", "Hello world ", "Hello  world", "hello\nworld",
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times; "
    "it was the age of wisdom, it was the age of foolishness.",
    "Once upon a time, in a land far, far away, there lived a king who had three daughters.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n",
    "class Stack:\n\tdef __init__(self):\n\t\tself.items = []\n\n\tdef push(self, x):\n\t\tself.items.append(x)\n",
    "int main(void) {\n  printf(\"%d\\n\", 42);\n  return 0;\n}\n",
    "for (let i = 0; i < n; i++) {\n        sum += a[i] * b[i];\n}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"a\"><p>hi</p></div>", "<table><tr><td>1</td></tr></table>", "<h1>Title</h1>", "<b>bold</b>",
    "{\"key\": [1, 2, 3], \"nested\": {\"x\": null}}", "x = [1,2,3]\ny = {'a': 1}",
    "a" + " " * 31 + "b", "a" + " " * 32 + "b", " " * 70, "\t" * 40, "\n" * 40, "x\n\n\n\ny", "\r\n\r\n", " \r\n ",
    "  12", "\n\n  7", "a   123 456", "12345678901234567890", "3.14159", "1,000,000", "2024-01-31", "0x1F 0b101",
    "version 1.2.3", "!!!???...", "---===+++", "...", "?!", "((()))", "[[{{<<>>}}]]", "@#$%^&*", "~~~```",
    "naïve café résumé façade Ångström", "e\u0301", "Ünïcödé", "Straße", "ﬁ ligature", "Ⅻ ½ ² ٣",
    "你好，世界", "日本語のテキストです。", "한국어 텍스트", "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم",
    "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới",
    "😀", "🤖 robots 🤖", "👨‍👩‍👧‍👦", "🇺🇸🇯🇵", "❤️", "🚀🚀🚀", "🫠🪿🫎", "𓀀𓀁", "𠀀𠀁", "\ue000\uf8ff", "\U0010fffd",
    "\x00", "\x00\x01\x02", "\x07\x08\x1b[31mred\x1b[0m", "\x7f", "\x0b\x0c", "\u200b\u200c\u200d", "\ufeffBOM",
    "\u2028\u2029", "▁", "▁▁x", "<0x41>", "<0x0A>",
    "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn><end_of_turn>", "text<end_of_turn>text", " <start_of_turn> ", "<start_of_turn",
    "< start_of_turn>", "<<start_of_turn>>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "</s>", "<s>",
    "<unused0>", "<unused99>", "[multimodal]", "<start_of_image>", "<end_of_image>", "<bos><bos>hello",
    "x</s>y", "<b></b>", "<h1><h2>",
]
FRAGMENTS = [
    "Hello", "world", "The quick brown fox", "jumps over the lazy dog.", "I'm", "they'll", "DON'T", "it's",
    "3.14159", "1,000,000", "42", "007", "½", "你好，世界", "日本語", "Привет", "😀", "👍🏽", "naïve café",
    "def f(x):\n    return x ** 2", "\tindented", "    ", "\t\t", "\n\n\n", "  ", "<start_of_turn>",
    "<end_of_turn>", "<eos>", "</s>", "<table>", "**bold**", "#tag", "@user", "http://example.com/a?b=c",
    "¿Qué?", "¡Hola!", "«quotes»", "“smart”", "—dash—", "…", "\x01", "🫠", "𠀀",
]
SEPARATORS = ["", " ", "  ", "\n", "\t", " \n", "   ", "\n\n"]


def texts() -> list[str]:
    rng = random.Random(0)
    mixed = []
    for _ in range(200):
        parts = rng.sample(FRAGMENTS, rng.randint(1, 5))
        text = parts[0]
        for part in parts[1:]:
            text += rng.choice(SEPARATORS) + part
        mixed.append(text)
    return list(dict.fromkeys(HAND + FRAGMENTS + mixed))


# Byte sequences given as byte-fallback tokens, some of them not valid UTF-8: how llama.cpp turns
# them into text. None stands for the token of "Hello".
BYTE_RUNS = [
    [0xE4, 0xBD, 0xA0], [0xF0, 0x9F, 0xAB, 0x8E], [0xBD, 0xF0, 0x9F, 0xAB, 0x8E], [0xF0, 0x9F, 0xAB],
    [0xE4, 0xBD, 0xA0, 0xBD], [0xFF], [0xC0, 0x80], [0xED, 0xA0, 0x80], [0xF4, 0x90, 0x80, 0x80],
    [0xE4, 0xBD, None, 0xA0], [None, 0x9F, 0xAB, 0x8E, None], [0xF0, 0x9F, 0xAB, 0x8E, 0xF0, 0x9F],
    [0x41, 0x80, 0x42], [0xEF, 0xBF, 0xBD, 0xBD],
]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _byte_token_ids(server: str) -> list[int]:
    # llama.cpp's converter writes a sentencepiece vocabulary's <0x00>..<0xFF> in order.
    (first,) = _post(f"{server}/tokenize", {"content": "\x00", "add_special": False})["tokens"]
    ids = list(range(first, first + 256))
    ascii_text = _post(f"{server}/detokenize", {"tokens": ids[:128]})["content"]
    assert ascii_text == "".join(map(chr, range(128))), "the byte tokens are not <0x00>..<0xFF> in order"
    return ids


def main(server: str, out: Path) -> None:
    cases = []
    for text in texts():
        ids = _post(f"{server}/tokenize", {"content": text, "add_special": True})["tokens"]
        detokenized = _post(f"{server}/detokenize", {"tokens": ids})["content"]
        cases.append({"text": text, "ids": ids, "detokenized": detokenized})
    byte_ids = _byte_token_ids(server)
    (hello,) = _post(f"{server}/tokenize", {"content": "Hello", "add_special": False})["tokens"]
    byte_cases = []
    for run in BYTE_RUNS:
        ids = [hello if b is None else byte_ids[b] for b in run]
        byte_cases.append({"ids": ids, "detokenized": _post(f"{server}/detokenize", {"tokens": ids})["content"]})
    model = json.loads(urllib.request.urlopen(f"{server}/v1/models", timeout=30).read())["data"][0]["id"]
    # One case a line: a diff of a new recording shows which texts changed.
    lines = [json.dumps(c, ensure_ascii=False) for c in cases + byte_cases]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f'{{"model": {json.dumps(Path(model).name)}, "n_texts": {len(cases)}, "cases": [\n'
                   + ",\n".join(lines) + "\n]}\n")
    print(f"{len(cases)} texts and {len(byte_cases)} byte runs from {Path(model).name} -> {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1].rstrip("/"), Path(sys.argv[2]))
