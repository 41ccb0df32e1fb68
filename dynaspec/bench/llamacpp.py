"""llama.cpp as a reference engine, through llama-cpp-python (the optional `llamacpp` extra).

The same GGUF file dynaspec reads, greedy decoding with llama.cpp's own CPU kernels:
- `LlamaCppBatch.generate`: any number of sequences at once through llama.cpp's batch API (one
  `llama_decode` per step carrying one token of every sequence, each sequence its own seq_id in a
  unified KV cache), the way llama.cpp's server runs parallel slots;
- `lookup_generate`: one sequence through the high-level `Llama.generate`, plain or with llama.cpp's
  prompt-lookup drafting (`LlamaPromptLookupDecoding`, the model-free n-gram drafter).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

INSTALL_HINT = (
    "llama-cpp-python is not installed: pip install -e '.[llamacpp]' builds it from source "
    "(CMAKE_ARGS='-DGGML_NATIVE=ON' for this CPU's instructions); once built, pip caches the wheel"
)


# llama.cpp's weight repacking (its CPU_REPACK and AMX buffer types). A build with AMX crashed in
# llama_decode on this machine (llama-cpp-python 0.3.36); build without AMX
# (CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON ... -DGGML_AMX_INT8=OFF") to keep
# the AVX-512 repack, which is llama.cpp's fastest path here.
EXTRA_BUFFER_TYPES = True


def available() -> str | None:
    """None when llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def reference_file(model: str) -> Path | None:
    """The GGUF file llama.cpp should run as the reference for `model`, or None (saying why) when
    llama-cpp-python is missing or the model is not a GGUF file or pack."""
    from dynaspec.models.loader import resolve_model

    gguf = resolve_model(model).gguf
    why = available() or (None if gguf else f"{model} is not a GGUF file or pack")
    if why:
        print(f"llama.cpp reference skipped: {why}")
        return None
    return gguf


class LlamaCppBatch:
    """A llama.cpp model and context for up to `max_seqs` sequences decoded together."""

    def __init__(
        self, gguf: Path, threads: int, max_seqs: int, n_ctx: int = 4096, n_batch: int = 2048
    ) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        lc.llama_log_set(_quiet, ctypes.c_void_p(0))
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = EXTRA_BUFFER_TYPES
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise ValueError(f"{gguf}: llama.cpp could not load it")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = max_seqs
        cparams.kv_unified = True
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch, self.max_seqs = n_batch, max_seqs
        self.batch = lc.llama_batch_init(n_batch, 0, max_seqs)

    def close(self) -> None:
        lc = self.lc
        if self.batch is not None:
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ctx)
            lc.llama_model_free(self.model)
            self.batch = None

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode over (token, position, sequence, wants logits) entries; returns the
        greedy next token of each entry that wanted logits, in order."""
        lc, b = self.lc, self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i, entry in enumerate(entries):
            if entry[3]:
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def logits(self, ids: list[int]) -> np.ndarray:  # [len(ids), vocab] float32
        """Logits at every position of one sequence (a fresh cache), from one evaluation."""
        lc, b = self.lc, self.batch
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        for i, token in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, i, 1, True
            b.seq_id[i][0] = 0
        b.n_tokens = len(ids)
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return np.stack(
            [
                np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                for i in range(len(ids))
            ]
        )

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]], float]:
        """Greedy: n tokens for every prompt. Returns (seconds, outputs, seconds to the first tokens)."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.max_seqs} sequences")
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        entries = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        nexts: list[int] = []
        for i in range(0, len(entries), self.n_batch):
            nexts += self._decode(entries[i : i + self.n_batch])
        first = time.perf_counter() - start
        outputs = [[t] for t in nexts]
        for step in range(1, n):
            nexts = self._decode(
                [
                    (out[-1], len(ids) + step - 1, s, True)
                    for s, (ids, out) in enumerate(zip(prompts, outputs))
                ]
            )
            for out, t in zip(outputs, nexts):
                out.append(t)
        return time.perf_counter() - start, outputs, first


def lookup_generate(llm, prompt: list[int], n: int, stop_ids=()) -> tuple[float, list[int]]:
    """Greedy generation of up to n tokens (ending at a stop id, which is kept) through
    `Llama.generate`, with whatever draft model `llm` was built with."""
    llm.reset()
    start = time.perf_counter()
    out: list[int] = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) >= n or token in stop_ids:
            break
    return time.perf_counter() - start, out


def make_llama(gguf: Path, threads: int, lookup_tokens: int = 0, n_ctx: int = 4096):
    """A high-level `Llama` on the GGUF; with `lookup_tokens` > 0, drafting by prompt lookup."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
    return Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft,
        verbose=False,
    )


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level, text, user_data) -> None:
    """llama.cpp's log callback: drop its load-time chatter."""
