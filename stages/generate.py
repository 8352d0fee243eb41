"""generate: prompts -> n sampled responses per prompt, with stable group and sample ids."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time

import numpy as np

from expstream.errors import PoisonRecordError
from expstream.models.decode_loop import InFlight, PartialGeneration
from expstream.models.resolve import model_dir
from expstream.models.vl import vision_for
from expstream.rl.admission import admission_id, backpressure_on, wait_for_admission
from expstream.rl.episodes import first_turn_fields, with_turn
from expstream.rl.versions import token_version_rows
from expstream.train.weights import follower_for, refresh_weights
from schemas import PromptBatch, Ragged, SampleBatch
from stages.context import BackToInput, StageContext


def setup(ctx: StageContext) -> None:
    from expstream.models.hf import TransformersGenerator, load_causal_lm, load_tokenizer

    topo = ctx.topology
    # a multi-turn replica runs two consumers (prompts, turns) on one model: generation and weight reloads
    # take turns (expstream/launch/replica.py turns_runner)
    ctx.models["model_lock"] = threading.RLock()
    tok = load_tokenizer(model_dir(topo, "tokenizer"))
    ctx.models["tokenizer"] = tok
    if topo.generate.backend == "vllm":
        from expstream.models.vllm_generator import VllmGenerator, VllmWeights, check_generate_config

        check_generate_config(topo.generate)
        gen = topo.generate
        actor = model_dir(topo, "actor")
        generator = VllmGenerator(actor, tok, seed=topo.run.seed, max_model_len=gen.vllm_max_model_len,
                                  kv_cache_gib=gen.vllm_kv_cache_gib)
        ctx.log.info("generate: vLLM engine for %s ready in %.2f s", actor, generator.startup_s)
        ctx.models["generator"] = generator
        # weights published by the trainer reload into the engine in place (VllmGenerator.reload)
        ctx.models["actor_follower"] = follower_for(ctx, "actor", VllmWeights(generator, actor))
        return
    if topo.generate.backend == "sglang":
        from expstream.models.sglang_generator import SglangGenerator, SglangWeights, check_generate_config

        check_generate_config(topo.generate)
        gen = topo.generate
        actor = model_dir(topo, "actor")
        generator = SglangGenerator(actor, tok, url=gen.sglang_url, python=gen.sglang_python,
                                    device=topo.models.device, seed=topo.run.seed)
        ctx.log.info("generate: SGLang server %s for %s ready in %.2f s", generator.url, actor, generator.startup_s)
        ctx.models["generator"] = generator
        # weights published by the trainer: /update_weights_from_disk, then /flush_cache (SglangGenerator.reload)
        ctx.models["actor_follower"] = follower_for(ctx, "actor", SglangWeights(generator, actor))
        return
    model = load_causal_lm(model_dir(topo, "actor"), device=topo.models.device)
    ctx.models["generator"] = TransformersGenerator(model, tok, device=topo.models.device)
    # a vision-language actor: images come back from the blob store (expstream/models/vl.py); None otherwise
    ctx.models["vision"] = vision_for(topo, model_dir(topo, "actor"), tok)
    # The continuous loop: follow the trainer's published actor versions (None otherwise).
    ctx.models["actor_follower"] = follower_for(ctx, "actor", model)


def teardown(ctx: StageContext) -> None:
    """Shut a vLLM engine or the replica's SGLang server down (a no-op for the transformers backend)."""
    close = getattr(ctx.models.get("generator"), "close", None)
    if close is not None:
        close()
        name = {"vllm": "vLLM", "sglang": "SGLang"}.get(ctx.topology.generate.backend, ctx.topology.generate.backend)
        ctx.log.info("generate: %s engine shut down", name)


def committed(batches: list, ctx: StageContext) -> None:
    """Stage hook (stages/commitgroup.py step 5): these prompt records are committed, so their samples are on
    their way; a rewind that reads one again regenerates it without counting it for admission again
    (expstream/rl/admission.py "Rewinds")."""
    if backpressure_on(ctx.topology):
        ctx.state.mark_delivered([admission_id(b.batch_id) for b in batches if isinstance(b, PromptBatch)])


