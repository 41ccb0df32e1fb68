"""Tiny random-weight models and a tiny tokenizer for tests (helpers, not a test module).

`make_tiny_model_dir` writes a complete Hugging Face directory (config.json, model.safetensors,
generation_config.json, tokenizer files with a ChatML chat template) in well under a second, so
tests exercise exactly the loading path a real model takes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_VOCAB_SIZE = 384  # 256 byte tokens + 3 special tokens + merges learned from _TRAINING_TEXT

_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "Speculative decoding drafts several tokens and the target model verifies them in one pass.",
    "Hello, world! How are you today? I am fine, thank you.",
    "import torch\nx = torch.zeros(4, 8)\nreturn x.sum(dim=-1)\n",
    "Grüße aus München, café crème, naïve résumé.",
    "你好，世界。今天天气很好。",
    "class Request:\n    def __init__(self, prompt, max_tokens):\n        self.prompt = prompt\n",
    "user assistant system message content role",
]


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process (about 20 ms) and keep its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT * 4, trainer=trainer)
    return tok.to_str()


def make_tiny_tokenizer(out_dir: Path) -> None:
    """Write a ChatML byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) to out_dir.

    Like Qwen's: no BOS is added, eos is <|im_end|>, <|endoftext|> is the pad token.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(_tokenizer_json()),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
    )
    fast.save_pretrained(str(out_dir))


def tiny_vocab_size() -> int:
    from tokenizers import Tokenizer as RawTokenizer

    return RawTokenizer.from_str(_tokenizer_json()).get_vocab_size(with_added_tokens=True)


