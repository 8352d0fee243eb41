"""Reward functions served by `expstream serve-reward --fn` in tests/test_reward_http.py."""


def label_length(queries, prompts, labels):
    return [float(len(label)) for label in labels]


def reject_poison(queries, prompts, labels):
    """ValueError (-> HTTP 400 for that item) for prompts that mention poison; 1.0 for the others."""
    if any("poison" in p for p in prompts):
        raise ValueError("this prompt is poison")
    return [1.0 for _ in prompts]


def server_fault(queries, prompts, labels):
    """Fails on every call with a non-ValueError (-> HTTP 500, a server fault)."""
    raise RuntimeError("the judge crashed")


def exits_on_label(queries, prompts, labels):
    """A buggy reward function: label "exit" calls sys.exit, "interrupt" raises KeyboardInterrupt
    (BaseExceptions, not Exceptions); any other label scores its length."""
    import sys

    if "exit" in labels:
        sys.exit(3)
    if "interrupt" in labels:
        raise KeyboardInterrupt
    return [float(len(label)) for label in labels]
