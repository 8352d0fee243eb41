"""Rule reward functions usable as ``models.reward_fn`` (``module:function``).

Each is called as ``fn(queries, prompts, labels) -> list[float]``, one float per query, where a
query is the decoded prompt + response of one sample (as in LightRFT's custom reward functions).
"""

from __future__ import annotations

import re


def contains_label(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    """1.0 when the label text appears in the response part of the query, else 0.0."""
    out = []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        response = query.split(prompt, 1)[-1] if prompt and prompt in query else query
        out.append(1.0 if label and label in response else 0.0)
    return out


def response_length(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    """Characters in the query beyond the prompt, divided by 100: a dense toy reward."""
    return [max(len(q) - len(p), 0) / 100.0 for q, p in zip(queries, prompts, strict=True)]


#: The character ``target_char_rate`` rewards: common in the tiny tokenizer's vocabulary, so a
#: randomly initialised actor already samples it now and then and a learning loop can raise its rate.
TARGET_CHAR = "e"
_SPECIAL = re.compile(r"<\|[^|<>]*\|>")
#: Where the built-in chat template starts the assistant's turn (the response follows it).
_ASSISTANT = "<|im_start|>assistant\n"


def target_char_rate(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    """The share of the response's characters equal to ``TARGET_CHAR`` (special tokens such as
    ``<|im_end|>`` removed first; an empty response scores 0). The example task of the continuous
    loop (docs/async.md): dense, in [0, 1], and a policy gradient raises it within minutes."""
    out = []
    for query, prompt in zip(queries, prompts, strict=True):
        if _ASSISTANT in query:
            response = query.rsplit(_ASSISTANT, 1)[-1]
        else:
            response = query.split(prompt, 1)[-1] if prompt and prompt in query else query
        response = _SPECIAL.sub("", response)
        out.append(response.count(TARGET_CHAR) / len(response) if response else 0.0)
    return out


def reference_in_response(queries: list[str], prompts: list[str], labels: list[str],
                          references: list[str]) -> list[float]:
    """1.0 when the reference answer appears in the response part of the query, else 0.0: the rule
    checker of the recipe example (docs/reward.md "Sources and recipes"), where ``label`` names the
    task type (``math``) and ``reference`` holds the answer. Takes ``references``, so the reward
    stage passes them (expstream/rewards/sources.py FnSource)."""
    out = []
    for query, prompt, ref in zip(queries, prompts, references, strict=True):
        response = query.split(prompt, 1)[-1] if prompt and prompt in query else query
        out.append(1.0 if ref and ref in response else 0.0)
    return out
