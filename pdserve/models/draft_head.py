"""A draft head: one decoder layer on top of the served model that guesses its next tokens from
the model's own hidden states (`--speculative head:PATH`), in the two forms checkpoints ship:

- EAGLE (`fc.weight`, `layers.0.*`): `fc(cat(embed(next token), feature))`, the layer (EAGLE-1
  and -2 drop its input norm), its output the next feature, read by the model's head as it is
  (or after `norm.weight`, where the file has one). The feature is the model's last hidden state
  after its final norm.
- MTP, a multi-token-prediction module (`eh_proj.weight`, `enorm`, `hnorm`, the layer,
  `shared_head.norm`), as DeepSeek-V3's: `eh_proj(cat(enorm(embed), hnorm(feature)))`, the layer,
  the shared norm before the model's head. Its feature is the last hidden state before the
  final norm.

At position p the head takes the feature of position p and the token at p + 1, and gives a feature
for p + 1, whose logits guess the token at p + 2; chained on its own features it drafts several
tokens. Its layer's KV is one more layer of the model's paged cache, in the same blocks: a
prefix cache hit, or a prefill worker's transfer, brings it along with the model's.

Weights come from safetensors only (a pickled `.bin` file is refused: loading one runs code); the
embedding table and the head are the served model's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from pdserve.layers.attention import AttentionMetadata
from pdserve.layers.linear import embedding_rows, linear
from pdserve.layers.norm import RMSNorm
from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import read_safetensors
from pdserve.models.llama import LlamaDecoderLayer

STYLES = ("eagle", "mtp")


class DraftHead(nn.Module):
    def __init__(self, cfg: ArchConfig, style: str, layer_index: int, fc_bias: bool = False,
                 input_norm: bool = True, final_norm: bool = False) -> None:
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"a draft head is one of {', '.join(STYLES)}, not {style!r}")
        h = cfg.hidden_size
        self.style = style
        self.fc = nn.Parameter(torch.empty(h, 2 * h), requires_grad=False)
        self.fc_bias = nn.Parameter(torch.empty(h), requires_grad=False) if fc_bias else None
        self.enorm = RMSNorm(h, cfg.rms_norm_eps) if style == "mtp" else None
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps) if style == "mtp" else None
        self.layer = LlamaDecoderLayer(cfg, layer_index)
        if not input_norm:
            del self.layer.input_layernorm
            self.layer.input_layernorm = None
        self.norm = RMSNorm(h, cfg.rms_norm_eps) if final_norm or style == "mtp" else None
        self.name = ""  # what the head is (its file's digest): workers share its KV only where theirs agree

    @property
    def reads_final_norm(self) -> bool:
        """Whether its feature is the model's hidden state after the final norm (EAGLE), or before it (MTP)."""
        return self.style == "eagle"

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, embed: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The next feature of each row ([rows, hidden]): from its feature and the token after it,
        through the layer, whose KV goes to the rows' slots of `kv_cache` ([slots, 2, kv_heads,
        head_dim])."""
        kernels = meta.kernels
        e = embedding_rows(embed, next_ids, features.dtype).to(features.dtype)
        if self.style == "mtp":
            e, features = self.enorm(e, kernels), self.hnorm(features, kernels)
        x = linear(torch.cat([e, features], dim=-1), self.fc, self.fc_bias)
        layer = self.layer
        h = x if layer.input_layernorm is None else layer.input_layernorm(x, kernels)
        x, h = layer.post_attention_layernorm.add_and_norm(x.clone(), layer.self_attn(h, cos_sin, kv_cache, meta),
                                                           kernels)
        return x + layer.mlp(h, kernels)

    def logits_input(self, features: torch.Tensor) -> torch.Tensor:
        """What the model's head reads of a feature the head gave."""
        return features if self.norm is None else self.norm(features)


