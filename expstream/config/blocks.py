"""The blocks of topology.yaml: one dataclass per block, each checking its own values.

``from_dict`` builds a block from its YAML map (unknown keys name the closest valid key, wrong types
the expected one); ``__post_init__`` checks the values with a message that says why and how to fix
it. The checks that need several blocks, and the topology itself, are in
:mod:`expstream.config.topology` (docs/topology.md lists every key).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from expstream.config.estimators import ESTIMATORS, KL_ESTIMATORS
from expstream.config.fieldtypes import check_block, check_fields
from expstream.config.storeurl import parse_store
from expstream.cpuslice import MAX_SLICE_MS, MIN_SLICE_MS, is_slice
from expstream.errors import ConfigError, unknown_key_error

#: train.off_policy choices (docs/async.md has each formula).
OFF_POLICY_MODES = ("none", "token_tis", "seq_tis", "decoupled")
BUILTIN_TINY = "builtin:tiny"
#: The tiny Qwen2-VL (expstream/models/vl.py); with it as models.actor, builtin:tiny roles use its tokenizer.
BUILTIN_TINY_VL = "builtin:tiny-vl"


def from_dict(cls: type, data: dict[str, Any] | None, where: str) -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys with a suggestion and values
    of the wrong type with the expected one (expstream.config.fieldtypes)."""
    data = check_block(data, where)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise unknown_key_error(where, key, sorted(names))
    return cls(**check_fields(cls, data, where))


def check_value(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


@dataclass
class RunConfig:
    seed: int = 1234
    prompt_batch_size: int = 2
    timeout_s: float = 900.0
    torch_threads: int = 1
    # the CPU slice of each stage's compute thread, ms (Linux >= 6.12; 0: the kernel's default, ~1-3 ms):
    # fewer switches between model stages on shared cores (expstream/cpuslice.py)
    cpu_slice_ms: float = 30.0
    max_restarts: int = 5
    spawn: str = "fork"
    # `expstream run` gives each replica its input partitions by index (no consumer-group join) until the
    # stage is first scaled (stages/assigning.py); false: every replica joins its group from the start;
    # null: true when the run starts its own broker, false with --bootstrap-servers (replicas started on
    # other machines may join the stages' groups there)
    assign_partitions: bool | None = None
    target_groups: int | None = None
    max_lost_group_share: float = 0.0
    # The claim-check store of images and video frames (expstream/models/blobs.py); null = <output>/blobs
    blob_store: str | None = None
    # Where a prompt file's image/video paths may lead (symlinks resolved); null = the prompt file's
    # directory (`expstream run --media-root DIR` sets it). expstream/models/media.py MediaPolicy
    media_root: str | None = None
    # The largest image or video item of a prompt file, in MiB; a larger one refuses its prompt
    media_max_mb: float = 64.0

    def __post_init__(self) -> None:
        share = self.max_lost_group_share
        if not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0.0 <= share <= 1.0):
            raise ConfigError(f"run.max_lost_group_share: got {share!r}; give a number from 0 to 1",
                              field="run.max_lost_group_share",
                              fix="0 fails the run when any fed prompt group is lost, 1 never fails it for losses")
        check_value(self.spawn in ("fork", "exec"), "run.spawn",
               f"got {self.spawn!r}; use fork (stages forked from a preloaded server) or exec")
        check_value(self.prompt_batch_size >= 1, "run.prompt_batch_size", "must be >= 1 (prompt groups per record)")
        check_value(self.torch_threads >= 1, "run.torch_threads", "must be >= 1")
        check_value(is_slice(self.cpu_slice_ms), "run.cpu_slice_ms",
                    f"got {self.cpu_slice_ms!r}; give 0 (the kernel's default slice) or {MIN_SLICE_MS}-{MAX_SLICE_MS} ms")
        check_value(self.assign_partitions in (None, True, False), "run.assign_partitions",
                    f"got {self.assign_partitions!r}; give true, false or null (true with the run's own broker)")
        check_value(self.media_max_mb > 0, "run.media_max_mb", f"got {self.media_max_mb!r}; give a size in MiB > 0")
        if self.blob_store is not None:
            parse_store(self.blob_store, "run.blob_store")  # `s3:` is an error, not a directory named `s3:`


