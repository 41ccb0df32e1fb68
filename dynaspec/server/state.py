"""What the HTTP handlers share (``AppState``, one per app) and what each request tracks (``Choice``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynaspec.engine.request import RequestOutput
from dynaspec.engine.types import TokenLogprob
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.backend import Backend
from dynaspec.server.protocol import IgnoredFields


@dataclass(slots=True)
class AppState:
    """The backend, the one model name clients may ask for, and what the app remembers across requests."""

    backend: Backend
    served_model_name: str
    ignored: IgnoredFields = field(default_factory=IgnoredFields)
    token_texts: dict[int, str] = field(default_factory=dict)  # token id -> its text, decoded alone

    def token_text(self, token_id: int) -> str:
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.backend.tokenizer.decode([token_id])
        return text


@dataclass(slots=True)
class Choice:
    """One engine request of an HTTP request: a prompt and a sample of it."""

    index: int  # OpenAI's choice index: prompt index * n + sample index
    sample: int  # 0..n-1
    request_id: str
    prompt_ids: list[int]
    echo_text: str  # the prompt's text with echo, else empty
    params: SamplingParams
    final: RequestOutput | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the output tokens so far
