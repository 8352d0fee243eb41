"""Rule reward functions usable as ``models.reward_fn`` (``module:function``).

Each is called as ``fn(queries, prompts, labels) -> list[float]``, one float per query, where a
query is the decoded prompt + response of one sample (as in LightRFT's custom reward functions).
"""

from __future__ import annotations


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