@dataclass
class RedisConfig:
    group_ttl_s: int = 86400  # an unsettled group buffer (an abandoned run's) expires this long after its last write
    # ids of applied statistics and "done" markers of freed groups are kept this long (docs/async.md "What a long run keeps")
    dedupe_window_s: int = 600
    # before a stage commits its offsets, this many replicas acknowledge its state writes (WAIT); null: 1
    # where the primary has a replica, none where it has none (docs/redis.md "Durability")
    wait_replicas: int | None = None
    wait_timeout_ms: int = 1000  # one WAIT's timeout; asked again until the state's retry deadline

    def __post_init__(self) -> None:
        check_value(self.group_ttl_s >= 0, "redis.group_ttl_s", "must be >= 0 seconds (0: buffers never expire)")
        check_value(self.wait_replicas is None or self.wait_replicas >= 0, "redis.wait_replicas",
               "must be >= 0 replicas, or null (1 where the primary has a replica)")
        check_value(self.wait_timeout_ms >= 1, "redis.wait_timeout_ms", "must be >= 1 ms")
        check_value(self.dedupe_window_s >= 1, "redis.dedupe_window_s",
               "must be >= 1 second (how long a record read again is still known as applied)")


@dataclass
class ModelsConfig:
    cache_dir: str = ".cache/expstream/models"
    tokenizer: str = BUILTIN_TINY
    actor: str = BUILTIN_TINY
    reference: str | None = BUILTIN_TINY
    critic: str | None = BUILTIN_TINY
    reward: str | None = BUILTIN_TINY
    reward_fn: str | None = None
    reward_combine: str = "sum"
    device: str = "cpu"

    def __post_init__(self) -> None:
        # "no reward source at all" is a cross-field check: rewards.sources may name them instead
        check_value(
            self.reward_combine in ("sum", "mean", "model", "fn"),
            "models.reward_combine",
            f"got {self.reward_combine!r}; use one of sum, mean, model, fn",
        )
        if self.reward_fn is not None:
            check_value(
                ":" in self.reward_fn,
                "models.reward_fn",
                f"got {self.reward_fn!r}; write it as 'package.module:function'",
            )


@dataclass
class GenerateConfig:
    backend: str = "transformers"
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 16
    min_new_tokens: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    prompt_max_len: int = 64
    truncate_prompts: bool = True
    skip_special_tokens: bool = False
    apply_chat_template: bool = True
    # backend=vllm only (docs/vllm.md): the engine's longest sequence (sizes its KV cache), and the
    # CPU backend's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, unless that is set in the environment)
    vllm_max_model_len: int = 512
    vllm_kv_cache_gib: int = 1
    # in-flight weight updates (docs/async.md "In-flight updates"): a newly announced policy version is loaded
    # between two decoding steps; keep: the KV cache stays, recompute: prompt + tokens so far are prefilled again
    in_flight_updates: bool = False
    in_flight_mode: str = "keep"
    # a generation stopped by SIGTERM / scale-down goes back to the input topic with its prefix (tokens, versions,
    # log-probs) and whichever replica reads it continues from there (docs/async.md "Resumable generations")
    resumable: bool = False
    # backend=sglang only (docs/sglang.md): a running server to use instead of one per replica, and the
    # SGLang environment's python that starts one (None: .venv-sglang of the checkout)
    sglang_url: str | None = None
    sglang_python: str | None = None
    # FIRE sampling (expstream/models/fire.py): the first response token at first_token_temperature
    use_fire: bool = False
    first_token_temperature: float = 10.0

    def __post_init__(self) -> None:
        check_value(self.in_flight_mode in ("keep", "recompute"), "generate.in_flight_mode",
               f"got {self.in_flight_mode!r}; use keep (the KV cache stays) or recompute (re-prefill)")
        check_value(self.backend in ("transformers", "vllm", "sglang"), "generate.backend",
               f"got {self.backend!r}; use transformers (default), vllm (after `make setup-vllm`) or sglang "
               "(after `make setup-sglang`)")
        check_value(self.first_token_temperature > 0, "generate.first_token_temperature", "must be > 0")
        check_value(not self.use_fire or self.temperature > 0, "generate.use_fire",
               "FIRE samples the first token hot and the rest at generate.temperature, which must then be > 0 "
               "(set use_fire: false for greedy decoding)")
        check_value(self.sglang_url is None or str(self.sglang_url).startswith(("http://", "https://")),
               "generate.sglang_url", f"got {self.sglang_url!r}; write it as http://host:port")
        check_value(self.vllm_max_model_len >= 2, "generate.vllm_max_model_len", "must be >= 2 tokens")
        check_value(isinstance(self.vllm_kv_cache_gib, int) and self.vllm_kv_cache_gib >= 1, "generate.vllm_kv_cache_gib", "must be a whole number of GiB >= 1 (vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer)")
        check_value(self.n_samples_per_prompt >= 1, "generate.n_samples_per_prompt", "must be >= 1")
        check_value(self.max_new_tokens >= 1, "generate.max_new_tokens", "must be >= 1")
        check_value(0 <= self.min_new_tokens <= self.max_new_tokens, "generate.min_new_tokens",
               "must be between 0 and generate.max_new_tokens")
        check_value(self.temperature >= 0, "generate.temperature", "must be >= 0 (0 means greedy)")
        check_value(0 < self.top_p <= 1, "generate.top_p", "must be in (0, 1]")
        check_value(self.prompt_max_len >= 1, "generate.prompt_max_len", "must be >= 1")


