"""Rotary embedding parameters of a Hugging Face config.json, in either layout transformers writes.

transformers 4 writes `rope_theta` and `rope_scaling` at the top level:
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}}
transformers 5 writes one `rope_parameters` dict holding both, `rope_type` always set:
    {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, ..., "rope_theta": 500000.0}}
and reads the old layout too, letting a non-empty `rope_scaling` replace `rope_parameters` whole.
We read what transformers 5 reads, and refuse a config whose two layouts disagree: which one its
author meant is unknowable, and either guess generates different tokens without a word.
"""

from __future__ import annotations

from typing import Any

from pdserve.layers.rope_scaling import SUPPORTED_ROPE_TYPES, RopeScaling

DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names none


def read_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) of a config in the transformers 4 or 5 layout, as transformers 5 reads it."""
    legacy = cfg.get("rope_scaling") or {}
    params = cfg.get("rope_parameters") or {}
    for name, raw in (("rope_scaling", legacy), ("rope_parameters", params)):
        if not isinstance(raw, dict):
            raise ValueError(f"config.json {name} must be an object, got {raw!r}")
    _refuse_per_layer_type(params, cfg)
    effective = legacy or params  # transformers 5: rope_scaling, when given, wins
    theta = float(effective.get("rope_theta") or cfg.get("rope_theta") or DEFAULT_ROPE_THETA)
    scaling = _scaling(effective, cfg)
    if legacy and params:
        ignored_theta = params.get("rope_theta")
        if _scaling(params, cfg) != scaling or (ignored_theta is not None and float(ignored_theta) != theta):
            raise ValueError(
                f"config.json sets both rope_scaling {legacy} and rope_parameters {params}, and they "
                "disagree; keep one (transformers 5 writes rope_parameters, with rope_theta inside)"
            )
    top_theta = cfg.get("rope_theta")
    if top_theta is not None and float(top_theta) != theta:
        raise ValueError(
            f"config.json sets rope_theta {top_theta} at the top level and {theta} in "
            f"{'rope_scaling' if legacy else 'rope_parameters'}; keep one"
        )
    return theta, scaling


def read_local_and_global_rope(cfg: dict[str, Any], default_global: float,
                               default_local: float) -> tuple[float, RopeScaling, float]:
    """(theta, scaling, local theta) of a model whose sliding layers rotate by a base of their own,
    unscaled (Gemma 3), as transformers 5 reads it: `rope_parameters` nested by layer type
    ({"full_attention": {...}, "sliding_attention": {...}}), or transformers 4's `rope_theta`,
    `rope_scaling` (the global layers') and `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json rope_parameters must be an object, got {params!r}")
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full = {"rope_theta": cfg.get("rope_theta", default_global), **(cfg.get("rope_scaling") or params)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", default_local)}
    for name, raw in (("full_attention", full), ("sliding_attention", local)):
        if not isinstance(raw, dict):
            raise ValueError(f"config.json rope parameters of {name} layers must be an object, got {raw!r}")
    if _scaling(local, cfg) != RopeScaling():
        raise ValueError(f"config.json scales the sliding layers' rotary embedding ({local}); pdserve scales "
                         "only the global layers'")
    return (float(full.get("rope_theta", default_global)), _scaling(full, cfg),
            float(local.get("rope_theta", default_local)))


def _refuse_per_layer_type(params: dict[str, Any], cfg: dict[str, Any]) -> None:
    # transformers 5 nests rope_parameters under layer type names when layers rotate differently
    # (e.g. {"full_attention": {...}, "sliding_attention": {...}}); we apply one rotary table to all.
    layer_types = set(cfg.get("layer_types") or ())
    nested = [key for key, value in params.items() if isinstance(value, dict) or key in layer_types]
    if nested:
        raise ValueError(
            f"config.json sets rope_parameters per layer type ({', '.join(nested)}); pdserve applies "
            "one rotary embedding to every layer and cannot serve this model"
        )


def _scaling(raw: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    kind = raw.get("rope_type") or raw.get("type") or "default"
    partial = raw.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; pdserve rotates the whole head")
    try:
        if kind == "default":
            return RopeScaling()
        if kind == "linear":
            return RopeScaling(kind="linear", factor=float(raw["factor"]))
        if kind == "llama3":
            return RopeScaling(
                kind="llama3",
                factor=float(raw["factor"]),
                low_freq_factor=float(raw["low_freq_factor"]),
                high_freq_factor=float(raw["high_freq_factor"]),
                original_max_position_embeddings=_llama3_original_length(raw, cfg),
            )
    except KeyError as e:
        raise ValueError(f"rope type {kind!r} needs {e.args[0]!r}, which config.json does not set") from None
    raise ValueError(f"unsupported rope type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_original_length(raw: dict[str, Any], cfg: dict[str, Any]) -> int:
    if "original_max_position_embeddings" in raw:
        return int(raw["original_max_position_embeddings"])
    # transformers 5 falls back to max_position_embeddings and ignores a top-level value (Phi-3
    # style) for these architectures: with one there, the author surely meant it, so refuse.
    if "original_max_position_embeddings" in cfg:
        raise ValueError(
            "config.json sets original_max_position_embeddings at the top level, not in the llama3 "
            "rope parameters where transformers reads it; move it there"
        )
    return int(cfg["max_position_embeddings"])
