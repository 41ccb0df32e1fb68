"""dynaspec: LLM inference with speculative decoding whose K adapts to load."""

from dynaspec.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # the engine pulls in torch and the model loaders: import it only when asked for
    if name in ("LLM", "CompletionOutput"):
        from dynaspec import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'dynaspec' has no attribute {name!r}")
