"""Engine configuration: plain dataclasses, validated where they are built. torch is imported only
where a dtype or device is resolved: the command line (and the router's process) reads this module
without loading it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.flags import flag
from pdserve.limits import MAX_TENSOR_PARALLEL

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

ROLES = ("both", "prefill", "decode")
QUANTIZATIONS = ("auto", "none", "int4", "int8")


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as '512MiB', '2GiB', '1.5G'."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"cannot read {value!r} as a memory size; use e.g. 512MiB or 2GiB")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A torch dtype for `name`. `auto` here is the rule from the instruction sets alone; an engine
    measures what `auto` means for its model on a CPU (`engine/dtype_choice.py`)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    name = _ALIASES.get(name, name)
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        from pdserve.layers.cpu import has_native_bfloat16

        return torch.bfloat16 if has_native_bfloat16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return getattr(torch, name)


def resolve_device(name: str | torch.device) -> torch.device:
    import torch

    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but this machine has no usable CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; choose cpu or cuda")
    return device


@dataclass(slots=True)
class EngineConfig:
    # A field made with `flag` is also the engine's command-line flag (pdserve/flags.py).
    model: str = flag(help="model directory, .gguf file, 'default' (SmolLM2-135M-Instruct) or a preset: tiny, demo")
    dtype: str = flag("auto", "auto: on CPU whichever of float32 and bfloat16 runs this model faster on this CPU "
                      "(bfloat16 only by a margin), timed at the first start and cached; on CUDA bfloat16 where "
                      "supported | float32 | bfloat16 | float16")  # engine/dtype_choice.py
    device: str = flag("cpu", "cpu | cuda")
    kv_cache_memory: int | str = flag("1GiB", "KV cache budget, e.g. 512MiB, 2GiB")  # in bytes once validated
    host_kv_memory: int | str = flag(
        "0", "host KV tier: prefix blocks the pool evicts are kept in this much host memory (e.g. 2GiB) and "
        "copied back on a prefix hit, so a returning conversation computes only its new tokens; 0: none")
    host_kv_encoding: str = flag("raw", "the host KV tier's blocks: raw (exact) or int8 (half of bf16's bytes, "
                                 "a quarter of float32's; a prefix brought back is close, not equal)",
                                 choices=("raw", "int8"))
    disk_kv_path: str = flag("", "disk KV tier: blocks the host tier lets go are written under this directory "
                             "(checked when read back; kept across restarts of a worker with the same model and "
                             "layout); without --host-kv-memory, a host tier of 64 blocks stages them")
    disk_kv_memory: int | str = flag("8GiB", "the disk KV tier's bound, e.g. 20GiB")
    kv_store: str = flag("", "a KV tier workers share: evicted prefix blocks also go to this Valkey/Redis server "
                         "(unix:///path/to.sock or valkey://host:port; password from $PDSERVE_KV_STORE_PASSWORD) and "
                         "are read back where nothing above holds them (`pip install pdserve[store]`); "
                         "`pdserve serve --local-kv-store SIZE` starts one")
    block_size: int = flag(16)  # tokens per KV block
    # token budget of one step (prefill chunks + decodes); vLLM's server default. Prompts up to this
    # long are computed whole (a chunk after cached tokens attends through a mask, slower), and a
    # step of this many tokens holds decodes that share it for about 0.3 s on 2 CPU cores
    max_num_batched_tokens: int = flag(2048)
    max_num_seqs: int = flag(64)  # requests running at once
    max_model_len: int | None = flag(None)  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = flag(True, name="--no-prefix-caching")
    role: str = "both"  # which part of a request this engine computes (the worker's --role)
    seed: int = flag(0)  # for requests sampled without their own seed
    num_threads: int | None = flag(None, "CPU threads for torch", name="--threads")  # default: torch's choice
    quantization: str | None = flag(  # layers/quant.py; None is "none"
        "auto", "auto: weights as the checkpoint stores them (a GGUF's Q4_1 and Q8_0 tensors stay 4- and "
        "8-bit, on CPU), the rest in --dtype | none: all in --dtype | int4 | int8: every matmul weight in "
        "groups of 32 (CPU)", choices=QUANTIZATIONS)
    decode_headroom_tokens: int = flag(64, "decode: free KV a reservation must leave for generation")
    shortest_prompt_first: bool = flag(
        False, "admit the shortest waiting prompt first (within a priority); see --max-queue-wait")
    max_queue_wait_s: float = flag(  # ...except that one waiting this long goes first: none starves
        10.0, "seconds after which a waiting request goes ahead of shorter ones", name="--max-queue-wait")
    compile_decode: bool = flag(  # engine/compiled_step.py
        False, "run decode steps as compiled graphs (torch.compile with C++ GEMM templates on CPU) over "
        "dense weights (--quantization none; quantized weights run eager on pdserve's kernels, which "
        "are faster: 172 against 65 tok/s for one stream of the default model on a 2-vCPU Xeon); a "
        "worker compiles them before it takes requests (a few minutes on a small CPU, every start)")
    speculative: str = flag(  # engine/spec/
        "off", "ngram: propose each request's next tokens from earlier occurrences of its last tokens "
        "(prompt lookup) and verify them in one step, as many as measured step costs and acceptance "
        "say pay: faster where the output repeats the input, the same tokens (seeded or greedy); "
        "suffix: as ngram, and also what recent requests on the worker wrote (agent loops, retries, "
        "repeated questions); draft:PATH: what a smaller model with the same tokenizer writes (a "
        "directory or .gguf file; the served model itself makes a self-draft, in 4-bit weights on CPU), "
        "run a few tokens ahead over a KV cache of its own; head:PATH: what a draft head (EAGLE or MTP "
        "weights as safetensors) guesses from the model's own hidden states, its one layer's KV kept "
        "in the model's blocks")
    num_speculative_tokens: int = flag(8, "tokens proposed for a request at a step, at most")
    draft_quantization: str = flag(
        "auto", "the draft model's weights (--speculative draft:PATH): auto keeps a quantized file's "
        "and makes a dense one 4-bit on CPU (a draft is cheap or it does not pay); int4, int8 or none",
        choices=QUANTIZATIONS)
    tensor_parallel_size: int = flag(  # engine/parallel/
        1, "split the model across this many ranks of one worker (processes; GPUs cuda:0.. on CUDA): "
        "attention heads and their KV, MLP columns and the head's vocabulary, one all-reduce after each "
        "layer's attention and MLP; the model's KV heads and sizes must divide by it")
    expert_parallel: bool = flag(
        False, "with --tensor-parallel-size: each rank holds whole experts of a mixture-of-experts model "
               "(a share of them) instead of a slice of every expert (one rank holds them all anyway)")

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        self.host_kv_memory = parse_size(self.host_kv_memory)
        if self.host_kv_memory < 0:
            raise ValueError("host_kv_memory must not be negative")
        self.disk_kv_memory = parse_size(self.disk_kv_memory)
        if self.kv_store:
            from pdserve.store_server import parse_store_url

            parse_store_url(self.kv_store)
        if self.host_kv_encoding not in ("raw", "int8"):
            raise ValueError(f"host_kv_encoding must be raw or int8, got {self.host_kv_encoding!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.quantization is None:
            self.quantization = "none"
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.quantization in ("int4", "int8") and str(self.device).split(":")[0] != "cpu":
            raise ValueError(f"{self.quantization} weights run on CPU kernels; use device='cpu'")
        path = next((self.speculative.removeprefix(p).strip() for p in ("draft:", "head:")
                     if self.speculative.startswith(p)), "")
        if self.speculative not in ("off", "ngram", "suffix") and not path:
            raise ValueError(f"speculative must be off, ngram, suffix, draft:PATH or head:PATH, got {self.speculative!r}")
        if self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}; "
                             f"got {self.draft_quantization!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be 1 to 64, got {self.num_speculative_tokens}")
        if self.decode_headroom_tokens < 0:
            raise ValueError("decode_headroom_tokens must not be negative")
        if not self.max_queue_wait_s > 0:
            raise ValueError("max_queue_wait_s must be positive")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        self._check_parallel()

    def _check_parallel(self) -> None:
        n = self.tensor_parallel_size
        if not 1 <= n <= MAX_TENSOR_PARALLEL:
            raise ValueError(f"tensor_parallel_size must be 1 to {MAX_TENSOR_PARALLEL}, got {n}")
        if n == 1:
            return
        refused = [name for name, on in {
            "compile_decode": self.compile_decode,  # a graph of one process's layers, without the ranks' sums
            "speculative draft head or model": self.speculative.startswith(("head:", "draft:")),
        }.items() if on]
        if str(self.device).split(":")[0] == "cuda":  # each GPU holds its own ranks' KV: no pool to ship or keep
            refused += [name for name, on in {
                "role": self.role != "both", "host_kv_memory": self.host_kv_memory > 0,
                "disk_kv_path": bool(self.disk_kv_path), "kv_store": bool(self.kv_store)}.items() if on]
        if refused:
            raise ValueError(f"tensor_parallel_size {n} cannot yet be combined with {', '.join(refused)}")
