"""EAGLE and EAGLE-3 heads: the checkpoint loader, the head's forward pass against the papers, the
target's hidden states, and speculation with a head that stays lossless."""

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from support.eagle import AUX_LAYERS, target_config, write_head
from support.engine import PROMPTS, make_engine, run_alone, run_staggered
from support.kpolicy import RaggedK
from support.sampling import sampling_rows

from dynaspec import SamplingParams
from dynaspec.engine.runner import TokenRun
from dynaspec.models.llama import LlamaModel
from dynaspec.models.qlinear import QuantLinear
from dynaspec.spec_decode.eagle import DraftDraw, draw_position
from dynaspec.spec_decode.eagle_head import default_aux_layers, load_eagle_head, quantize_head


@pytest.fixture(scope="module")
def eagle3_dir(target_dir, tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle3"), "eagle3", target_config(target_dir), draft_vocab=150)


@pytest.fixture(scope="module")
def eagle_dir(target_dir, tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle"), "eagle", target_config(target_dir), seed=1)


@pytest.fixture(scope="module")
def plain(target_dir):
    return run_alone(target_dir, PROMPTS)


# ---- the loader ------------------------------------------------------------------------------


def test_the_loader_reads_an_eagle3_checkpoint_as_written(target_dir, eagle3_dir):
    from safetensors.torch import load_file

    written = load_file(str(eagle3_dir / "model.safetensors"))
    head = load_eagle_head(
        eagle3_dir, "eagle3", target_config(target_dir), torch.float32, torch.device("cpu")
    )
    assert head.config.target_layers == tuple(AUX_LAYERS)
    assert head.config.draft_vocab_size == 150
    q, k, v = (written[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(head.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert head.self_attn.qkv_proj.in_features == 2 * 64  # q/k/v read [embedding, fused state]
    assert torch.equal(head.fc.weight, written["fc.weight"]) and head.fc.bias is None
    assert torch.equal(head.hidden_norm.weight, written["midlayer.hidden_norm.weight"])
    assert torch.equal(head.lm_head.weight, written["lm_head.weight"])
    targets = torch.arange(150) + written["d2t"]
    assert torch.equal(head.draft_to_target, targets) and bool(written["t2d"][targets].all())
    assert head.cut and head.embed_tokens is None  # the target's embedding


def test_the_loader_reads_an_eagle_checkpoint_with_its_fc_bias(target_dir, eagle_dir):
    head = load_eagle_head(eagle_dir, "eagle", target_config(target_dir), torch.float32, torch.device("cpu"))
    target = target_config(target_dir)
    assert head.config.target_layers == (target.num_hidden_layers,)  # the final norm's output
    assert head.fc.bias is not None and head.fc.in_features == 2 * target.hidden_size
    assert head.lm_head is None and head.norm is None and head.input_layernorm is None


def test_eagle3_reads_vllm_s_default_layers_when_its_config_names_none(tiny_dir, tmp_path):
    deep = tiny_dir(arch="llama", seed=3, num_layers=6)
    target = target_config(deep)
    path = write_head(tmp_path / "h", "eagle3", target, eagle_config={})
    head = load_eagle_head(path, "eagle3", target, torch.float32, torch.device("cpu"))
    assert head.config.target_layers == default_aux_layers(6) == (2, 3, 3)


@pytest.mark.parametrize(
    ("method", "change", "field"),
    [
        ("eagle3", {"hidden_size": 32}, "hidden_size"),
        ("eagle", {"vocab_size": 1000}, "vocab_size"),
        ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, "layer_ids"),
        ("eagle3", {"eagle_config": {}}, "num_hidden_layers of the target"),  # default (2, 1, -1)
        ("eagle3", {"num_hidden_layers": 2}, "num_hidden_layers"),
        ("eagle3", {"draft_vocab_size": 5000}, "draft_vocab_size"),
        ("eagle3", {"target_hidden_size": 128}, "target_hidden_size"),
    ],
)
def test_a_head_that_does_not_fit_the_target_is_refused_naming_the_field(
    target_dir, tmp_path, method, change, field
):
    path = write_head(tmp_path / "h", method, target_config(target_dir), draft_vocab=150)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(ValueError, match=field):
        load_eagle_head(path, method, target_config(target_dir), torch.float32, torch.device("cpu"))


def test_a_missing_or_misshapen_tensor_is_named(target_dir, tmp_path):
    from safetensors.torch import load_file

    target = target_config(target_dir)
    path = write_head(tmp_path / "h", "eagle3", target, draft_vocab=150)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="norm.weight is missing"):
        load_eagle_head(path, "eagle3", target, torch.float32, torch.device("cpu"))
    save_file(tensors | {"d2t": tensors["d2t"] + target.vocab_size}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load_eagle_head(path, "eagle3", target, torch.float32, torch.device("cpu"))
    save_file(
        tensors | {"fc.weight": tensors["fc.weight"][:, :64].contiguous()}, str(path / "model.safetensors")
    )
    with pytest.raises(ValueError, match="fc.weight has shape"):
        load_eagle_head(path, "eagle3", target, torch.float32, torch.device("cpu"))


def test_the_speculative_config_takes_eagle_methods_and_needs_their_model():
    from dynaspec.kpolicy.config import SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": "eagle3", "model": "/x", "num_speculative_tokens": 3})
    assert spec.method == "eagle3" and spec.model == "/x"
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="draft_vocab_size"):  # the head's own config.json says it
        SpeculativeConfig.parse(
            {"method": "eagle3", "model": "/x", "num_speculative_tokens": 3, "draft_vocab_size": 8}
        )


# ---- the target's hidden states --------------------------------------------------------------


@functools.cache
def _hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_hidden_states(path, ids):
    """Hugging Face's hidden states of a sequence: [layers + 1] of [n, H] (entry l enters layer l;
    the last is the final norm's output)."""
    with torch.no_grad():
        out = _hf_model(path)(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_runner_returns_the_hidden_states_entering_the_chosen_layers(target_dir, quantization):
    """Both paths (torch modules; the C++ decoder stack on int8 weights) give Hugging Face's hidden
    states for every token computed, prefill and decode rows alike, and the same logits."""
    engine = make_engine(target_dir, quantization=quantization)
    runner, model = engine.runner, engine.runner.model
    if quantization == "int8" and model._decoder_stack() is None:
        pytest.skip("the C++ decoder stack is not built here")
    ids = engine.tokenizer.encode(PROMPTS[2])
    layers = (0, 1, 2, 1)  # 2: the final norm's output; a layer may come twice
    blocks = list(range(4))
    logits, hidden = runner.run_capture([TokenRun(ids[:-3], 0, blocks, [len(ids) - 4])], layers)
    assert torch.equal(logits, runner.run([TokenRun(ids[:-3], 0, blocks, [len(ids) - 4])]))
    _, tail_hidden = runner.run_capture([TokenRun(ids[-3:], len(ids) - 3, blocks, [0, 1, 2])], layers)
    hidden = torch.cat([hidden, tail_hidden])  # [n, 4 * H]
    assert hidden.shape == (len(ids), 4 * 64)
    if quantization == "none":
        reference = _hf_hidden_states(target_dir, ids)
        for i, layer in enumerate(layers):
            torch.testing.assert_close(
                hidden[:, i * 64 : (i + 1) * 64], reference[layer], atol=2e-4, rtol=1e-4
            )
    else:  # the C++ stack against the torch modules on the same weights
        model.use_stack = False
        try:
            _, python = runner.run_capture([TokenRun(ids, 0, blocks, [0])], layers)
        finally:
            model.use_stack = True
        torch.testing.assert_close(hidden, python, atol=1e-5, rtol=1e-5)


def test_no_hidden_state_is_computed_without_an_eagle_head(target_dir, draft_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("hidden states computed")

    monkeypatch.setattr(LlamaModel, "forward_capture", refuse)
    for spec in (None, {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}):
        engine = make_engine(target_dir, speculative_config=spec)
        assert engine.runner.hidden_layers == ()
        run_staggered(engine, PROMPTS[:2])


# ---- the head's forward pass against the papers ----------------------------------------------


def _rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta=10000.0):  # x [n, heads, d], rotate-half (Hugging Face's layout)
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


class ReferenceHead:
    """A head written from the papers, over a whole sequence with full causal attention (no cache).

    EAGLE (2401.15077): f = fc([e(x_{p+1}); F_p]) with F the target's last hidden state; one
    decoder layer without its input norm; the target's LM head on its output.
    EAGLE-3 (2503.01840): g = fc([l; m; h]) fusing the low, middle and high layers' states; the
    layer's attention reads [norm(e(x_{p+1})); norm(g)] and adds to g; a final norm, then the
    head's own LM head over the draft vocabulary, draft id i meaning target id i + d2t[i].
    Drafting on, position p + 1 reads the head's own state at p (before the final norm)."""

    def __init__(self, path, method, target_path):
        from safetensors.torch import load_file

        self.w = load_file(str(path / "model.safetensors"))
        self.cfg = json.loads((path / "config.json").read_text())
        self.target = load_file(str(target_path / "model.safetensors"))
        self.eagle3 = method == "eagle3"
        self.layer = "midlayer." if self.eagle3 else "layers.0."

    def states(self, tokens, hidden, own):  # tokens [n] (x_{p+1}), hidden [n, *] per position p
        """(logits over the target's vocabulary, the state the next position reads), per position."""
        w, p = self.w, self.layer
        e = self.target["model.embed_tokens.weight"][tokens]
        heads, kv_heads = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        if self.eagle3:
            g = torch.stack([h if o else h @ w["fc.weight"].T for h, o in zip(hidden, own)])
            x = torch.cat(
                [_rms(e, w[f"{p}input_layernorm.weight"]), _rms(g, w[f"{p}hidden_norm.weight"])], -1
            )
            residual = g
        else:
            x = torch.cat([e, torch.stack(hidden)], -1) @ w["fc.weight"].T + w["fc.bias"]
            residual = x
        n = len(tokens)
        q = (x @ w[f"{p}self_attn.q_proj.weight"].T).view(n, heads, -1)
        k = (x @ w[f"{p}self_attn.k_proj.weight"].T).view(n, kv_heads, -1)
        v = (x @ w[f"{p}self_attn.v_proj.weight"].T).view(n, kv_heads, -1)
        pos = torch.arange(n)
        q, k = _rope(q, pos), _rope(k, pos)
        k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        a = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        r = residual + a.transpose(0, 1).reshape(n, -1) @ w[f"{p}self_attn.o_proj.weight"].T
        m = _rms(r, w[f"{p}post_attention_layernorm.weight"])
        m = (F.silu(m @ w[f"{p}mlp.gate_proj.weight"].T) * (m @ w[f"{p}mlp.up_proj.weight"].T)) @ w[
            f"{p}mlp.down_proj.weight"
        ].T
        s = r + m
        if not self.eagle3:
            return s @ self.target["lm_head.weight"].T, s
        cut = _rms(s, w["norm.weight"]) @ w["lm_head.weight"].T
        logits = torch.full((n, self.cfg["vocab_size"]), float("-inf"))
        logits[:, torch.arange(len(w["d2t"])) + w["d2t"]] = cut
        return logits, s

    def greedy_drafts(self, context, target_hidden, k):
        """K greedy drafts after ``context`` (token ids), the target's states ``target_hidden`` [n, *]."""
        tokens, hidden, own = (
            list(context[1:]),
            list(target_hidden[: len(context) - 1]),
            [False] * (len(context) - 1),
        )
        drafts = []
        for _ in range(k):
            logits, states = self.states(torch.tensor(tokens), hidden, own)
            drafts.append(int(logits[-1].argmax()))
            tokens.append(drafts[-1])
            hidden.append(states[-1])  # the next position reads the head's own state
            own.append(True)
        return drafts


# a random head's drafts are all rejected; accepting them at a synthetic rate (whatever their
# tokens) makes the head catch up on several verified positions a step too
@pytest.mark.parametrize("accept", [None, 0.7])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_drafts_equal_the_papers_head_on_hugging_face_s_hidden_states(
    target_dir, eagle3_dir, eagle_dir, method, accept
):
    """Every step's greedy drafts, from the engine's incremental catch-up and chain, equal those
    of the reference head run from scratch on the whole context and Hugging Face's states."""
    path = eagle3_dir if method == "eagle3" else eagle_dir
    k = 3
    # the head as stored (the reference's float weights), not the CPU's int8 default
    spec = {"method": method, "model": str(path), "num_speculative_tokens": k, "draft_quantization": "none"}
    if accept is not None:
        spec["synthetic_acceptance_rate"] = accept
    engine = make_engine(target_dir, speculative_config=spec)
    reference = ReferenceHead(path, method, target_dir)
    layers = AUX_LAYERS if method == "eagle3" else [2]
    checked = []

    def check(plan, drafts):
        for i, r in enumerate(plan.decodes):
            n = drafts.draft_lens[i]
            if not n:
                continue
            context = r.token_at(0, r.num_tokens)
            states = _hf_hidden_states(target_dir, context)
            hidden = torch.cat([states[layer] for layer in layers], -1)
            expected = reference.greedy_drafts(context, hidden, n)
            assert drafts.token_ids[i, :n].tolist() == expected
            checked.append(n)

    _spy(engine, check)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    run_staggered(engine, PROMPTS[:2], params, arrive_every=1)
    assert len(checked) >= 4
    if accept is not None:
        assert engine.stats()["spec"]["num_accepted_tokens"] >= 4


def test_a_greedy_draw_over_a_cut_head_s_own_ids_equals_the_full_vocabulary_s():
    """Greedy drafts from a cut head's logits over its own ids (mapped to the target's) are the
    draws of the same logits spread over the target's vocabulary at -inf, with their confidences
    (a softmax over fewer terms: equal to float32 rounding)."""
    gen = torch.Generator().manual_seed(0)
    vocab, cut_ids = 500, torch.randperm(500, generator=gen)[:40].sort().values
    cut = torch.randn(3, 40, generator=gen) * 3
    cut[1, 7] = cut[1, 9] = cut[1].max() + 1  # a tie: the lower id wins in both
    full = torch.full((3, vocab), float("-inf")).index_copy_(1, cut_ids, cut)
    draws = []
    for logits, to_target in ((full, None), (cut, cut_ids)):
        draw = DraftDraw(torch.zeros(4, 2, dtype=torch.long), [1, 0, 0, 1], [[0.5], [], [], [0.5]])
        draw_position(logits, [0, 1, 3], 1, draw, sampling_rows([0.0] * 4), 0.3, to_target)
        draws.append((draw.tokens.tolist(), draw.lens, [p for row in draw.confidence for p in row]))
    assert draws[0][:2] == draws[1][:2]
    assert draws[0][2] == pytest.approx(draws[1][2], rel=1e-6)
    assert draws[0][0][1][1] == cut_ids[7]
    with pytest.raises(ValueError, match="greedy"):
        draw_position(cut, [0, 1, 3], 1, draw, sampling_rows([0.0, 1.0, 0.0, 0.0]), 0.3, cut_ids)


def _spy(engine, check):
    propose = engine.proposer.propose

    def spy(plan, sampling):
        drafts = propose(plan, sampling)
        check(plan, drafts)
        return drafts

    engine.proposer.propose = spy


# ---- lossless speculation ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_eagle_greedy_equals_plain(target_dir, eagle3_dir, eagle_dir, plain, method, k):
    path = eagle3_dir if method == "eagle3" else eagle_dir
    engine = make_engine(
        target_dir, speculative_config={"method": method, "model": str(path), "num_speculative_tokens": k}
    )
    with engine.recording() as run:
        assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    assert engine.stats()["spec"]["num_draft_tokens"] > 0
    assert any(t.draft_passes for t in run.timings)
    assert engine.allocator.usage == 0.0
    engine.step()  # the last finished requests are released at the next schedule
    assert engine.proposer.states == {}


@pytest.mark.parametrize(("quantization", "tolerance"), [("int8", 0.02), ("int4", 0.25)])
def test_draft_quantization_holds_a_head_s_linears_quantized_and_stays_lossless(
    target_dir, eagle3_dir, plain, quantization, tolerance
):
    """``draft_quantization`` int8/int4 quantizes an EAGLE head's linears (fc, the layer's four
    projections, its lm_head): each computes its float twin's output to within ``tolerance``
    (relative), and speculation with the head stays lossless."""
    spec = {"method": "eagle3", "model": str(eagle3_dir), "num_speculative_tokens": 3}
    engine = make_engine(target_dir, speculative_config={**spec, "draft_quantization": quantization})
    head = engine.proposer.head
    stored = load_eagle_head(
        eagle3_dir, "eagle3", target_config(target_dir), torch.float32, torch.device("cpu")
    )
    pairs = [
        (head.fc, stored.fc),
        (head.self_attn.qkv_proj, stored.self_attn.qkv_proj),
        (head.self_attn.o_proj, stored.self_attn.o_proj),
        (head.mlp.gate_up_proj, stored.mlp.gate_up_proj),
        (head.mlp.down_proj, stored.mlp.down_proj),
        (head.lm_head, stored.lm_head),
    ]
    torch.manual_seed(0)
    for quantized, dense in pairs:
        assert isinstance(quantized, QuantLinear)
        x = torch.randn(5, dense.in_features)
        expected = dense(x)
        error = (quantized(x) - expected).norm() / expected.norm()
        assert error < tolerance, (quantization, error)
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    assert engine.stats()["spec"]["num_draft_tokens"] > 0
    assert quantize_head(stored, None) is stored and isinstance(stored.fc, torch.nn.Linear)
    with pytest.raises(ValueError, match="draft_quantization"):
        quantize_head(stored, "int2")


# thresholds inside each random head's spread of top probabilities (EAGLE's, through the target's
# head on a state with no final norm, sit near 1)
@pytest.mark.parametrize(("method", "min_confidence"), [("eagle3", 0.2), ("eagle", 0.999)])
def test_ragged_per_request_k_with_confidence_stops_equals_plain(
    target_dir, eagle3_dir, eagle_dir, plain, method, min_confidence
):
    path = eagle3_dir if method == "eagle3" else eagle_dir
    engine = make_engine(
        target_dir, speculative_config={"method": method, "model": str(path), "num_speculative_tokens": 5}
    )
    policy = RaggedK(min_confidence)
    engine.set_k_policy(policy)
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    assert [lens for lens in policy.draft_lens if len(set(lens)) > 1], "no ragged step"
    assert sum(map(sum, policy.draft_lens)) < sum(map(sum, policy.k_caps))  # confidence stops cut some


SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_eagle_sampled_with_a_seed_equals_plain_sampled(target_dir, eagle3_dir, eagle_dir, method):
    """The head draws at the target's uniforms, so a seeded sampled request emits plain decoding's
    tokens at any K (the engine draws each token at (seed, position))."""
    path = eagle3_dir if method == "eagle3" else eagle_dir
    expected = run_alone(target_dir, PROMPTS[:3], SEEDED)
    engine = make_engine(
        target_dir, speculative_config={"method": method, "model": str(path), "num_speculative_tokens": 3}
    )
    assert run_staggered(engine, PROMPTS[:3], SEEDED) == expected
    assert engine.stats()["spec"]["num_draft_tokens"] > 0


def test_a_vllm_style_eagle3_config_runs_unchanged(target_dir, eagle3_dir, plain):
    spec = {
        "method": "eagle3",
        "model": str(eagle3_dir),
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 4, 1], [5, 256, 0]],
    }
    engine = make_engine(target_dir, speculative_config=json.dumps(spec))
    assert run_staggered(engine, PROMPTS, arrive_every=1) == plain
    steps = engine.stats()["spec"]["steps_by_batch_size"]
    assert "3" in steps["1"] and "0" in steps["5"]  # the table's K (with its hysteresis between)
    assert {k for ks in steps.values() for k in ks} <= {"0", "1", "3"}


def test_the_profiler_times_the_head_s_passes_and_its_catchup(target_dir, eagle3_dir):
    """Goodput pricing as for a draft model: ITL cells at every K, the head's passes timed, and a
    new request's catch-up timed on lent blocks."""
    from dynaspec.engine.profiler import ProfileSettings, measure_catchup, measure_itl

    spec = {"method": "eagle3", "model": str(eagle3_dir), "num_speculative_tokens": 2}
    engine = make_engine(target_dir, speculative_config=spec)
    settings = ProfileSettings(
        batch_sizes=[1, 2],
        max_k=2,
        warmup_steps=1,
        measured_steps=1,
        rounds=1,
        revisits=0,
        catchup_rows=(1, 2),
    )
    timings = []
    stats = measure_itl(engine, PROMPTS, settings, progress=False, timings=timings)
    assert sorted(stats) == [1, 2] and all(sorted(row) == [0, 1, 2] for row in stats.values())
    assert any(t.draft_passes for t in timings)
    free, before = engine.allocator.num_free, len(timings)
    measure_catchup(engine, PROMPTS, settings, timings)
    passes = [t.draft_passes[0] for t in timings[before:]]
    assert [rows for rows, _, _ in passes] == [1, 1, 2, 2]
    assert all(extra > 0 and ms > 0 for _, extra, ms in passes)
    assert engine.allocator.num_free == free
