"""treadle: an LLM inference engine and serving layer."""

from treadle.engine.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM on first use: it imports torch, which processes that only tokenize (the HTTP front end) never need.
    if name == "LLM":
        from treadle.llm import LLM

        return LLM
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")