def batch_seed(run_seed: int, batch_id: str) -> int:
    """A per-record sampling seed: the same record always samples the same responses."""
    digest = hashlib.sha256(f"{run_seed}:{batch_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


#: Where an image goes in a prompt: before the text, one block per image (the Qwen-VL convention).
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"


def tokenize_prompts(batch: PromptBatch, ctx: StageContext) -> list[list[int]]:
    gen = ctx.topology.generate
    tok = ctx.models["tokenizer"]
    vision = ctx.models.get("vision")
    images = batch.images or [[] for _ in batch.prompt_id]
    videos = batch.videos or [[] for _ in batch.prompt_id]
    if (any(images) or any(videos)) and vision is None:
        raise PoisonRecordError(f"PromptBatch.images/videos: models.actor ({ctx.topology.models.actor}) is not a "
                                "vision-language model; use one (e.g. builtin:tiny-vl) or drop the images")
    texts, grids_of = [], []
    for pid, text, refs, vrefs in zip(batch.prompt_id, batch.prompt, images, videos, strict=True):
        if not text or not text.strip():
            raise PoisonRecordError(f"PromptBatch.prompt[{pid}]: empty prompt; give every prompt some text")
        grids = vision.prompt_images(refs, f"prompt {pid}")[1] if refs else []
        vgrids = vision.prompt_videos(vrefs, f"prompt {pid}")[1] if vrefs else []
        text = IMAGE_BLOCK * len(refs) + VIDEO_BLOCK * len(vrefs) + text
        if gen.apply_chat_template and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        texts.append(text)
        grids_of.append((grids, vgrids))
    # one tokenizer call per record: the same ids as a call per prompt, at ~2/3 of the cost
    encoded = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for pid, refs, vrefs, (grids, vgrids), ids in zip(batch.prompt_id, images, videos, grids_of, encoded, strict=True):
        if refs:  # one image pad per image -> as many as its grid has merged patches
            ids = _expand_pads(ids, vision, vision.image_id, grids, pid)
        if vrefs:
            ids = _expand_pads(ids, vision, vision.video_id, vgrids, pid)
        if len(ids) > gen.prompt_max_len:
            if not gen.truncate_prompts:
                raise PoisonRecordError(
                    f"PromptBatch.prompt[{pid}]: {len(ids)} tokens > generate.prompt_max_len="
                    f"{gen.prompt_max_len}; shorten it, raise prompt_max_len, or set generate.truncate_prompts=true")
            ids = ids[: gen.prompt_max_len]
            need = sum(vision.tokens_for(g) for g in grids + vgrids) if refs or vrefs else 0
            if need and ids.count(vision.image_id) + ids.count(vision.video_id) != need:
                raise PoisonRecordError(
                    f"PromptBatch.prompt[{pid}]: its {len(refs)} images and {len(vrefs)} videos need {need} "
                    f"visual tokens but generate.prompt_max_len={gen.prompt_max_len} cuts them; raise prompt_max_len "
                    "(image tokens and grid must match)")
        out.append(list(ids))
    return out


def _expand_pads(ids: list[int], vision: object, pad: int, grids: list, pid: str) -> list[int]:
    if ids.count(pad) != len(grids):
        raise PoisonRecordError(f"PromptBatch.prompt[{pid}]: the text holds its own <|image_pad|>/<|video_pad|> "
                                "tokens; leave visual placeholders out of the prompt text (the stage adds them)")
    out: list[int] = []
    it = iter(grids)
    for t in ids:
        out.extend([pad] * vision.tokens_for(next(it)) if t == pad else [t])  # type: ignore[attr-defined]
    return out


def process(batch: PromptBatch | SampleBatch, ctx: StageContext) -> list[SampleBatch | BackToInput]:
    if ctx.topology.environment is not None and isinstance(batch, SampleBatch):  # an unfinished episode
        return [next_turn(batch, ctx)]
    if isinstance(batch, SampleBatch):  # a generation stopped by a replica that went away: continue it
        return [resume(batch, ctx)]
    if not isinstance(batch, PromptBatch):
        raise PoisonRecordError(f"generate: expected an expstream.PromptBatch, got {type(batch).__name__}; "
                                "only the prompt feeder writes to the input topic")
    gen = ctx.topology.generate
    n = gen.n_samples_per_prompt
    # Bounded staleness (expstream/rl/admission.py): reload newer weights and start only within the admission
    # bound, waiting otherwise. The version returned is the one loaded, admitted and stamped: the weights
    # are reloaded again before the generation ends only with generate.in_flight_updates (docs/async.md).
    lock = ctx.models.get("model_lock") or threading.RLock()
    version = wait_for_admission(ctx, batch.batch_id, len(batch) * n, refresh=lambda: _locked(lock, ctx))
    if ctx.metrics is not None:  # a prompt record has no version: show the one generating it (expstream/observe/metrics.py)
        ctx.metrics.policy_version.set(version)
    prompts = tokenize_prompts(batch, ctx)
    images = batch.images or [[] for _ in batch.prompt_id]
    videos = batch.videos or [[] for _ in batch.prompt_id]
    vision = ctx.models.get("vision")
    visual = None
    if any(images) or any(videos):
        rows, vrows = [r for r in images for _ in range(n)], [r for r in videos for _ in range(n)]
        rids = [f"{p}#{i}" for p in batch.prompt_id for i in range(n)]
        visual = lambda input_ids: vision.model_kwargs(input_ids, rows, rids, videos=vrows)  # noqa: E731
    in_flight = in_flight_for(ctx, version) if visual is None else None
    rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731 - groups are contiguous
    meta = dict(prompt_id=rep(batch.prompt_id), group_id=rep(batch.prompt_id),
                sample_index=[i for _ in batch.prompt_id for i in range(n)], prompt=rep(batch.prompt),
                label=rep(batch.label), reference=rep(batch.reference),
                **(_visual_fields(rep(images), rep(videos), vision) if any(images) or any(videos) else {}))
    try:
        with lock:
            outputs, logprobs = ctx.models["generator"].generate(
                prompts, n, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
                seed=batch_seed(ctx.topology.run.seed, batch.batch_id),
                should_stop=ctx.should_stop,  # SIGTERM abandons (or, resumable, hands back) a generation between tokens
                return_log_probs=True,  # behaviour log-probs for the trainer's off-policy correction
                **({"model_inputs": visual} if visual is not None else {}),
                **({"in_flight": in_flight} if in_flight is not None else {}),
                # FIRE (expstream/models/fire.py): the first token hot, the rest at temperature
                **({"first_token_temperature": gen.first_token_temperature} if gen.use_fire else {}),
            )
    except PartialGeneration as stop:  # generate.resumable: the prefix goes back to the input topic
        return [_partial(ctx, batch.batch_id, meta, rep(prompts), stop.tokens, stop.log_probs, stop.versions,
                         [int(version)] * len(meta["prompt_id"]))]
    return [_samples(ctx, batch.batch_id, meta, rep(prompts), outputs, logprobs, [int(version)] * len(outputs),
                     None if in_flight is None else in_flight.token_versions)]


def _locked(lock: threading.RLock, ctx: StageContext) -> int:
    with lock:
        return int(refresh_weights(ctx, "actor"))


def _samples(ctx: StageContext, batch_id: str, meta: dict, prompts: list, outputs: list, logprobs: list,
             versions: list[int], token_versions: list | None) -> SampleBatch:
    """The rollouts of one record: ``meta`` holds the per-sample ids and texts (and visual fields)."""
    tok = ctx.models["tokenizer"]
    return SampleBatch(
        batch_id=batch_id,
        policy_version=min(versions, default=0),
        n_samples_per_prompt=ctx.topology.generate.n_samples_per_prompt,
        eos_token_id=int(tok.eos_token_id),
        pad_token_id=int(tok.pad_token_id),
        response=tok.batch_decode(outputs, skip_special_tokens=ctx.topology.generate.skip_special_tokens),
        prompt_ids=_ragged(prompts, np.int32),
        response_ids=_ragged(outputs, np.int32),
        # response-level (B; o_b) until shard-preprocess aligns it with action_ids
        rollout_log_probs=_ragged(logprobs, np.float32),
        rollout_version=versions,  # the oldest token's: the version the record was admitted under
        # the version of every token when weights may change mid-generation (schema v5); absent otherwise
        token_versions=None if token_versions is None else _ragged(token_versions, np.int32),
        # a multi-turn run: the episodes' turn fields (docs/multi_turn.md); none in a single-turn run
        **(first_turn_fields(outputs, min(versions, default=0)) if ctx.topology.environment is not None else {}),
        **meta,
    )


def _partial(ctx: StageContext, batch_id: str, meta: dict, prompts: list, tokens: list, logprobs: list,
             token_versions: list, versions: list[int]) -> BackToInput:
    """A stopped generation as a record for the input topic: its prefix, to be continued by :func:`resume`."""
    ctx.log.info("generate batch=%s: stopped after %d tokens; its prefix goes back to %s to be continued by "
                 "whichever replica reads it", batch_id, max(map(len, tokens), default=0), ctx.stage.input)
    return BackToInput(_samples(ctx, batch_id, meta, prompts, tokens, logprobs, versions, token_versions))


def resume(partial: SampleBatch, ctx: StageContext) -> SampleBatch | BackToInput:
    """Continue a partial generation (docs/async.md "Resumable generations"): the same sample ids, the prefix's
    tokens, log-probs and versions kept, the continuation sampled with the weights loaded now. Not admitted
    again: the record was admitted under its ``rollout_version``, the version of its oldest token."""
    if partial.layout or partial.response_ids is None or partial.rollout_log_probs is None or not partial.rollout_version:
        raise PoisonRecordError(f"generate: SampleBatch {partial.batch_id!r} on the input topic is not a partial "
                                "generation (layout '', response_ids, rollout_log_probs, rollout_version); only "
                                "generate itself writes SampleBatches there")
    gen = ctx.topology.generate
    if gen.backend != "transformers":
        raise PoisonRecordError(f"generate: partial generation {partial.batch_id!r} needs generate.backend=transformers "
                                "to be continued (a vLLM replica cannot prefill a prefix); redrive it to a "
                                "transformers generate")
    prefix = [r.tolist() for r in partial.response_ids.rows()]
    prompts = [r.tolist() for r in partial.prompt_ids.rows()]
    in_flight = in_flight_for(ctx, refresh_weights(ctx, "actor"), resuming=True)
    longest = max(map(len, prefix), default=0)
    try:  # one row per sample (n=1): a split sub-batch need not hold whole groups
        rest, rest_lp = ctx.models["generator"].generate(
            prompts, 1, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
            max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
            seed=batch_seed(ctx.topology.run.seed, f"{partial.batch_id}@{longest}"), should_stop=ctx.should_stop,
            return_log_probs=True, in_flight=in_flight, prefix=prefix)
        rest_v, stopped = in_flight.token_versions, False
    except PartialGeneration as stop:
        rest, rest_lp, rest_v, stopped = stop.tokens, stop.log_probs, stop.versions, True
    old_v = token_version_rows(partial)
    tokens = [p + list(r) for p, r in zip(prefix, rest, strict=True)]
    logprobs = [r.tolist() + list(x) for r, x in zip(partial.rollout_log_probs.rows(), rest_lp, strict=True)]
    versions = [v.tolist() + list(x) for v, x in zip(old_v, rest_v, strict=True)]
    meta = {k: getattr(partial, k) for k in ("prompt_id", "group_id", "sample_index", "prompt", "label", "reference")}
    if stopped:
        return _partial(ctx, partial.batch_id, meta, prompts, tokens, logprobs, versions, partial.rollout_version)
    ctx.log.info("generate batch=%s: resumed a partial generation after %d tokens", partial.batch_id, longest)
    return _samples(ctx, partial.batch_id, meta, prompts, tokens, logprobs, partial.rollout_version, versions)


def next_turn(batch: SampleBatch, ctx: StageContext) -> SampleBatch:
    """One more model turn of each episode of a turns record (docs/multi_turn.md): the context is the
    episode's exact ids so far (prompt, model turns, observations), never re-tokenized; one sample per
    episode, seeded by the record's id; the behaviour log-probs and the version per model turn appended.
    The episode keeps the policy_version it was admitted under (admission accounting); turn_versions
    says which version generated each turn."""
    if batch.turn_lengths is None or batch.layout or batch.rollout_log_probs is None:
        raise PoisonRecordError(f"generate: {batch.batch_id} on the turns topic is not an unfinished episode "
                                "(turn_lengths and rollout_log_probs set, layout \"\"); only the environment stage "
                                "writes there")
    if batch.images or batch.videos:
        raise PoisonRecordError(f"generate: {batch.batch_id}: multi-turn episodes with images or videos are not "
                                "supported (docs/multi_turn.md); drop the environment block or the media")
    gen, tok = ctx.topology.generate, ctx.models["tokenizer"]
    lock = ctx.models.get("model_lock") or threading.RLock()
    contexts = [np.concatenate([p, r]).tolist() for p, r in zip(batch.prompt_ids.rows(), batch.response_ids.rows(),
                                                                 strict=True)]
    with lock:
        # admitted at its first turn: not counted again. The weights loaded now, not reloaded here: only the
        # prompt path reloads (in its admission), so a prompt's weights never change between its admission
        # and its generation (the turns consumer runs beside it in a multi-turn replica)
        follower = ctx.models.get("actor_follower")
        version = int(follower.version) if follower is not None else int(refresh_weights(ctx, "actor"))
        outputs, logprobs = ctx.models["generator"].generate(
            contexts, 1, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
            max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
            seed=batch_seed(ctx.topology.run.seed, batch.batch_id), should_stop=ctx.should_stop, return_log_probs=True)
    decode = lambda rows: tok.batch_decode(rows, skip_special_tokens=gen.skip_special_tokens)  # noqa: E731
    return with_turn(batch, outputs, logprobs, version, decode)


#: Why 0.2 s: as admission's poll (expstream/rl/admission.py): a newly announced version is loaded within 200 ms
#: of its announcement, and a generate replica asks Redis at most 5 times a second however fast it decodes.
IN_FLIGHT_POLL_S = 0.2


def in_flight_for(ctx: StageContext, version: int, resuming: bool = False) -> InFlight | None:
    """What the generator's decode loop needs (expstream/models/decode_loop.py): with
    ``generate.in_flight_updates``, a poll that loads newly announced weights between two decoding steps
    (docs/async.md "In-flight updates"); with ``generate.resumable``, a stop keeps the prefix. None when both
    are off (``model.generate``, as before), unless ``resuming`` a partial generation (the loop continues it)."""
    gen = ctx.topology.generate
    if not (gen.in_flight_updates or gen.resumable or resuming):
        return None
    polled = {"at": time.monotonic(), "version": int(version)}

    def poll() -> int:
        now = time.monotonic()
        if gen.in_flight_updates and now - polled["at"] >= IN_FLIGHT_POLL_S:
            polled["at"], polled["version"] = now, int(refresh_weights(ctx, "actor"))
        return polled["version"]

    return InFlight(poll=poll, version=int(version), mode=gen.in_flight_mode, keep_partial=gen.resumable)


def _ragged(rows: list, dtype: type) -> Ragged:
    """Rows of Python numbers as one Ragged, converted in one pass (``Ragged.from_rows`` converts and
    checks every row on its own: ~1 ms per field of a 256-sample record)."""
    lengths = np.fromiter(map(len, rows), np.int32, count=len(rows))
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype, count=int(lengths.sum()))
    return Ragged(values, lengths)


def _visual_fields(images: list[list[str]], videos: list[list[str]], vision: object) -> dict:
    """images/videos + their grids for the samples (the grids of their prompt's, from the cache)."""
    out: dict = {}
    for name, lists, fn in (("image", images, "image"), ("video", videos, "video")):
        if any(lists):
            grids = [np.asarray([x for ref in refs for x in getattr(vision, fn)(ref, ref)[1]], np.int32)
                     for refs in lists]
            out[f"{name}s"] = lists
            out[f"{name}_grid_thw"] = Ragged.from_rows(grids, "int32")
    return out
