"""Architecture description shared by every Llama-family model dynaspec runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_HF_ARCHITECTURE_NAMES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3)
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}: dynaspec runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("default", "llama3", None):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary."""
        arch = d.get("model_type")
        if arch is None and d.get("architectures"):
            arch = _HF_ARCHITECTURE_NAMES.get(d["architectures"][0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}: dynaspec runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")  # transformers >= 5 moves rope settings here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=rope_scaling,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def kv_bytes_per_token_per_dtype_byte(self) -> int:
        """K and V elements one token occupies over all layers (multiply by the dtype's size)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