def make_tiny_model_dir(
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    init_std: float = 0.3,
    tie: bool = False,
    head_dim: int | None = None,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a random-weight float32 Hugging Face model directory and return its path.

    `init_std` is large on purpose so that the logits are well separated (greedy argmax ties are
    then vanishingly rare). qwen2 attention biases get random values too (HF zero-initializes them).
    """
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    if arch not in config_cls:
        raise ValueError(f"unknown tiny architecture {arch!r} (known: {', '.join(config_cls)})")
    out_dir = Path(out_dir)
    make_tiny_tokenizer(out_dir)
    vocab = tiny_vocab_size()
    eos_id = SPECIAL_TOKENS.index(IM_END)  # special tokens take the first ids, in order
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        bos_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        eos_token_id=eos_id,
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
    )
    kwargs["head_dim"] = head_dim or hidden // heads  # Qwen3Config would default to 128
    config = config_cls[arch](**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, init_std)
            for norm in (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                getattr(attn, "q_norm", None),
                getattr(attn, "k_norm", None),
            ):
                if norm is not None:  # ones by default: perturb so a mixed-up norm is caught
                    norm.weight.normal_(1.0, 0.1)
        model.model.norm.weight.normal_(1.0, 0.1)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    return out_dir


def cached_tiny_model_dir(root: Path, **kwargs) -> Path:
    """make_tiny_model_dir under root/<key>, built once per distinct kwargs (for a session fixture).

    Usage in conftest: a session-scoped fixture returning
    `functools.partial(cached_tiny_model_dir, tmp_path_factory.mktemp("tiny"))`.
    """
    key = "-".join(f"{k}={kwargs[k]}" for k in sorted(kwargs)) or "default"
    out = Path(root) / key.replace("/", "_")
    if not (out / "config.json").exists():
        make_tiny_model_dir(out, **kwargs)
    return out


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# Tensor types for make_tiny_gguf, by HF parameter suffix; every dimension of the tiny models is a
# multiple of 32, the block size of the 32-element quantization types.
DEFAULT_GGUF_TYPES = {
    "embed_tokens.weight": "F16",
    "q_proj.weight": "Q8_0",
    "k_proj.weight": "Q8_0",
    "v_proj.weight": "Q4_0",
    "o_proj.weight": "Q4_1",
    "gate_proj.weight": "Q5_0",
    "up_proj.weight": "BF16",
    "down_proj.weight": "Q8_0",
    "lm_head.weight": "Q8_0",
}

_GGUF_ARCH_KEYS = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}


def _llama_cpp_permute(w, n_head: int):
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (written independently of
    dynaspec.models.gguf so the test checks the inverse, not a copy of it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(hf_dir: Path, out_path: Path, tensor_types: dict[str, str] | None = None) -> dict:
    """Write hf_dir (from make_tiny_model_dir) as a GGUF file the way llama.cpp's converter would:
    llama.cpp tensor names, Q/K rows permuted for llama, tensors quantized per `tensor_types`
    (F32 for anything unlisted, like norms and biases), tokenizer and chat template as metadata.

    Returns {hf_name: float32 tensor} of what a correct converter must give back: the HF weights
    after the quantize -> dequantize round trip.
    """
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = read_json(hf_dir / "config.json")
    arch = config["model_type"]
    types = DEFAULT_GGUF_TYPES if tensor_types is None else tensor_types
    state = load_file(str(hf_dir / "model.safetensors"))
    name_map = gguf.get_tensor_name_map(
        getattr(gguf.MODEL_ARCH, _GGUF_ARCH_KEYS[arch]), config["num_hidden_layers"]
    )

    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(config["head_dim"])
    else:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])

    tok = read_json(hf_dir / "tokenizer.json")
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template((hf_dir / "chat_template.jinja").read_text())

    expected: dict[str, torch.Tensor] = {}
    for hf_name, tensor in state.items():
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{name_map.get_name(stem)}.{suffix}"
        w = tensor.float().numpy()
        n_head = None
        if arch == "llama" and stem.endswith("q_proj"):
            n_head = config["num_attention_heads"]
        elif arch == "llama" and stem.endswith("k_proj"):
            n_head = config["num_key_value_heads"]
        if n_head is not None:
            w = _llama_cpp_permute(w, n_head)
        qtype = getattr(
            gguf.GGMLQuantizationType, next((t for key, t in types.items() if hf_name.endswith(key)), "F32")
        )
        if qtype == gguf.GGMLQuantizationType.F32:
            data = np.ascontiguousarray(w, dtype=np.float32)
            writer.add_tensor(gguf_name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            data = w.astype(np.float16)
            writer.add_tensor(gguf_name, data)
        else:
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
        back = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(w.shape)
        if n_head is not None:  # the inverse, written out: rows (h, d/2, 2) -> (h, 2, d/2)
            back = back.reshape(n_head, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(back))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def dynaspec_logits(
    config, weights: dict[str, torch.Tensor], ids: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:  # [len(ids), vocab] float32
    """Logits of one prefill of ids through dynaspec's LlamaModel (paged KV cache, one sequence)."""
    from dynaspec.models.attention import build_attention_metadata
    from dynaspec.models.build import from_state_dict

    model = from_state_dict(config, weights, dtype, torch.device("cpu"))
    del weights  # when the caller passed load_weights(...) inline, this frees the checkpoint now
    block = 16
    num_blocks = (len(ids) + block - 1) // block
    kv = [
        (
            torch.zeros(num_blocks * block, config.num_key_value_heads, config.head_dim, dtype=dtype),
            torch.zeros(num_blocks * block, config.num_key_value_heads, config.head_dim, dtype=dtype),
        )
        for _ in range(config.num_hidden_layers)
    ]
    meta = build_attention_metadata(
        [len(ids)], [len(ids)], [list(range(num_blocks))], block, torch.device("cpu")
    )
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv, meta)
    return model.compute_logits(hidden)


def load_weights(path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors, or of a GGUF file dequantized to
    float32 (Hugging Face names, llama's Q/K rows un-permuted)."""
    from pathlib import Path

    from dynaspec.models.checkpoint import GgufCheckpoint, SafetensorsCheckpoint
    from dynaspec.models.loader import resolve_model

    path = Path(path)
    if path.suffix == ".gguf":
        source = resolve_model(str(path), progress=False)
        return GgufCheckpoint(path, source.config()).dense_state()
    checkpoint = SafetensorsCheckpoint(path)
    return {name: checkpoint.get(name) for name in sorted(checkpoint.names)}


def load_hf_dir(path):
    """(config, weights, tokenizer) of a Hugging Face directory."""
    from dynaspec.models.loader import load_config, load_tokenizer

    config = load_config(path)
    tokenizer = load_tokenizer(path)
    return config, load_weights(path), tokenizer
