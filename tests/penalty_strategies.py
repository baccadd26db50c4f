"""The penalty and bias fields as both fuzz tests draw them (the router's edge and a worker's wire
take the same ones): name -> (valid values, hostile values)."""

from __future__ import annotations

from hypothesis import strategies as st


def penalty_fields(hostile: st.SearchStrategy) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    return {
        "frequency_penalty": (st.floats(-2, 2), st.one_of(st.floats(), hostile)),
        "presence_penalty": (st.floats(-2, 2), st.one_of(st.floats(), hostile)),
        "repetition_penalty": (st.floats(0.1, 10),
                               st.one_of(st.floats(max_value=0), st.floats(min_value=10.01), hostile)),
        "logit_bias": (st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=4),
                       st.one_of(st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 2**40).map(str)),
                                                 st.one_of(st.floats(), hostile), max_size=4), hostile)),
    }
