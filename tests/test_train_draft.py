"""`dynaspec train-draft`: an EAGLE-3 head trained on a tiny target's own answers, written in the
checkpoint layout the engine's eagle3 proposer loads, whose training forward is the engine's."""

import json
from pathlib import Path

import pytest
import torch
from support.eagle import target_config
from support.engine import GREEDY, PROMPTS, make_engine, run_alone, run_staggered

from dynaspec import SamplingParams
from dynaspec.cli import main
from dynaspec.engine.kv_cache import allocate_kv_cache
from dynaspec.models.attention import build_attention_metadata
from dynaspec.spec_decode.eagle_head import load_eagle_head
from dynaspec.train import eagle3


def test_the_trained_forward_is_the_engines_head_after_a_round_trip(target_dir, tmp_path):
    """The training-time test's step 0 over a sequence, and its step 1 at the last row, give the
    logits the engine's EagleHead gives from the written checkpoint: its catch-up pass over the
    positions, then one chained pass at the next position on its own state."""
    torch.manual_seed(0)
    target = target_config(target_dir)
    draft_ids = torch.randperm(target.vocab_size)[:40].sort().values
    config = eagle3.head_config(target, len(draft_ids), 96)
    model = eagle3.TrainableEagle3(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # every tensor matters, norms and fc included
            p.copy_(p.to(torch.bfloat16).float())  # as the checkpoint holds them
    eagle3.write_checkpoint(model, config, draft_ids, target.vocab_size, tmp_path, {"target": "tiny"})
    head = load_eagle_head(tmp_path, "eagle3", target, torch.float32, torch.device("cpu"))
    assert torch.equal(head.draft_to_target, draft_ids)

    n, h = 9, target.hidden_size
    ids = torch.randint(0, target.vocab_size, (n + 3,))
    table = torch.randn(target.vocab_size, h)
    hidden = torch.randn(n, 3 * h)
    steps = model.ttt(table[ids[1 : n + 3]], hidden, 2)  # row p reads token p + 1 (+ j)

    kv = allocate_kv_cache(head.config.layer, 64, torch.float32, torch.device("cpu"))[0]
    meta = build_attention_metadata([n], [n], [[0, 1, 2, 3]], 16, torch.device("cpu"))
    out, state = head(table[ids[1 : n + 1]], hidden, torch.arange(n), kv, meta)
    full = head.draft_logits(out, None, target.vocab_size)
    torch.testing.assert_close(full[:, draft_ids], steps[0].detach(), rtol=1e-4, atol=1e-4)
    assert torch.isinf(
        full[:, [i for i in range(target.vocab_size) if i not in set(draft_ids.tolist())]]
    ).all()

    meta = build_attention_metadata([1], [n + 1], [[0, 1, 2, 3]], 16, torch.device("cpu"))
    out, _ = head(table[ids[n + 1 : n + 2]], state[-1:], torch.tensor([n]), kv, meta)
    chained = head.draft_logits(out, None, target.vocab_size)[:, draft_ids]
    torch.testing.assert_close(chained, steps[1][-1:].detach(), rtol=1e-4, atol=1e-4)


def test_rows_before_the_first_counted_one_only_lend_their_keys(target_dir, monkeypatch):
    """The training-time test from row ``first`` on gives, at every step, the logits the full one
    gives those rows, and a conversation's loss and gradients are those of the full pass."""
    torch.manual_seed(1)
    target = target_config(target_dir)
    model = eagle3.TrainableEagle3(eagle3.head_config(target, 40, 96))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    n, h, first = 12, target.hidden_size, 5
    embeds, hidden = torch.randn(n + 3, h), torch.randn(n, 3 * h)
    full, cut = model.ttt(embeds, hidden, 3), model.ttt(embeds, hidden, 3, first)
    for a, b in zip(full, cut, strict=True):
        torch.testing.assert_close(b, a[first:], rtol=1e-5, atol=1e-5)

    top = torch.randint(0, 40, (n, 4))
    conv = eagle3.Conversation(torch.randint(0, 40, (n + 1,)), 7, hidden, top, torch.rand(n, 4), top[:, 0])
    assert eagle3.first_counted_row(conv, 3) == 3
    table = torch.randn(target.vocab_size, h)
    params = [model.fc.weight, model.q_proj.weight, model.lm_head.weight]

    def loss_and_grads():
        loss, counted = eagle3.step_loss(model, table.__getitem__, conv, 3)
        return loss, counted, torch.autograd.grad(loss, params)

    loss, counted, grads = loss_and_grads()
    monkeypatch.setattr(eagle3, "first_counted_row", lambda conv, steps: 0)  # every row, every step
    loss0, counted0, grads0 = loss_and_grads()
    assert counted == counted0 > 0
    torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6)
    for g, g0 in zip(grads, grads0, strict=True):
        torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-6)


