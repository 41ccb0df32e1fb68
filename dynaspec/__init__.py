"""dynaspec: LLM inference with speculative decoding whose K adapts to load."""

from dynaspec.heap import one_arena

one_arena()  # before any other thread allocates: see dynaspec/heap.py

from dynaspec.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # the engine pulls in torch and the model loaders: import it only when asked for
    if name in ("LLM", "CompletionOutput"):
        from dynaspec import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'dynaspec' has no attribute {name!r}")
