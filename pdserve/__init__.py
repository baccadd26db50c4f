"""pdserve: serve large language models with prefill and decode disaggregated."""

from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `LLM` brings torch and the engine; the router and the tools that only read a model's
    # metadata import this package without them.
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
