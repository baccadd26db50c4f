"""pdserve: serve large language models with prefill and decode disaggregated."""

from pdserve.llm import LLM
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