def load_draft_head(path: str | Path, cfg: ArchConfig, dtype: torch.dtype, device: torch.device) -> DraftHead:
    """The draft head in directory (or file) `path`, for a model of config `cfg`: its layer is the
    model's layer `cfg.num_layers` in the cache. ValueError for a file that is no head of this model."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if path.suffix == ".bin" or (path.is_dir() and not files and any(path.glob("*.bin"))):
        raise ValueError(f"{path}: a pickled .bin draft head is not loaded (loading one runs code); "
                         "convert it to safetensors")
    if not files:
        raise ValueError(f"{path} holds no *.safetensors draft head")
    tensors = read_safetensors(path) if path.is_dir() else read_safetensors(path.parent, [path.name])
    head_cfg = cfg
    config_file = (path if path.is_dir() else path.parent) / "config.json"
    if config_file.exists():
        own = json.loads(config_file.read_text())
        for key, ours in (("hidden_size", cfg.hidden_size), ("num_attention_heads", cfg.num_heads),
                          ("num_key_value_heads", cfg.num_kv_heads)):
            if key in own and own[key] != ours:
                raise ValueError(f"the draft head's {key} is {own[key]}, the model's {ours}: not a head of this model")
        if "intermediate_size" in own:
            head_cfg = _with_intermediate(cfg, int(own["intermediate_size"]))
    names = {k.removeprefix("model."): k for k in tensors}
    if "fc.weight" in names:
        style, prefix, block = "eagle", "", "layers.0."
    else:
        found = [k for k in names if k.endswith("eh_proj.weight")]
        if not found:
            raise ValueError(f"{path} is no draft head: neither EAGLE's fc.weight nor an MTP module's eh_proj.weight")
        style, prefix = "mtp", found[0].removesuffix("eh_proj.weight")
        block = prefix

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(names.get(name, ""))
        if t is None:
            raise ValueError(f"draft head {path} is missing tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ValueError(f"draft head tensor {name!r} has shape {tuple(t.shape)}, the model implies {shape}")
        return t.to(dtype=dtype, device=device, copy=True)

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, head_cfg.intermediate_size
    fc = "fc" if style == "eagle" else prefix + "eh_proj"
    head = DraftHead(head_cfg, style, cfg.num_layers, fc_bias=f"{fc}.bias" in names,
                     input_norm=f"{block}input_layernorm.weight" in names,
                     final_norm=style == "eagle" and "norm.weight" in names)
    params = {"fc": take(f"{fc}.weight", (h, 2 * h))}
    if head.fc_bias is not None:
        params["fc_bias"] = take(f"{fc}.bias", (h,))
    if style == "mtp":
        params["enorm.weight"] = take(prefix + "enorm.weight", (h,))
        params["hnorm.weight"] = take(prefix + "hnorm.weight", (h,))
        params["norm.weight"] = take(prefix + "shared_head.norm.weight", (h,))
    elif head.norm is not None:
        params["norm.weight"] = take("norm.weight", (h,))
    attn = block + "self_attn."
    params["layer.self_attn.qkv_proj"] = torch.cat([take(attn + "q_proj.weight", (q, h)),
                                                    take(attn + "k_proj.weight", (kv, h)),
                                                    take(attn + "v_proj.weight", (kv, h))])
    params["layer.self_attn.o_proj"] = take(attn + "o_proj.weight", (h, q))
    params["layer.mlp.gate_up_proj"] = torch.cat([take(block + "mlp.gate_proj.weight", (inter, h)),
                                                  take(block + "mlp.up_proj.weight", (inter, h))])
    params["layer.mlp.down_proj"] = take(block + "mlp.down_proj.weight", (h, inter))
    params["layer.post_attention_layernorm.weight"] = take(block + "post_attention_layernorm.weight", (h,))
    if head.layer.input_layernorm is not None:
        params["layer.input_layernorm.weight"] = take(block + "input_layernorm.weight", (h,))
    if cfg.qkv_bias or cfg.qk_norm:
        raise ValueError("draft heads for models with q/k/v biases or q/k norms are not supported yet")
    head.load_state_dict(params, strict=True, assign=True)
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(params[name].float().cpu().numpy().tobytes())
    head.name = f"{style}:{digest.hexdigest()[:16]}"
    return head.to(device).eval()


def save_random_draft_head(path: str | Path, cfg: ArchConfig, style: str = "eagle", seed: int = 0,
                           scale: float = 0.02) -> Path:
    """A draft head of random weights in `style`'s file layout, for a model of config `cfg`
    (tests, demos): its drafts are guesses, which verification makes harmless."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    block = "layers.0." if style == "eagle" else "model.layers.9.mtp."
    tensors = {
        block + "self_attn.q_proj.weight": rand(q, h), block + "self_attn.k_proj.weight": rand(kv, h),
        block + "self_attn.v_proj.weight": rand(kv, h), block + "self_attn.o_proj.weight": rand(h, q),
        block + "mlp.gate_proj.weight": rand(inter, h), block + "mlp.up_proj.weight": rand(inter, h),
        block + "mlp.down_proj.weight": rand(h, inter), block + "post_attention_layernorm.weight": torch.ones(h),
    }
    if style == "eagle":
        tensors |= {"fc.weight": rand(h, 2 * h), "fc.bias": rand(h)}  # EAGLE-1: no input norm in its layer
    else:
        tensors |= {block + "eh_proj.weight": rand(h, 2 * h), block + "enorm.weight": torch.ones(h),
                    block + "hnorm.weight": torch.ones(h), block + "shared_head.norm.weight": torch.ones(h),
                    block + "input_layernorm.weight": torch.ones(h)}
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"hidden_size": h, "num_attention_heads": cfg.num_heads,
                                                 "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": inter,
                                                 "draft_head": style}))
    return out


def _with_intermediate(cfg: ArchConfig, intermediate_size: int) -> ArchConfig:
    from dataclasses import replace

    return replace(cfg, intermediate_size=intermediate_size)
