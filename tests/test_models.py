"""Tests for expstream.models.hf, .tiny and .passes: tiny offline models, loaders, generator and forward passes."""

from __future__ import annotations

import copy
import json
import math
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from expstream.models import hf as M  # noqa: E402
from expstream.models import passes as P  # noqa: E402
from expstream.models import tiny as T  # noqa: E402

TEXTS = [
    "What is 2 + 3? The answer is 5.",
    "hello world",
    "Unicode: é, ü, 中文, 😀 and tabs\tnewlines\n",
    "special <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
]


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tiny-models")
    return {"cache": cache, "paths": T.build_tiny_models(cache)}


@pytest.fixture(scope="session")
def loaded(tiny):
    p = tiny["paths"]
    return {
        "tok": M.load_tokenizer(p["tokenizer"], field="models.tokenizer"),
        "actor": M.load_causal_lm(p["actor"], field="models.actor"),
        "critic": M.load_critic(p["critic"], field="models.critic"),
        "reward": M.load_reward_model(p["reward"], field="models.reward"),
    }


def _padded_batch(rows, pad_id, num_actions=None, right=None):
    """Left-pad prompts and right-pad outputs like docs/numerics.md §1.1: rows are (prompt, output) pairs."""
    P = max(len(p) for p, _ in rows)
    A = num_actions if num_actions is not None else max(len(o) for _, o in rows)
    seqs, masks = [], []
    for p, o in rows:
        left = P - len(p)
        rpad = A - len(o)
        seqs.append([pad_id] * left + p + o + [pad_id] * rpad)
        masks.append([0] * left + [1] * (len(p) + len(o)) + [0] * rpad)
    return torch.tensor(seqs), torch.tensor(masks), A


def _samples(tok, gen_ids=((5, 9, 3), (7,), (11, 12, 13, 14, 15, 16))):
    prompts = [tok(t).input_ids for t in ("What is 2 + 3?", "hi", "Compute 4 * 5. Please think")]
    outs = [list(o) + [tok.eos_token_id] for o in gen_ids]
    return list(zip(prompts, outs, strict=True))


# ---------------------------------------------------------------------------------------------
# build + load
# ---------------------------------------------------------------------------------------------


def test_build_layout_and_marker(tiny):
    paths = tiny["paths"]
    assert set(paths) == {"tokenizer", "actor", "critic", "reward"}
    root = paths["actor"].parent
    marker = json.loads((root / "EXPSTREAM_COMPLETE.json").read_text())
    assert marker["hidden"] == 64 and marker["layers"] == 2 and marker["seed"] == 0
    assert marker["pad_token_id"] != marker["eos_token_id"]
    for key in ("actor", "critic", "reward"):
        assert (paths[key] / "config.json").is_file()
        assert (paths[key] / "model.safetensors").is_file()
        assert (paths[key] / "tokenizer.json").is_file()
    assert (paths["tokenizer"] / "tokenizer.json").is_file()
    assert not [p for p in tiny["cache"].iterdir() if ".tmp-" in p.name]


def test_build_twice_is_noop(tiny):
    before = {k: (p / "config.json").stat().st_mtime_ns for k, p in tiny["paths"].items() if k != "tokenizer"}
    files = {p: p.stat().st_mtime_ns for p in tiny["cache"].rglob("*") if p.is_file()}
    again = T.build_tiny_models(tiny["cache"])
    assert again == tiny["paths"]
    # a no-op, not a quick rebuild: not one file of the cache was written again, none added or removed
    assert {p: p.stat().st_mtime_ns for p in tiny["cache"].rglob("*") if p.is_file()} == files
    after = {k: (p / "config.json").stat().st_mtime_ns for k, p in again.items() if k != "tokenizer"}
    assert before == after


