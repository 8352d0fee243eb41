"""Reward functions used by the tests through ``models.reward_fn`` (imported by path)."""


def label_length(queries, prompts, labels):
    return [float(len(label)) for label in labels]


def wrong_count(queries, prompts, labels):
    return [1.0]  # always one score: wrong when the batch has more than one sample


def first_char_code(queries, prompts, labels):
    """Deterministic but varied: rewards differ across samples of a group (used end to end)."""
    return [float(sum(q.encode()) % 7) for q in queries]


def constant_for_arithmetic(queries, prompts, labels):
    """Every sample of an arithmetic prompt scores 1.0 (a constant group); others vary."""
    return [1.0 if p.startswith("What is") else float(sum(q.encode()) % 5) for q, p in zip(queries, prompts, strict=True)]


def nan_for_poison(queries, prompts, labels):
    """NaN (a poisoned sample) for prompts that mention poison, 1.0 otherwise."""
    return [float("nan") if "poison" in p else 1.0 for p in prompts]


def wrong_signature(queries):
    """Takes one argument where reward functions take three: every call raises TypeError."""
    return [1.0 for _ in queries]


#: (labels, references) of every call of ``recorded_reference_length``: a test reads which rows it saw.
CALLS: list[tuple[list[str], list[str]]] = []


def recorded_reference_length(queries, prompts, labels, references):
    """len(reference) per sample; takes ``references``, so the reward stage passes them; records its calls."""
    CALLS.append((list(labels), list(references)))
    return [float(len(r)) for r in references]


def minus_prompt_length(queries, prompts, labels):
    return [-float(len(p)) for p in prompts]


def nan_aware_min(scores):
    """A custom ``rewards.combine``: the smallest score among the sources that scored each sample."""
    import numpy as np

    return np.nanmin(np.stack(list(scores.values())), axis=0)


def slow_with_gate(queries, prompts, labels):
    """A slow judge for the scaling tests (tests/test_scale.py): sleeps EXPSTREAM_TEST_REWARD_SLEEP_S
    per call; a prompt containing EXPSTREAM_TEST_HOLD_MARK waits until EXPSTREAM_TEST_GATE exists
    (at most 120 s), so that one record is held while the rest of the pipeline drains."""
    import os
    import time
    from pathlib import Path

    time.sleep(float(os.environ.get("EXPSTREAM_TEST_REWARD_SLEEP_S", "0")))
    mark, gate = os.environ.get("EXPSTREAM_TEST_HOLD_MARK"), os.environ.get("EXPSTREAM_TEST_GATE")
    if mark and gate and any(mark in p for p in prompts):
        deadline = time.monotonic() + 120
        while not Path(gate).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return [float(len(label)) for label in labels]


def image_count_and_width(queries, prompts, labels, images):
    """Receives each sample's images as PIL: the count plus the first image's width / 1000."""
    return [float(len(imgs)) + (imgs[0].size[0] / 1000 if imgs else 0.0) for imgs in images]
