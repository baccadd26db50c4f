"""Structures an output must match (`sampling_params.Structure`: a JSON schema, a regular
expression, a choice of strings, a Lark grammar), as llguidance reads them. Shared by the router,
which refuses one that cannot be built before admitting its request (a 400 that names it), and
the engine, which masks each token by it (`engine/structured.py`). Neither torch nor the model:
the router's process loads neither."""

from __future__ import annotations

import json
import weakref

from pdserve.sampling_params import Structure
from pdserve.tokenizer import Tokenizer

# JSON as `json.dumps` lays it out: whitespace is where a model could loop (a small model greedily
# writing newlines after `{"ok": true` up to its length limit), so there is none elsewhere
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(structure: Structure) -> str:
    """llguidance's grammar for `structure`; ValueError for a choice that is not a list of strings."""
    from llguidance import LLMatcher

    if structure.kind == "json":
        return LLMatcher.grammar_from_json_schema(structure.spec, defaults=JSON_LAYOUT)
    if structure.kind == "regex":
        return LLMatcher.grammar_from_regex(structure.spec)
    if structure.kind == "choice":
        choices = json.loads(structure.spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise ValueError("a choice is a JSON list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    return LLMatcher.grammar_from_lark(structure.spec)


_ll_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> {(vocab, eos): built}


class Grammars:
    """One model's tokenizer as llguidance reads it (built on first use, ~0.3 s, once per tokenizer
    object: a standby worker builds it before its engine), and the matchers of structures over it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._ll_tokenizer = None

    def matcher(self, structure: Structure):
        """llguidance's matcher at the start of `structure`; ValueError that names the structure
        for one that cannot be built (bad syntax, an unsupported schema keyword, past llguidance's
        limits on a grammar's size)."""
        from llguidance import LLMatcher

        try:
            grammar = grammar_of(structure)
        except ValueError as e:
            raise ValueError(f"the {structure.kind} structure is not valid: {e}") from None
        m = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"the {structure.kind} structure is not valid: {m.get_error()}")
        return m

    def prepare(self) -> float:
        """Build the tokenizer as llguidance reads it now, not at the first structured request;
        returns the seconds it took (0 where it was built already)."""
        import time

        start = time.perf_counter()
        built = self._ll_tokenizer is not None
        self._tokenizer()
        return 0.0 if built else time.perf_counter() - start

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            from llguidance import LLTokenizer

            built = _ll_tokenizers.setdefault(self.tokenizer, {})
            key = (self.vocab_size, self.eos_token_ids)
            if key not in built:
                built[key] = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                         eos_token=list(self.eos_token_ids))
            self._ll_tokenizer = built[key]
        return self._ll_tokenizer