def test_build_racing_threads(tmp_path):
    results = []

    def worker():
        results.append(T.build_tiny_models(tmp_path, seed=3, hidden=32, layers=1))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and all(r == results[0] for r in results)
    root = results[0]["actor"].parent
    assert (root / "EXPSTREAM_COMPLETE.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [root.name]


def test_weights_deterministic_and_rng_untouched(tmp_path, tiny):
    state = torch.get_rng_state()
    other = T.build_tiny_models(tmp_path)
    assert torch.equal(state, torch.get_rng_state())
    a = M.load_causal_lm(tiny["paths"]["actor"]).state_dict()
    b = M.load_causal_lm(other["actor"]).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tokenizer_reload_round_trip(tiny, loaded):
    original = T.train_tokenizer()
    for src in (tiny["paths"]["tokenizer"], tiny["paths"]["actor"], tiny["paths"]["reward"]):
        tok = M.load_tokenizer(src)
        assert len(tok) == len(original) == 512
        for text in TEXTS:
            ids = tok(text, add_special_tokens=False).input_ids
            assert ids == original(text, add_special_tokens=False).input_ids
            assert tok.decode(ids) == text
    tok = loaded["tok"]
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    for special in T.SPECIAL_TOKENS:
        assert tok(special, add_special_tokens=False).input_ids == [tok.convert_tokens_to_ids(special)]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    batch = tok(["a", "a longer text"], padding=True)
    assert batch.input_ids[0][0] == tok.pad_token_id and batch.attention_mask[0][0] == 0


def test_loaded_models(loaded):
    tok = loaded["tok"]
    for key in ("actor", "critic", "reward"):
        model = loaded[key]
        assert not model.training
        assert not any(p.requires_grad for p in model.parameters())
        assert model.config.vocab_size == len(tok)
        assert model.config.pad_token_id == tok.pad_token_id
        assert model.config.eos_token_id == tok.eos_token_id
    gc = loaded["actor"].generation_config
    assert (gc.bos_token_id, gc.eos_token_id, gc.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert loaded["critic"].config.num_labels == 1 and loaded["reward"].config.num_labels == 1


@pytest.mark.parametrize(
    "loader, field",
    [
        (M.load_causal_lm, "models.actor"),
        (M.load_critic, "models.critic"),
        (M.load_reward_model, "models.reward"),
        (M.load_tokenizer, "models.tokenizer"),
    ],
)
def test_missing_model_dir_names_field(tmp_path, loader, field):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as exc:
        loader(missing, field=field)
    assert isinstance(exc.value, M.ModelNotFoundError)
    assert field in str(exc.value) and str(missing) in str(exc.value)


def test_dir_without_config_names_field(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(M.ModelNotFoundError, match="models.actor.*config.json"):
        M.load_causal_lm(tmp_path / "empty", field="models.actor")


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------


def _prompts(tok):
    return [tok(t, add_special_tokens=False).input_ids for t in ("What is 2 + 3?", "hi", "Compute 4 * 5.")]


def test_generate_shapes_and_groups(loaded):
    tok = loaded["tok"]
    gen = M.TransformersGenerator(loaded["actor"], tok)
    prompts = _prompts(tok)
    out = gen.generate(prompts, 4, max_new_tokens=12, seed=0)
    assert len(out) == 3 * 4
    assert all(isinstance(t, int) for row in out for t in row)
    for row in out:
        assert 1 <= len(row) <= 12
        assert row[-1] == tok.eos_token_id or len(row) == 12
        assert tok.eos_token_id not in row[:-1]
        assert tok.pad_token_id not in row
    # groups are contiguous: greedy rows of a group are equal, and equal the prompt generated alone
    greedy = gen.generate(prompts, 3, temperature=0, max_new_tokens=8)
    for g, p in enumerate(prompts):
        group = greedy[g * 3 : (g + 1) * 3]
        assert group[0] == group[1] == group[2]
        assert group[0] == gen.generate([p], 1, temperature=0, max_new_tokens=8)[0]  # padding-independent
    assert gen.generate([], 2) == []


def test_generate_seed_and_greedy_determinism(loaded):
    tok = loaded["tok"]
    gen = M.TransformersGenerator(loaded["actor"], tok)
    prompts = _prompts(tok)
    state = torch.get_rng_state()
    a = gen.generate(prompts, 3, max_new_tokens=10, seed=123)
    assert torch.equal(state, torch.get_rng_state())
    assert a == gen.generate(prompts, 3, max_new_tokens=10, seed=123)
    assert a != gen.generate(prompts, 3, max_new_tokens=10, seed=124)
    g1 = gen.generate(prompts, 2, temperature=0.0, max_new_tokens=10, seed=1)
    g2 = gen.generate(prompts, 2, temperature=0.0, max_new_tokens=10, seed=2)
    assert g1 == g2
    # top-k 1 is greedy too
    assert gen.generate(prompts, 2, top_k=1, max_new_tokens=10, seed=5) == g1
    assert gen.generate(prompts, 2, top_p=0.5, top_k=20, temperature=0.7, max_new_tokens=10, seed=5)


@pytest.fixture(scope="module")
def eos_prone(loaded):
    """The actor with a bias that makes EOS likely (~30 % a step) and the pad token very likely."""
    tok = loaded["tok"]
    model = copy.deepcopy(loaded["actor"])
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 5.0
        head.bias[tok.pad_token_id] = 20.0
    head.requires_grad_(False)
    model.lm_head = head
    return M.TransformersGenerator(model, tok)


def test_generate_stops_at_eos(eos_prone, loaded):
    tok = loaded["tok"]
    out = eos_prone.generate(_prompts(tok), 8, max_new_tokens=10, seed=0)
    assert len(out) == 24
    assert any(len(r) < 10 for r in out)  # some stop early at EOS
    for row in out:
        assert row[-1] == tok.eos_token_id or len(row) == 10
        assert tok.eos_token_id not in row[:-1]
        assert tok.pad_token_id not in row  # the pad token is suppressed
    longer = eos_prone.generate(_prompts(tok), 8, max_new_tokens=10, min_new_tokens=4, seed=0)
    assert all(len(r) >= 4 for r in longer)
    fixed = eos_prone.generate(_prompts(tok), 8, max_new_tokens=7, seed=0, ignore_eos=True)
    assert all(len(r) == 7 and tok.eos_token_id not in r for r in fixed)


def test_generate_top_k_off_by_default(loaded):
    """top_k=-1 really is off (transformers' global default would be top_k=50)."""
    tok = loaded["tok"]
    gen = M.TransformersGenerator(loaded["actor"], tok)
    prompt = _prompts(tok)[:1]
    free = {r[0] for r in gen.generate(prompt, 256, temperature=3.0, max_new_tokens=1, seed=0)}
    top5 = {r[0] for r in gen.generate(prompt, 256, temperature=3.0, top_k=5, max_new_tokens=1, seed=0)}
    assert len(free) > 60 and len(top5) <= 5


def _reference_behaviour_log_probs(model, tok, prompt, response, *, temperature, top_k, top_p, min_new_tokens,
                                   stop_ids, suppress_ids):
    """Independent of the generator: one forward over prompt + response, then the sampling
    distribution rebuilt by hand (a plain loop over steps) and the sampled token's log-prob read."""
    seq = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].double()  # (L, V)
    out = []
    for t, token in enumerate(response):
        z = logits[len(prompt) - 1 + t].clone()
        if temperature == 0:  # greedy: the plain softmax of the raw logits
            out.append(float(torch.log_softmax(z, -1)[token]))
            continue
        if t < min_new_tokens:
            z[list(stop_ids)] = -math.inf
        z[list(suppress_ids)] = -math.inf
        z = z / temperature
        if top_k > 0:
            kth = torch.sort(z, descending=True).values[top_k - 1]
            z[z < kth] = -math.inf
        if top_p < 1:
            probs = torch.softmax(z, -1)
            order = torch.argsort(probs, descending=True)
            above = 0.0  # probability mass of the tokens ranked before this one
            keep = torch.zeros_like(z, dtype=torch.bool)
            for i in order.tolist():
                if above >= top_p:
                    break
                keep[i] = True
                above += float(probs[i])
            z[~keep] = -math.inf
        out.append(float(torch.log_softmax(z, -1)[token]))
    return out


@pytest.mark.parametrize("which, kw", [
    ("plain", dict(temperature=1.0)),
    ("plain", dict(temperature=0.7)),
    ("plain", dict(temperature=0.7, top_k=20, top_p=0.9)),
    ("plain", dict(temperature=1.0, top_k=5)),
    ("plain", dict(temperature=0)),
    ("eos_prone", dict(temperature=1.0, min_new_tokens=3)),
    ("eos_prone", dict(temperature=1.3, top_p=0.8, min_new_tokens=2)),
])  # fmt: skip
def test_generate_behaviour_log_probs_match_the_sampled_distribution(which, kw, loaded, eos_prone):
    tok = loaded["tok"]
    gen = eos_prone if which == "eos_prone" else M.TransformersGenerator(loaded["actor"], tok)
    prompts = _prompts(tok)
    tokens, logps = gen.generate(prompts, 3, max_new_tokens=10, seed=11, return_log_probs=True, **kw)
    # the flag changes nothing about the tokens
    assert tokens == gen.generate(prompts, 3, max_new_tokens=10, seed=11, **kw)
    assert [len(r) for r in logps] == [len(r) for r in tokens]
    if which == "eos_prone":
        assert any(len(r) < 10 for r in tokens)  # early stops are covered
    full = dict(temperature=1.0, top_k=-1, top_p=1.0, min_new_tokens=1) | kw
    for i, (row, lp) in enumerate(zip(tokens, logps, strict=True)):
        ref = _reference_behaviour_log_probs(
            gen.model, tok, prompts[i // 3], row, temperature=full["temperature"], top_k=full["top_k"],
            top_p=full["top_p"], min_new_tokens=full["min_new_tokens"], stop_ids=gen.stop_token_ids,
            suppress_ids=gen.suppress_token_ids,
        )
        assert all(math.isfinite(x) and x <= 0 for x in lp)
        assert max(abs(a - b) for a, b in zip(lp, ref, strict=True)) < 1e-4, (i, lp, ref)
    if kw.get("temperature", 1.0) == 1.0 and which == "plain" and "top_k" not in kw:
        # at temperature 1 the sampled distribution is actor-logprob's softmax less the suppressed
        # tokens (pad; stop tokens before min_new_tokens), so each behaviour log-prob is a bit higher
        seq = torch.tensor([prompts[0] + tokens[0]])
        logp, _ = P.forward_action_log_probs(gen.model, seq, torch.ones_like(seq), len(tokens[0]))
        diff = torch.tensor(logps[0]) - logp[0]
        assert bool((diff > 0).all()) and float(diff.max()) < 0.05, diff


def test_generate_return_log_probs_empty_and_ignore_eos(loaded):
    tok = loaded["tok"]
    gen = M.TransformersGenerator(loaded["actor"], tok)
    assert gen.generate([], 2, return_log_probs=True) == ([], [])
    tokens, logps = gen.generate(_prompts(tok)[:1], 2, max_new_tokens=6, seed=1, ignore_eos=True,
                                 return_log_probs=True)
    assert [len(r) for r in tokens] == [6, 6] and [len(r) for r in logps] == [6, 6]


def test_generate_rejects_bad_arguments(loaded):
    gen = M.TransformersGenerator(loaded["actor"], loaded["tok"])
    with pytest.raises(ValueError):
        gen.generate([[1, 2]], 0)
    with pytest.raises(ValueError):
        gen.generate([[]], 1)
    with pytest.raises(ValueError):
        gen.generate([[1, 2]], 1, max_new_tokens=4, min_new_tokens=5)


# ---------------------------------------------------------------------------------------------
# forward passes
# ---------------------------------------------------------------------------------------------


def _reference_log_probs(model, seq, num_actions):
    """log_softmax of a plain, unpadded forward (default position ids), independent of the module."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    L = len(seq)
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([logp[L - 1 - num_actions + t, seq[L - num_actions + t]] for t in range(num_actions)])


def test_log_probs_match_plain_forward_and_padding(loaded):
    tok, actor = loaded["tok"], loaded["actor"]
    pad = tok.pad_token_id
    prompt, output = _samples(tok)[0]
    seq = prompt + output
    A = len(output)
    expected = _reference_log_probs(actor, seq, A)

    plain, ent = P.forward_action_log_probs(
        actor, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long), A
    )
    assert plain.shape == (1, A) and plain.dtype == torch.float32 and ent is None
    torch.testing.assert_close(plain[0], expected, atol=1e-5, rtol=0)

    for extra in (1, 5):
        seqs = torch.tensor([[pad] * extra + seq, [pad] * (extra + 3) + seq[3:]])
        mask = (torch.arange(seqs.shape[1]) >= torch.tensor([[extra], [extra + 3]])).long()
        logp, _ = P.forward_action_log_probs(actor, seqs, mask, A)
        torch.testing.assert_close(logp[0], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(logp[1], _reference_log_probs(actor, seq[3:], A), atol=1e-5, rtol=0)


def test_log_probs_mixed_batch_layout(loaded):
    """docs/numerics.md §1.1 layout (left-padded prompts, right-padded outputs): valid actions
    match per-row forwards."""
    tok, actor = loaded["tok"], loaded["actor"]
    rows = _samples(tok)
    seqs, mask, A = _padded_batch(rows, tok.pad_token_id)
    logp, ent = P.forward_action_log_probs(actor, seqs, mask, A, with_entropy=True)
    assert logp.shape == ent.shape == (len(rows), A)
    for b, (p, o) in enumerate(rows):
        torch.testing.assert_close(
            logp[b, : len(o)], _reference_log_probs(actor, p + o, len(o)), atol=1e-5, rtol=0
        )
    assert torch.all(ent > 0) and torch.all(ent <= math.log(len(tok)) + 1e-5)


def test_entropy_matches_definition(loaded):
    tok, actor = loaded["tok"], loaded["actor"]
    prompt, output = _samples(tok)[2]
    seq = prompt + output
    A = len(output)
    _, ent = P.forward_action_log_probs(
        actor, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long), A, True
    )
    with torch.no_grad():
        probs = torch.softmax(actor(torch.tensor([seq])).logits[0, -A - 1 : -1].double(), -1)
    expected = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(ent[0].double(), expected, atol=1e-5, rtol=0)
    assert torch.all(ent > 0) and torch.all(ent <= math.log(len(tok)))


def test_values_shape_and_padding(loaded):
    tok, critic = loaded["tok"], loaded["critic"]
    rows = _samples(tok)
    seqs, mask, A = _padded_batch(rows, tok.pad_token_id)
    values = P.forward_values(critic, seqs, mask, A)
    assert values.shape == (len(rows), A) and values.dtype == torch.float32
    for b, (p, o) in enumerate(rows):
        seq = p + o
        with torch.no_grad():
            plain = critic(torch.tensor([seq])).logits[0, :, 0]
        # V_t is the value at the state before action t: positions len(p)-1 .. len(seq)-2
        torch.testing.assert_close(values[b, : len(o)], plain[len(p) - 1 : len(seq) - 1], atol=1e-5, rtol=0)


def test_reward_independent_of_padding(loaded):
    tok, rm = loaded["tok"], loaded["reward"]
    rows = _samples(tok)
    seqs, mask, _ = _padded_batch(rows, tok.pad_token_id)
    scores = P.forward_reward(rm, seqs, mask)
    assert scores.shape == (len(rows),) and scores.dtype == torch.float32
    for b, (p, o) in enumerate(rows):
        seq = p + o
        single = P.forward_reward(rm, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
        with torch.no_grad():
            plain = rm(torch.tensor([seq])).logits[0, 0]
        torch.testing.assert_close(scores[b], single[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(scores[b], plain, atol=1e-5, rtol=0)
        extra = torch.tensor([[tok.pad_token_id] * 4 + seq])
        more = P.forward_reward(rm, extra, (extra != tok.pad_token_id).long())
        torch.testing.assert_close(more[0], plain, atol=1e-5, rtol=0)


def _packed(rows):
    seq, pos, lens, acts = [], [], [], []
    for p, o in rows:
        seq += p + o
        pos += list(range(len(p) + len(o)))
        lens.append(len(p) + len(o))
        acts.append(len(o))
    return torch.tensor([seq]), torch.tensor([pos]), lens, acts


def test_packed_equals_padded(loaded):
    tok = loaded["tok"]
    rows = _samples(tok)
    seqs, mask, A = _padded_batch(rows, tok.pad_token_id)
    psq, ppos, lens, acts = _packed(rows)

    logp, _ = P.forward_action_log_probs(loaded["actor"], seqs, mask, A)
    plogp = P.forward_packed_action_log_probs(loaded["actor"], psq, ppos, lens, acts)
    values = P.forward_values(loaded["critic"], seqs, mask, A)
    pvalues = P.forward_packed_values(loaded["critic"], psq, ppos, lens, acts)
    assert plogp.shape == pvalues.shape == (sum(acts),)
    assert plogp.dtype == pvalues.dtype == torch.float32
    valid = torch.cat([torch.arange(A) < a for a in acts]).reshape(len(rows), A)
    torch.testing.assert_close(plogp, logp[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(pvalues, values[valid], atol=1e-5, rtol=0)

    scores = P.forward_reward(loaded["reward"], seqs, mask)
    pscores = P.forward_packed_reward(loaded["reward"], psq, ppos, lens)
    assert pscores.shape == (len(rows),) and pscores.dtype == torch.float32
    torch.testing.assert_close(pscores, scores, atol=1e-5, rtol=0)


def test_packed_segments_do_not_attend_each_other(loaded):
    tok, actor = loaded["tok"], loaded["actor"]
    rows = _samples(tok)
    psq, ppos, lens, acts = _packed(rows)
    base = P.forward_packed_action_log_probs(actor, psq, ppos, lens, acts)
    # change the first segment's prompt: later segments must not move
    changed = psq.clone()
    changed[0, 0] = (changed[0, 0] + 1) % len(tok)
    other = P.forward_packed_action_log_probs(actor, changed, ppos, lens, acts)
    torch.testing.assert_close(other[acts[0] :], base[acts[0] :], atol=1e-6, rtol=0)


def test_forward_argument_checks(loaded):
    seq = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError):
        P.forward_action_log_probs(loaded["actor"], seq, torch.ones(1, 3, dtype=torch.long), 3)
    with pytest.raises(ValueError):
        P.forward_packed_action_log_probs(loaded["actor"], seq, torch.tensor([[0, 1, 2]]), [3], [3])