@dataclass
class AlgoConfig:
    advantage_estimator: str = "group_norm"
    micro_rollout_batch_size: int = 8
    gamma: float = 1.0
    lambd: float = 0.95
    init_kl_coef: float = 0.01
    kl_estimator: str = "k3"
    kl_target: float | None = None
    kl_horizon: int = 10000
    use_kl_loss: bool | None = None  # None: resolved on load to train.enabled (resolve_kl_placement)
    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = False
    reward_clip: float = 0.0
    advantage_clip: float = 0.0
    advantages_norm: bool = False
    overlong_buffer: bool = False
    overlong_buffer_len: int = 8
    overlong_buffer_penalty_factor: float = 1.0
    dynamic_sampling: bool = False
    high_entropy_token_ratio: float = 0.0
    packing_samples: bool = False
    advantage_cross_batch_norm: str = "none"
    rollout_batch_size: int = 16
    dynamic_sampling_over_provision: float = 0.0

    def __post_init__(self) -> None:
        check_value(self.advantage_cross_batch_norm in ("none", "window", "running"), "algo.advantage_cross_batch_norm",
               f"got {self.advantage_cross_batch_norm!r}; use none, window or running")
        check_value(self.rollout_batch_size >= 1, "algo.rollout_batch_size", "must be >= 1")
        check_value(self.dynamic_sampling_over_provision >= 0, "algo.dynamic_sampling_over_provision",
               "must be >= 0 (0.25 feeds 25% more prompts)")
        check_value(self.advantage_estimator in ESTIMATORS, "algo.advantage_estimator",
               f"got {self.advantage_estimator!r}; use one of {', '.join(ESTIMATORS)}")
        check_value(self.kl_estimator in KL_ESTIMATORS, "algo.kl_estimator",
               f"got {self.kl_estimator!r}; use k1, k2 or k3")
        check_value(self.micro_rollout_batch_size >= 1, "algo.micro_rollout_batch_size", "must be >= 1")
        check_value(0 <= self.gamma <= 1, "algo.gamma", "must be in [0, 1]")
        check_value(0 <= self.lambd <= 1, "algo.lambd", "must be in [0, 1]")
        check_value(self.reward_clip >= 0, "algo.reward_clip", "must be >= 0 (0 switches clipping off)")
        check_value(self.advantage_clip >= 0, "algo.advantage_clip", "must be >= 0 (0 switches clipping off)")
        check_value(self.overlong_buffer_len >= 1, "algo.overlong_buffer_len", "must be >= 1")
        check_value(0 <= self.high_entropy_token_ratio < 1, "algo.high_entropy_token_ratio",
               "must be in [0, 1); 0 switches it off")
        check_value(self.kl_target is None or self.kl_target > 0, "algo.kl_target",
               "must be > 0, or null for the fixed KL controller")


