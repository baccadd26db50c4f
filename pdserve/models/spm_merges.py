"""A sentencepiece vocabulary's scores as BPE merges, so that `tokenizers`' BPE model splits text
as llama.cpp's SPM tokenizer does; cached per vocabulary.

llama.cpp (`llm_tokenizer_spm_session`) starts from single characters and keeps joining the
adjacent pair whose joined text is the token of highest score, the leftmost first on a tie. BPE
joins the pair of lowest merge rank, the leftmost first on a tie. So every split of a token into two
tokens becomes a merge ranked by the token's score, and both pick the same pair at every step.
They can differ only where two overlapping pairs make different tokens of equal score: llama.cpp
takes the left one, BPE the one ranked first (longer left part first, then the earlier token).

Gemma 3's 262,144 tokens give 514,847 merges, 1 s of Python to find; they are kept under pdserve's
cache root as token-id pairs, named by a digest of the tokens and scores they came from.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import numpy as np

from pdserve.cache import cache_path

logger = logging.getLogger(__name__)

_FORMAT = 1  # part of the digest: a change to the ranking makes new entries, never reuses old ones


def sentencepiece_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges, best first. `vocab` maps each token to its id (the last one of a duplicate, as
    llama.cpp's lookup does)."""
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    score = np.asarray(scores, np.float64)
    path = cache_path("tokenizers", f"spm-merges-{_digest(tokens, lengths, score)}.npy")
    pairs = _load(path, len(tokens))
    if pairs is None:
        pairs = _rank(_splits(tokens, vocab), lengths, score)
        _save(path, pairs)
    text = np.empty(len(tokens), object)  # ids -> strings in bulk: a Python loop here costs 0.4 s
    text[:] = tokens
    return list(zip(text[pairs[:, 0]].tolist(), text[pairs[:, 1]].tolist()))


def _splits(tokens: list[str], vocab: dict[str, int]) -> np.ndarray:
    """[merges, 3] int32: (left id, right id, id of the token they make), every split of a token
    into two known tokens."""
    get = vocab.get
    found: list[int] = []
    add = found.extend
    for index, token in enumerate(tokens):
        if len(token) < 2 or vocab[token] != index:  # a duplicate counts once, as its last id
            continue
        for i in range(1, len(token)):
            left = get(token[:i])
            if left is not None and (right := get(token[i:])) is not None:
                add((left, right, index))
    return np.array(found, np.int32).reshape(-1, 3)


def _rank(splits: np.ndarray, lengths: np.ndarray, score: np.ndarray) -> np.ndarray:
    """[merges, 2] int32 (left id, right id), best first: the made token's score, then the longer
    left part, then the longer right part, then the earlier token (as transformers ranks them)."""
    left, right, made = splits[:, 0], splits[:, 1], splits[:, 2]
    order = np.lexsort((made, -lengths[right], -lengths[left], -score[made]))  # last key sorts first
    return np.ascontiguousarray(splits[order, :2])


def _digest(tokens: list[str], lengths: np.ndarray, score: np.ndarray) -> str:
    h = hashlib.sha256(f"spm-merges-{_FORMAT}".encode())
    h.update(lengths.tobytes())  # with the lengths, the joined text splits back one way only
    h.update("".join(tokens).encode("utf-8", "surrogatepass"))
    h.update(score.tobytes())
    return h.hexdigest()[:32]


def _load(path: Path, n_tokens: int) -> np.ndarray | None:
    try:
        pairs = np.load(path, allow_pickle=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        logger.warning("ignoring the damaged merges cache entry %s (%s)", path, e)
        return None
    if pairs.dtype != np.int32 or pairs.ndim != 2 or pairs.shape[1] != 2 or (
            pairs.size and not 0 <= pairs.min() <= pairs.max() < n_tokens):
        logger.warning("ignoring the damaged merges cache entry %s", path)
        return None
    return pairs


def _save(path: Path, pairs: np.ndarray) -> None:
    # Written aside and renamed: a reader never sees half a file, and racing writers write the same.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, pairs, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: every build derives the merges again
        logger.warning("cannot cache sentencepiece merges at %s: %s", path, e)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
