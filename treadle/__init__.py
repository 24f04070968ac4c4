"""treadle: an LLM inference engine and serving layer."""

from .engine.outputs import CompletionOutput, Logprob, RequestOutput
from .engine.sampling_params import SamplingParams
from .llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