@dataclass
class TrainConfig:
    """The reference trainer of the continuous loop (``expstream train``; docs/async.md)."""

    enabled: bool = False  # true: `expstream run` keeps feeding epochs and runs the trainer (= --continuous)
    max_steps: int = 60  # optimisation steps, then the run stops cleanly
    batch_size: int = 16  # samples per optimisation step; a multiple of run.prompt_batch_size x n
    lr: float = 5e-3  # Adam learning rate (the tiny built-in models learn within 30 steps at this rate)
    max_grad_norm: float = 1.0  # gradient clipping; 0 switches it off
    clip_eps: float = 0.2  # PPO-clip epsilon
    kl_loss_coef: float = 0.1  # KL-in-loss weight, used when algo.use_kl_loss is true (docs/async.md "Stability")
    off_policy: str = "none"  # none | token_tis | seq_tis | decoupled (docs/async.md)
    old_log_probs: str = "recompute"  # recompute: π_old = the trainer's weights at the step; stage: actor-logprob's
    is_cap: float = 2.0  # C, the truncation cap of token_tis / seq_tis / decoupled
    train_critic: bool = True  # with gae: train and publish the critic too
    critic_lr: float = 1e-3
    checkpoint_every: int = 1  # steps between checkpoints (offsets are committed only after one)
    weight_store: str | None = None  # a directory or s3://BUCKET/PREFIX; null = <run output>/weights
    # versions the weight store keeps: null = async.max_staleness + 1 (the staleness window); N = the N
    # newest (never fewer than max_staleness + 1); 0 = every version. The latest checkpoint's is always kept.
    keep_versions: int | None = None

    def __post_init__(self) -> None:
        check_value(self.max_steps >= 1, "train.max_steps", "must be >= 1")
        check_value(self.batch_size >= 1, "train.batch_size", "must be >= 1 (samples per optimisation step)")
        check_value(self.lr > 0, "train.lr", "must be > 0")
        check_value(self.critic_lr > 0, "train.critic_lr", "must be > 0")
        check_value(self.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0 switches clipping off)")
        check_value(self.clip_eps > 0, "train.clip_eps", "must be > 0, e.g. 0.2")
        check_value(self.kl_loss_coef >= 0, "train.kl_loss_coef", "must be >= 0")
        check_value(self.off_policy in OFF_POLICY_MODES, "train.off_policy",
               f"got {self.off_policy!r}; use one of {', '.join(OFF_POLICY_MODES)}")
        check_value(self.old_log_probs in ("recompute", "stage"), "train.old_log_probs",
               f"got {self.old_log_probs!r}; use recompute (the trainer's current weights) or stage (actor-logprob's)")
        check_value(self.is_cap >= 1, "train.is_cap", "must be >= 1 (the importance-weight cap C)")
        check_value(self.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1")
        check_value(self.keep_versions is None or self.keep_versions >= 0, "train.keep_versions",
               "must be null (the staleness window: async.max_staleness + 1), N >= 1 (the N newest) or 0 (all)")
        if self.weight_store is not None:
            parse_store(self.weight_store, "train.weight_store")


@dataclass
class AsyncConfig:
    """Bounded staleness between generation and training (the ``async:`` block; docs/async.md)."""

    max_staleness: int = 2  # k: a sample generated by policy version v is trained at step u <= v + k
    on_stale: str = "backpressure"  # backpressure: generate waits; drop: the trainer drops (counted, logged)
    straggler_timeout_s: float = 120.0  # the trainer stops waiting for an admitted sample after this long

    def __post_init__(self) -> None:
        check_value(self.max_staleness >= 0, "async.max_staleness", "must be >= 0 (0 is the synchronous shape)")
        check_value(self.on_stale in ("backpressure", "drop"), "async.on_stale",
               f"got {self.on_stale!r}; use backpressure (generate waits) or drop (the trainer drops, counted)")
        check_value(self.straggler_timeout_s > 0, "async.straggler_timeout_s", "must be > 0 seconds")


@dataclass
class RecordConfig:
    """What the run records into ``<output>/topics/`` (the ``record:`` block; docs/replay.md "Recording")."""

    enabled: bool | None = None  # null: on when `expstream run` starts its own broker, off with --bootstrap-servers
    topics: list[str] | None = None  # null: every topology topic, its .dlq twin and `policy`; or these names
    # null: unbounded. Bounds on the recording, the oldest records dropped first (expstream/tools/retention.py)
    max_bytes: int | None = None  # the partition files together; trimmed to 3/4 of it once over
    max_age_s: float | None = None  # records older than this (broker timestamp) are dropped

    def __post_init__(self) -> None:
        for name, kinds, e_g in (("max_bytes", int, "1073741824 (1 GiB)"), ("max_age_s", (int, float), "86400")):
            v = getattr(self, name)
            check_value(v is None or (isinstance(v, kinds) and not isinstance(v, bool) and v > 0), f"record.{name}",
                        f"{v!r} is not a positive number; give e.g. {e_g}, or null for no bound")
        if self.topics is not None:
            check_value(len(self.topics) > 0, "record.topics",
                   "an empty list records nothing; give topic names, null for every topic, or set record.enabled=false")
            for t in self.topics:
                check_value(bool(t) and "/" not in t and t not in (".", ".."), "record.topics",
                       f"{t!r} cannot name a topic (nor a recording folder)")

    def is_on(self, own_broker: bool) -> bool:
        """Whether `expstream run` records, given whether it started its own broker."""
        return own_broker if self.enabled is None else bool(self.enabled)


@dataclass
class AutoscaleConfig:
    """``stages.<name>.autoscale``: the replica count follows the input topic's consumer lag
    (expstream/launch/scale.py ``desired_replicas``). Lag is counted in records (micro-batches)."""

    min: int = 1
    max: int = 4
    target_lag_per_replica: float = 4.0  # uncommitted input records one replica may have waiting
    cooldown_s: float = 20.0  # between two changes; also how long the lag must stay low before a scale-down
    where: str = ""  # filled by the loader: "stages.<name>.autoscale", for messages

    def __post_init__(self) -> None:
        w = self.where or "autoscale"
        if self.min < 1:
            raise ConfigError(f"{w}.min: {self.min} replicas", field=f"{w}.min", fix="give 1 or more")
        if self.max < self.min:
            raise ConfigError(f"{w}.max: {self.max} is below min {self.min}", field=f"{w}.max",
                              fix=f"give a max of at least {self.min}")
        if not self.target_lag_per_replica > 0:
            raise ConfigError(f"{w}.target_lag_per_replica: {self.target_lag_per_replica}",
                              field=f"{w}.target_lag_per_replica",
                              fix="give a positive number of input records per replica, e.g. 4")
        if self.cooldown_s < 0:
            raise ConfigError(f"{w}.cooldown_s: {self.cooldown_s}", field=f"{w}.cooldown_s",
                              fix="give 0 or more seconds, e.g. 20")


@dataclass
class StageConfig:
    output: str = ""
    replicas: int = 1
    enabled: bool = True
    autoscale: AutoscaleConfig | None = None  # null = the replica count changes only by `expstream scale`
    name: str = ""
    input: str = ""  # filled by the loader: the previous enabled stage's output

    def __post_init__(self) -> None:
        check_value(self.replicas >= 1, f"stages.{self.name}.replicas", "must be >= 1")
        auto = self.autoscale
        if auto is not None and not auto.min <= self.replicas <= auto.max:
            raise ConfigError(f"stages.{self.name}.replicas: {self.replicas} is outside autoscale's "
                              f"[{auto.min}, {auto.max}]", field=f"stages.{self.name}.replicas",
                              fix=f"start with a count from {auto.min} to {auto.max}")

    @property
    def max_replicas(self) -> int:
        """The most replicas this stage may ever run: its input topic gets at least this many partitions."""
        return max(self.replicas, self.autoscale.max if self.autoscale else 1)


@dataclass
class TopicsConfig:
    input: str = "prompts"
    partitions: int = 8  # room to scale live: a stage runs at most as many replicas as its input has partitions

    def __post_init__(self) -> None:
        check_value(self.partitions >= 1, "topics.partitions", "must be >= 1")
