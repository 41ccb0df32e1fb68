"""The built-in prompt sets: HumanEval, MT-Bench, their mix, and the code-editing set."""

from dynaspec.datasets import EDIT_INSTRUCTION, MATH_INSTRUCTION, load_prompts


def test_codeedit_shows_each_whole_humaneval_solution_and_asks_for_an_edit():
    edits, plain = load_prompts("codeedit", chat=True), load_prompts("humaneval", chat=False)
    assert len(edits) == len(plain) == 164
    (message,) = edits[0]
    assert message["role"] == "user" and message["content"].startswith(EDIT_INSTRUCTION)
    assert plain[0] in message["content"]  # the signature and docstring
    assert "return False" in message["content"]  # and the canonical body, which chat HumanEval hides
    assert load_prompts("code-edit", chat=False)[0] == message["content"]  # names normalise as others do


def test_mixed_alternates_code_and_chat():
    mixed, code, chat = load_prompts("mixed"), load_prompts("humaneval"), load_prompts("mtbench")
    assert mixed[:4] == [code[0], chat[0], code[1], chat[1]]


def test_gsm8k_is_the_bundled_training_slice_asked_step_by_step():
    chat, plain = load_prompts("gsm8k", chat=True), load_prompts("GSM8K", chat=False)
    assert len(chat) == len(plain) == 512
    (message,) = chat[0]
    assert message["content"].startswith(MATH_INSTRUCTION)
    assert "Natalia sold clips to 48 of her friends" in message["content"]  # train.jsonl's first problem
    assert plain[0].startswith("Question: Natalia") and plain[0].endswith("\nAnswer:")
    assert len(set(plain)) == 512


def test_longedit_puts_a_2000_token_module_before_each_codeedit_request():
    long, edits = load_prompts("longedit", chat=False), load_prompts("codeedit", chat=False)
    assert len(long) == len(edits) == 164
    assert all(len(p) > 8000 for p in long)
    assert long[0].endswith(edits[0].removeprefix(EDIT_INSTRUCTION).lstrip()) and EDIT_INSTRUCTION in long[0]
    assert long[0] != long[1] and "def " in long[0].split(EDIT_INSTRUCTION)[0]
