"""Prompt sets: the bundled MT-Bench, HumanEval (and an editing set made from HumanEval's
solutions) and a slice of GSM8K's training split, or any local JSON/JSONL/text file."""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN = {
    "mtbench": DATA_DIR / "mt_bench.jsonl",
    "humaneval": DATA_DIR / "humaneval.jsonl",
    "gsm8k": DATA_DIR / "gsm8k_train.jsonl",  # the training split's first 512 problems, never its test split
}

Prompt = str | list[dict]  # plain text, or chat messages


MIXED = "mixed"  # the two built-in sets interleaved: code and chat traffic in one stream
CODEEDIT = "codeedit"  # edit a whole HumanEval function: the answer repeats most of the prompt
MATH_INSTRUCTION = (
    "Solve the following problem step by step. Give the final answer on the last line after '####'."
)
LONGEDIT = "longedit"  # codeedit's request after a module of other HumanEval solutions: >= 2,000 tokens
LONG_EDIT_CHARS = 8000  # the module's length before the function to edit (about 2,000 tokens)
EDIT_INSTRUCTION = (
    "Add input validation to the following Python function: at its start, raise a TypeError for an "
    "argument of the wrong type and a ValueError for an invalid value. Keep everything else exactly as "
    "it is. Reply with the complete function only."
)


def load_prompts(spec: str, chat: bool = True) -> list[Prompt]:
    """Prompts from a built-in set name (or ``mixed``: HumanEval and MT-Bench alternating) or a file.

    Files may be JSONL (one object per line), a JSON list, or plain text (one prompt per line).
    An object gives its prompt as ``messages`` (chat), ``prompt``, ``turns`` (first turn) or
    ``text``, or as a math ``question`` (GSM8K's field: asked to be solved step by step). With
    ``chat``, plain prompts become a single user message.
    """
    name = spec.lower().replace("-", "").replace("_", "")
    if name == MIXED:
        code, chat_prompts = load_prompts("humaneval", chat), load_prompts("mtbench", chat)
        return [p for pair in zip(code, chat_prompts) for p in pair]
    if name == CODEEDIT:
        return [_edit_prompt(item, chat) for item in _items(BUILTIN["humaneval"])]
    if name == LONGEDIT:
        return _long_edit_prompts(_items(BUILTIN["humaneval"]), chat)
    path = BUILTIN.get(name, Path(spec))
    if not path.is_file():
        raise ValueError(f"dataset: {spec!r} is neither a built-in set ({', '.join(BUILTIN)}) nor a file")
    items = _items(path)
    prompts = [_prompt(item, path, chat, is_humaneval=path == BUILTIN["humaneval"]) for item in items]
    if not prompts:
        raise ValueError(f"dataset: {path} holds no prompts")
    return prompts


def _items(path: Path) -> list:
    """A file's entries: a JSON list's elements, or one per non-empty line (a JSON object, or text)."""
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    items: list = []
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset: {path}: invalid JSON: {e}") from None
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"dataset: {path}:{n}: invalid JSON: {e}") from None
            else:
                items.append(line)
    return items


def _edit_prompt(item: dict, chat: bool) -> Prompt:
    """An editing request over a HumanEval problem's whole solution (prompt + canonical body)."""
    text = f"{EDIT_INSTRUCTION}\n\n```python\n{item['prompt']}{item['canonical_solution']}```"
    return [{"role": "user", "content": text}] if chat else text


def _long_edit_prompts(items: list[dict], chat: bool) -> list[Prompt]:
    """For each HumanEval problem: the solutions that follow it, run together into a module of at
    least LONG_EDIT_CHARS characters, then codeedit's request over the problem's own function
    (long-context traffic: the answer repeats a function the context holds)."""
    prompts = []
    for i, item in enumerate(items):
        module, j = "", i + 1
        while len(module) < LONG_EDIT_CHARS:
            other = items[j % len(items)]
            module += f"{other['prompt']}{other['canonical_solution']}\n\n"
            j += 1
        text = (
            f"Here is a Python module:\n\n```python\n{module}```\n\n{EDIT_INSTRUCTION}\n\n"
            f"```python\n{item['prompt']}{item['canonical_solution']}```"
        )
        prompts.append([{"role": "user", "content": text}] if chat else text)
    return prompts


def _prompt(item: object, path: Path, chat: bool, is_humaneval: bool) -> Prompt:
    if isinstance(item, str):
        text = item
    elif isinstance(item, dict) and isinstance(item.get("messages"), list):
        return item["messages"]
    elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
        text = item["prompt"]
        if is_humaneval and chat:
            text = f"Complete the following Python function. Reply with code only.\n\n```python\n{text}```"
    elif isinstance(item, dict) and isinstance(item.get("question"), str):
        text = (
            f"{MATH_INSTRUCTION}\n\n{item['question']}" if chat else f"Question: {item['question']}\nAnswer:"
        )
    elif isinstance(item, dict) and isinstance(item.get("turns"), list) and item["turns"]:
        text = item["turns"][0]
    elif isinstance(item, dict) and isinstance(item.get("text"), str):
        text = item["text"]
    else:
        raise ValueError(f"dataset: {path}: an entry has none of messages, prompt, question, turns, text")
    return [{"role": "user", "content": text}] if chat else text