def test_answers_are_recorded_as_a_teacher_forced_pass_would_capture_them(target_dir, tmp_path):
    """The shards ``collect`` records while the target answers (prefill chunks of 8 tokens, a
    batch of 3) hold, per position but the last, the hidden states and top-k the teacher-forced
    ``capture`` gives over the finished conversation; the runner is plain again afterwards."""
    engine = make_engine(target_dir, max_num_batched_tokens=8)
    settings = eagle3.TrainSettings(max_tokens=12, generate_batch=3, top_k=4)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    shards = eagle3.collect(engine, prompts, settings, tmp_path, progress=False)
    assert len(shards) == 3 and engine.runner.observer is None and engine.runner.hidden_layers == ()
    layers = eagle3.head_layers(engine.model_config.num_hidden_layers)
    for path in shards:
        shard = torch.load(path)
        ids, p = shard["ids"].tolist(), shard["prompt_len"]
        assert len(ids) > p + 1 and shard["hidden"].shape[0] == len(ids) - 1
        hidden, top_ids, top_probs = eagle3.capture(engine, ids, layers, 4)
        torch.testing.assert_close(shard["hidden"].float(), hidden[:-1].float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(shard["top_probs"][p - 1 :], top_probs[p - 1 : -1], rtol=1e-2, atol=1e-3)
        assert torch.equal(shard["top_ids"][p - 1 :, 0], top_ids[p - 1 : -1, 0])  # the greedy token
        assert torch.equal(shard["top_ids"][p - 1 :, 0].long(), torch.tensor(ids[p:]))  # as answered
        assert not shard["top_probs"][: p - 1].any()  # prompt positions carry no label


def test_dataset_answers_are_the_targets_teacher_forced_reading_of_them(target_dir, tmp_path):
    """``--answers dataset``: a shard per conversation that has an answer, named by its prompt's
    index, holding the prompt and the answer cut at max_tokens, the target's hidden states and
    top-k over them as ``capture`` gives, labels on answer positions only; a rerun keeps them."""
    engine = make_engine(target_dir)
    settings = eagle3.TrainSettings(max_tokens=6, top_k=4)
    chat = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    conversations = [(chat[0], PROMPTS[3] + " and more words here"), (chat[1], None), (chat[2], PROMPTS[4])]
    shards = eagle3.collect_dataset_answers(engine, conversations, settings, tmp_path, progress=False)
    assert [p.name for p in shards] == ["tf_000000.pt", "tf_000002.pt"]
    layers = eagle3.head_layers(engine.model_config.num_hidden_layers)
    for path, (messages, answer) in zip(shards, [conversations[0], conversations[2]]):
        shard = torch.load(path)
        prompt = engine.prompt_token_ids(messages)
        ids = prompt + engine.tokenizer.encode(answer)[:6]
        assert shard["ids"].tolist() == ids and shard["prompt_len"] == len(prompt)
        hidden, top_ids, top_probs = eagle3.capture(engine, ids, layers, 4)
        p = len(prompt)
        assert torch.equal(shard["hidden"], hidden[:-1])
        assert torch.equal(shard["top_ids"][p - 1 :], top_ids[p - 1 : -1])
        assert torch.equal(shard["top_probs"][p - 1 :], top_probs[p - 1 : -1])
        assert not shard["top_probs"][: p - 1].any() and not shard["top_ids"][: p - 1].any()
    before = [p.stat().st_mtime for p in shards]
    assert eagle3.collect_dataset_answers(engine, conversations, settings, tmp_path, progress=False) == shards
    assert [p.stat().st_mtime for p in shards] == before
    with pytest.raises(ValueError, match="--answers dataset: only sharegpt"):
        eagle3.training_answers("gsm8k", 4)


def test_sharegpt_gives_each_first_human_turn_with_the_reply_after_it():
    """Prompts in the file's order (empty and over-long first turns skipped, a broken item passed
    over), each with the reply that follows it, None where none does."""
    items = [
        [("human", "first"), ("gpt", "reply one")],
        [("gpt", "a greeting"), ("human", "second"), ("human", "no reply")],
        [("human", "")],
        [("human", "x" * (eagle3.MAX_PROMPT_CHARS + 1)), ("gpt", "too long to ask")],
        [("human", "third"), ("gpt", "  ")],
        [("human", "fourth"), ("gpt", "reply four")],
    ]
    parts = [
        "  "
        + json.dumps(
            {"id": str(i), "conversations": [{"from": f, "value": v} for f, v in turns]}, indent=2
        ).replace("\n", "\n  ")
        for i, turns in enumerate(items)
    ]
    parts.insert(5, '  {\n    "id": "cut", "conversations": [{"from": "human", "val')  # cut short
    pairs = eagle3.parse_sharegpt("[\n" + ",\n".join(parts) + "\n]\n", 10)
    assert [(m[0]["content"], a) for m, a in pairs] == [
        ("first", "reply one"),
        ("second", None),
        ("third", None),
        ("fourth", "reply four"),
    ]
    assert all(m[0]["role"] == "user" and len(m) == 1 for m, _ in pairs)
    assert len(eagle3.parse_sharegpt("[\n" + ",\n".join(parts) + "\n]\n", 2)) == 2


def test_the_held_out_set_is_the_targets_own_answers_and_its_prompts_train_on_nothing():
    own = [Path(f"{i:06d}.pt") for i in range(10)]
    dataset = [Path(f"tf_{i:06d}.pt") for i in range(20)]
    train, held = eagle3.split_held_out(sorted(own + dataset), 0.2)
    assert held == own[8:]
    assert set(train) == set(own[:8] + dataset[:8] + dataset[10:])
    assert eagle3.split_held_out(own, 0.2) == (own[:8], own[8:])  # as before there were two kinds
    assert eagle3.split_held_out(dataset, 0.1) == (dataset[:18], dataset[18:])


def test_the_model_card_says_which_answers_the_head_learnt_from(target_dir, tmp_path):
    target = target_config(target_dir)
    draft_ids = torch.arange(40)
    config = eagle3.head_config(target, len(draft_ids), 32)
    card = {"target": "tiny", "command": "c", "dataset": "sharegpt", "conversations": 9}
    card |= {"train_conversations": 7, "held_out_conversations": 1, "answer_tokens": 90}
    card |= {"draft_vocab_size": 40, "steps": 3, "tokens": 20, "seconds": 1.0, "ttt_steps": 3}
    card |= {"acceptance_untrained": [0.0], "acceptance": [0.1]}
    for mixed, words in ((0, "(self-distillation)."), (5, "and on 5 of the dataset's own answers")):
        model = eagle3.TrainableEagle3(config)
        eagle3.write_checkpoint(
            model,
            config,
            draft_ids,
            target.vocab_size,
            tmp_path,
            card | {"dataset_answer_conversations": mixed},
        )
        assert words in (tmp_path / "README.md").read_text()


def test_precision_names_the_training_steps_matmuls():
    assert not eagle3.autocast_of("float32")._enabled
    assert eagle3.autocast_of("bfloat16")._enabled
    assert eagle3.autocast_of("auto")._enabled == eagle3.bf16_matmuls()
    with pytest.raises(ValueError, match="--precision"):
        eagle3.autocast_of("float16")


def test_evaluation_sets_are_never_trained_on():
    for name in ("humaneval", "MT-Bench", "mixed", "codeedit", "longedit"):
        with pytest.raises(ValueError, match="evaluation set"):
            eagle3.training_prompts(name, 4)
    assert len(eagle3.training_prompts("gsm8k", 3)) == 3


@pytest.mark.slow
def test_a_tiny_run_learns_writes_a_loadable_head_and_stays_lossless(target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = [f"{p} {i}" for i in range(4) for p in PROMPTS]  # 20 conversations
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    out = tmp_path / "head"
    args = ["train-draft", "--model", str(target_dir), "--dtype", "float32", "--kv-cache-memory-gb", "0.02"]
    args += ["--dataset", str(prompts), "--num-prompts", "20", "--max-tokens", "24", "--output", str(out)]
    args += ["--draft-vocab-size", "96", "--epochs", "8", "--eval-every", "40", "--lr", "3e-3"]
    args += ["--holdout", "0.2", "--intermediate-size", "64", "--time-budget-min", "1"]
    assert main(args) == 0
    card = json.loads((out / "training_log.json").read_text())
    losses = [loss for _, loss in card["losses"]]
    assert sum(losses[-16:]) / 16 < 0.7 * sum(losses[:16]) / 16  # the loss falls
    assert card["acceptance"][0] > card["acceptance_untrained"][0] + 0.1  # and acceptance rises
    assert card["held_out_conversations"] == 4 and card["draft_vocab_size"] <= 96
    assert (out / "README.md").read_text().startswith("# EAGLE-3 head for")
    assert len(card["curve"]) >= 3  # held-out acceptance against training tokens

    # the head drives the engine: outputs stay the target's, and it drafts
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3}
    engine = make_engine(target_dir, speculative_config=spec)
    assert run_staggered(engine, PROMPTS, GREEDY) == run_alone(target_dir, PROMPTS)
    assert engine.stats()["spec"]["num_accepted_tokens"] > 0
    # seeded sampled requests emit plain decoding's draws, and the head's sampled drafts are kept
    sampled = SamplingParams(max_tokens=24, temperature=0.7, seed=7, ignore_eos=True)
    engine = make_engine(target_dir, speculative_config=spec)
    assert run_staggered(engine, PROMPTS, sampled) == run_alone(target_dir, PROMPTS, sampled)
    assert engine.stats()["spec"]["num_accepted_tokens"] > 0

    # a second run resumes: the data and the state are kept, nothing is generated again
    before = sorted(p.stat().st_mtime for p in (out / "data").glob("*.pt"))
    assert main(args) == 0
    assert sorted(p.stat().st_mtime for p in (out / "data").glob("*.pt")) == before

    # more data on a resumed run: the head is measured on the held-out set it has now before it
    # trains on (the curve's points say on how many conversations each was measured)
    steps = card["steps"]
    with prompts.open("a") as f:
        f.write("\n" + "\n".join(json.dumps({"prompt": f"{p} again"}) for p in PROMPTS))
    assert main([a if a != "20" else "25" for a in args]) == 0
    curve = json.loads((out / "training_log.json").read_text())["curve"]
    assert {"step": steps, "held_out": 4} in [{k: p[k] for k in ("step", "held_out")} for p in curve]
    assert {"step": steps, "held_out": 5} in [{k: p[k] for k in ("step", "held_out")} for p in curve]

    # --collect-only records more answers and leaves the head as it was
    state = (out / "train_state.pt").stat().st_mtime
    with prompts.open("a") as f:
        f.write("\n" + json.dumps({"prompt": "one more"}))
    assert main([a if a != "20" else "26" for a in args] + ["--collect-only"]) == 0
    assert len(list((out / "data").glob("*.pt"))) == 26 and (out / "train_state.pt").stat().st_mtime == state

    # as many held out as before (5), but not the same five: measured again before training on
    steps = json.loads((out / "training_log.json").read_text())["steps"]
    assert main([a if a != "20" else "26" for a in args]) == 0
    curve = json.loads((out / "training_log.json").read_text())["curve"]
    names = [p["held_out_names"] for p in curve if p["step"] == steps and p["held_out"] == 5]
    assert len(names) == 2 and names[0] != names[1]
