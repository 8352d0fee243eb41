"""topology.yaml -> typed, validated configuration.

One dataclass per block. Unknown keys are errors that name the closest valid key; values are
checked in ``__post_init__`` with a message that says why and how to fix it. The loader also
switches stages off (no critic unless the estimator is ``gae``, no reference when
``init_kl_coef`` is 0) and re-links the chain, so stages never test for their neighbours.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from expstream.config.chains import Unit, check_chains, parse_chains, units
from expstream.config.estimators import ESTIMATORS, GROUP_ESTIMATORS, KL_ESTIMATORS
from expstream.config.fieldtypes import check_block, check_fields
from expstream.config.kafka import KafkaConfig
from expstream.config.overrides import FREE_FORM, parse_override, set_dotted
from expstream.config.rawform import BLOCK_ATTRS, topology_raw  # noqa: F401  (BLOCK_ATTRS re-exported)
from expstream.config.redaction import apply_secrets, env_topology_secrets
from expstream.config.rewards import RewardsConfig, RewardSourceConfig  # noqa: F401  (the rewards block, re-exported)
from expstream.errors import ConfigError, unknown_key_error

#: train.off_policy choices (docs/async.md has each formula).
OFF_POLICY_MODES = ("none", "token_tis", "seq_tis", "decoupled")
STAGE_ORDER: tuple[str, ...] = (
    "generate",
    "shard-preprocess",
    "actor-logprob",
    "reference",
    "critic",
    "reward",
    "postprocess",
    "advantage",
)
BUILTIN_TINY = "builtin:tiny"
#: The tiny Qwen2-VL (expstream/models/vl.py); with it as models.actor, builtin:tiny roles use its tokenizer.
BUILTIN_TINY_VL = "builtin:tiny-vl"
# The file `expstream` reads from the current directory when no --topology is given.
LOCAL_TOPOLOGY = "topology.yaml"
# How Topology.source names the copy shipped inside the package (the repository root's file).
PACKAGED_SOURCE = "packaged expstream/topology.yaml"

log = logging.getLogger("expstream.topology")


def _from_dict(cls: type, data: dict[str, Any] | None, where: str) -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys with a suggestion and values
    of the wrong type with the expected one (expstream.config.fieldtypes)."""
    data = check_block(data, where)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise unknown_key_error(where, key, sorted(names))
    return cls(**check_fields(cls, data, where))


def _check(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


@dataclass
class RunConfig:
    seed: int = 1234
    prompt_batch_size: int = 2
    timeout_s: float = 900.0
    torch_threads: int = 1
    max_restarts: int = 5
    spawn: str = "fork"
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
        _check(self.spawn in ("fork", "exec"), "run.spawn",
               f"got {self.spawn!r}; use fork (stages forked from a preloaded server) or exec")
        _check(self.prompt_batch_size >= 1, "run.prompt_batch_size", "must be >= 1 (prompt groups per record)")
        _check(self.torch_threads >= 1, "run.torch_threads", "must be >= 1")
        _check(self.media_max_mb > 0, "run.media_max_mb", f"got {self.media_max_mb!r}; give a size in MiB > 0")


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
        _check(self.group_ttl_s >= 0, "redis.group_ttl_s", "must be >= 0 seconds (0: buffers never expire)")
        _check(self.wait_replicas is None or self.wait_replicas >= 0, "redis.wait_replicas",
               "must be >= 0 replicas, or null (1 where the primary has a replica)")
        _check(self.wait_timeout_ms >= 1, "redis.wait_timeout_ms", "must be >= 1 ms")
        _check(self.dedupe_window_s >= 1, "redis.dedupe_window_s",
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
        _check(
            self.reward_combine in ("sum", "mean", "model", "fn"),
            "models.reward_combine",
            f"got {self.reward_combine!r}; use one of sum, mean, model, fn",
        )
        if self.reward_fn is not None:
            _check(
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

    def __post_init__(self) -> None:
        _check(self.backend in ("transformers", "vllm"), "generate.backend",
               f"got {self.backend!r}; use transformers (default) or vllm (after `make setup-vllm`)")
        _check(self.vllm_max_model_len >= 2, "generate.vllm_max_model_len", "must be >= 2 tokens")
        _check(isinstance(self.vllm_kv_cache_gib, int) and self.vllm_kv_cache_gib >= 1, "generate.vllm_kv_cache_gib", "must be a whole number of GiB >= 1 (vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer)")
        _check(self.n_samples_per_prompt >= 1, "generate.n_samples_per_prompt", "must be >= 1")
        _check(self.max_new_tokens >= 1, "generate.max_new_tokens", "must be >= 1")
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "generate.min_new_tokens",
               "must be between 0 and generate.max_new_tokens")
        _check(self.temperature >= 0, "generate.temperature", "must be >= 0 (0 means greedy)")
        _check(0 < self.top_p <= 1, "generate.top_p", "must be in (0, 1]")
        _check(self.prompt_max_len >= 1, "generate.prompt_max_len", "must be >= 1")


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
        _check(self.advantage_cross_batch_norm in ("none", "window", "running"), "algo.advantage_cross_batch_norm",
               f"got {self.advantage_cross_batch_norm!r}; use none, window or running")
        _check(self.rollout_batch_size >= 1, "algo.rollout_batch_size", "must be >= 1")
        _check(self.dynamic_sampling_over_provision >= 0, "algo.dynamic_sampling_over_provision",
               "must be >= 0 (0.25 feeds 25% more prompts)")
        _check(self.advantage_estimator in ESTIMATORS, "algo.advantage_estimator",
               f"got {self.advantage_estimator!r}; use one of {', '.join(ESTIMATORS)}")
        _check(self.kl_estimator in KL_ESTIMATORS, "algo.kl_estimator",
               f"got {self.kl_estimator!r}; use k1, k2 or k3")
        _check(self.micro_rollout_batch_size >= 1, "algo.micro_rollout_batch_size", "must be >= 1")
        _check(0 <= self.gamma <= 1, "algo.gamma", "must be in [0, 1]")
        _check(0 <= self.lambd <= 1, "algo.lambd", "must be in [0, 1]")
        _check(self.reward_clip >= 0, "algo.reward_clip", "must be >= 0 (0 switches clipping off)")
        _check(self.advantage_clip >= 0, "algo.advantage_clip", "must be >= 0 (0 switches clipping off)")
        _check(self.overlong_buffer_len >= 1, "algo.overlong_buffer_len", "must be >= 1")
        _check(0 <= self.high_entropy_token_ratio < 1, "algo.high_entropy_token_ratio",
               "must be in [0, 1); 0 switches it off")
        _check(self.kl_target is None or self.kl_target > 0, "algo.kl_target",
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
    weight_store: str | None = None  # a directory; null = <run output>/weights
    # versions the weight store keeps: null = async.max_staleness + 1 (the staleness window); N = the N
    # newest (never fewer than max_staleness + 1); 0 = every version. The latest checkpoint's is always kept.
    keep_versions: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_steps >= 1, "train.max_steps", "must be >= 1")
        _check(self.batch_size >= 1, "train.batch_size", "must be >= 1 (samples per optimisation step)")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(self.critic_lr > 0, "train.critic_lr", "must be > 0")
        _check(self.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0 switches clipping off)")
        _check(self.clip_eps > 0, "train.clip_eps", "must be > 0, e.g. 0.2")
        _check(self.kl_loss_coef >= 0, "train.kl_loss_coef", "must be >= 0")
        _check(self.off_policy in OFF_POLICY_MODES, "train.off_policy",
               f"got {self.off_policy!r}; use one of {', '.join(OFF_POLICY_MODES)}")
        _check(self.old_log_probs in ("recompute", "stage"), "train.old_log_probs",
               f"got {self.old_log_probs!r}; use recompute (the trainer's current weights) or stage (actor-logprob's)")
        _check(self.is_cap >= 1, "train.is_cap", "must be >= 1 (the importance-weight cap C)")
        _check(self.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1")
        _check(self.keep_versions is None or self.keep_versions >= 0, "train.keep_versions",
               "must be null (the staleness window: async.max_staleness + 1), N >= 1 (the N newest) or 0 (all)")


@dataclass
class AsyncConfig:
    """Bounded staleness between generation and training (the ``async:`` block; docs/async.md)."""

    max_staleness: int = 2  # k: a sample generated by policy version v is trained at step u <= v + k
    on_stale: str = "backpressure"  # backpressure: generate waits; drop: the trainer drops (counted, logged)
    straggler_timeout_s: float = 120.0  # the trainer stops waiting for an admitted sample after this long

    def __post_init__(self) -> None:
        _check(self.max_staleness >= 0, "async.max_staleness", "must be >= 0 (0 is the synchronous shape)")
        _check(self.on_stale in ("backpressure", "drop"), "async.on_stale",
               f"got {self.on_stale!r}; use backpressure (generate waits) or drop (the trainer drops, counted)")
        _check(self.straggler_timeout_s > 0, "async.straggler_timeout_s", "must be > 0 seconds")


@dataclass
class RecordConfig:
    """What the run records into ``<output>/topics/`` (the ``record:`` block; docs/replay.md "Recording")."""

    enabled: bool | None = None  # null: on when `expstream run` starts its own broker, off with --bootstrap-servers
    topics: list[str] | None = None  # null: every topology topic, its .dlq twin and `policy`; or these names
    max_bytes: int | None = None  # null: unbounded; the files together, oldest records dropped (tools/retention.py)
    max_age_s: float | None = None  # null: unbounded; records older than this (broker timestamp) are dropped

    def __post_init__(self) -> None:
        for name, kinds, e_g in (("max_bytes", int, "1073741824 (1 GiB)"), ("max_age_s", (int, float), "86400")):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, kinds) and not isinstance(v, bool) and v > 0), f"record.{name}",
                   f"{v!r} is not a positive number; give e.g. {e_g}, or null for no bound")
        if self.topics is not None:
            _check(len(self.topics) > 0, "record.topics",
                   "an empty list records nothing; give topic names, null for every topic, or set record.enabled=false")
            for t in self.topics:
                _check(bool(t) and "/" not in t and t not in (".", ".."), "record.topics",
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
        _check(self.replicas >= 1, f"stages.{self.name}.replicas", "must be >= 1")
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
    partitions: int = 2

    def __post_init__(self) -> None:
        _check(self.partitions >= 1, "topics.partitions", "must be >= 1")


@dataclass
class Topology:
    run: RunConfig = field(default_factory=RunConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    stages: dict[str, StageConfig] = field(default_factory=dict)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)  # the `async:` block
    record: RecordConfig = field(default_factory=RecordConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    chains: list[list[str]] = field(default_factory=list)  # stages run in one process (expstream/config/chains.py)
    # loader: stage -> the algo.* key that switched it off though configured on (to_raw writes it on)
    switched_off: dict[str, str] = field(default_factory=dict, repr=False)
    # Which file this was read from (a path, or PACKAGED_SOURCE); logged and kept in summary.json.
    source: str = PACKAGED_SOURCE

    # ---- serialised form: what run/topology.yaml is written from (expstream/config/rawform.py) ------
    def to_raw(self) -> dict[str, Any]:
        """topology.yaml's mapping; :func:`build_topology` of it gives back an equal Topology."""
        return topology_raw(self)

    raw = property(to_raw, doc=":meth:`to_raw` (a fresh mapping each time: change the dataclasses, not this)")

    # ---- derived views -------------------------------------------------------------------
    def enabled_stages(self) -> list[StageConfig]:
        return [self.stages[name] for name in STAGE_ORDER if self.stages[name].enabled]

    def all_topics(self) -> dict[str, int]:
        """Topic -> partitions: ``topics.partitions``, raised for a stage's input topic to the most
        replicas the stage may run (``replicas``, ``autoscale.max``). A replica past the partition
        count would own nothing, and the broker cannot add partitions to a live topic (Tansu
        cannot at all; on Kafka it would move keys between partitions mid-run), so the headroom is
        created up front."""
        topics = {self.topics.input: self.topics.partitions}
        heads = [self.stages[u.head] for u in self.units()]  # a chain's inner topics are not created
        for u in self.units():
            topics[self.stages[u.last].output] = self.topics.partitions
        for st in heads:
            topics[st.input] = max(topics[st.input], st.max_replicas)
        return topics

    def units(self) -> list[Unit]:
        """What runs as one process: each chain, every other stage alone (expstream/config/chains.py)."""
        return units(self)

    @property
    def output_topic(self) -> str:
        return self.enabled_stages()[-1].output

    @property
    def is_group_estimator(self) -> bool:
        return self.algo.advantage_estimator in GROUP_ESTIMATORS or self.algo.dynamic_sampling


def default_topology_text() -> str:
    """The packaged copy: a symlink to the repository root's topology.yaml, a real file once built."""
    return importlib.resources.files("expstream").joinpath("topology.yaml").read_text()


def find_topology(path: str | Path | None = None, cwd: str | Path | None = None) -> Path | None:
    """Which topology file a command reads: ``--topology PATH`` when given, else ``./topology.yaml``
    when the current directory has one (a checkout, or a deployment's working directory), else
    None, meaning the packaged copy. ``load_topology(find_topology(args.topology))`` is the order
    every ``expstream`` command uses; ``load_topology(None)`` alone always reads the packaged copy.
    """
    if path:
        return Path(path)
    local = Path(cwd if cwd is not None else Path.cwd()) / LOCAL_TOPOLOGY
    return local if local.is_file() else None


def valid_tree() -> dict[str, Any]:
    """Every settable dotted key, as nested dicts (values are placeholders)."""
    def fields_of(cls: type) -> dict[str, Any]:
        return {f.name: None for f in dataclasses.fields(cls)}

    stage_fields: dict[str, Any] = {k: None for k in ("output", "replicas", "enabled")}
    stage_fields["autoscale"] = {f.name: None for f in dataclasses.fields(AutoscaleConfig) if f.name != "where"}
    return {
        "run": fields_of(RunConfig),
        "kafka": fields_of(KafkaConfig),
        "redis": fields_of(RedisConfig),
        "models": fields_of(ModelsConfig),
        "generate": fields_of(GenerateConfig),
        "algo": fields_of(AlgoConfig),
        "stages": {name: dict(stage_fields) for name in STAGE_ORDER},
        "topics": fields_of(TopicsConfig),
        "train": fields_of(TrainConfig),
        "async": fields_of(AsyncConfig),
        "record": fields_of(RecordConfig),
        "rewards": {**fields_of(RewardsConfig), "sources": FREE_FORM, "weights": FREE_FORM, "recipe": FREE_FORM},
    }


def load_topology(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Topology:
    """Read a topology file (the packaged copy when ``path`` is None) and apply ``--set`` items.

    The returned Topology's ``source`` names the file read (see :func:`find_topology` for the
    order the command line uses).
    """
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read {str(path)!r} ({exc.strerror or exc})", field="--topology",
                              fix="give an existing YAML file, or leave --topology out for ./topology.yaml "
                                  "or the packaged default") from exc
        source = str(Path(path).resolve())
    else:
        text, source = default_topology_text(), PACKAGED_SOURCE
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'topology.yaml'}: the top level must be a mapping of blocks")
    valid = {**valid_tree(), "chains": None}  # the blocks, and the one top-level list (expstream/config/chains.py)
    for key in raw:
        if key not in valid:
            raise unknown_key_error("", key, valid, what="block")
    overrides = list(overrides)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value, valid)
    # the credentials a run directory's copy holds redacted, from the environment (expstream/config/redaction.py)
    apply_secrets(raw, env_topology_secrets())
    topo = build_topology(raw)
    topo.source = source
    log.info("topology: %s%s", source, f" with {len(overrides)} --set override(s)" if overrides else "")
    return topo


def build_topology(raw: dict[str, Any]) -> Topology:
    stages_raw = check_block(raw.get("stages"), "stages")
    for name in stages_raw:
        if name not in STAGE_ORDER:
            raise unknown_key_error("stages", name, STAGE_ORDER, what="stage")
    topo = Topology(
        run=_from_dict(RunConfig, raw.get("run"), "run"),
        kafka=KafkaConfig.from_dict(raw.get("kafka")),
        redis=_from_dict(RedisConfig, raw.get("redis"), "redis"),
        models=_from_dict(ModelsConfig, raw.get("models"), "models"),
        generate=_from_dict(GenerateConfig, raw.get("generate"), "generate"),
        algo=_from_dict(AlgoConfig, raw.get("algo"), "algo"),
        topics=_from_dict(TopicsConfig, raw.get("topics"), "topics"),
        train=_from_dict(TrainConfig, raw.get("train"), "train"),
        async_=_from_dict(AsyncConfig, raw.get("async"), "async"),
        record=_from_dict(RecordConfig, raw.get("record"), "record"),
        rewards=_from_dict(RewardsConfig, raw.get("rewards"), "rewards"),
        chains=parse_chains(raw.get("chains"), STAGE_ORDER),
    )
    for name in STAGE_ORDER:
        st = check_block(stages_raw.get(name), f"stages.{name}")
        for key in ("name", "input"):
            if key in st:
                raise ConfigError(f"stages.{name}.{key}: set by the loader; remove it from the topology")
        st.setdefault("output", name.replace("-", "_"))
        if st.get("autoscale") is not None:
            where = f"stages.{name}.autoscale"
            auto = check_block(st["autoscale"], where)
            if "where" in auto:
                raise unknown_key_error(where, "where", [f.name for f in dataclasses.fields(AutoscaleConfig)][:4])
            st["autoscale"] = _from_dict(AutoscaleConfig, {**auto, "where": where}, where)
        topo.stages[name] = _from_dict(StageConfig, {**st, "name": name}, f"stages.{name}")
    resolve_kl_placement(topo)
    _switch_stages(topo)
    check_chains(topo)
    _check_cross_fields(topo)
    return topo


def resolve_kl_placement(topo: Topology) -> None:
    """``algo.use_kl_loss: null`` (the default) -> ``train.enabled``: the continuous loop puts the KL in its
    trainer's loss (the seed's GRPO recipe: group_norm, use_kl_loss, k3), which keeps it stable over long
    runs where the KL in the reward did not (docs/async.md "Stability"); an experience maker for an outside
    trainer keeps the KL in the reward, the seed's default. An explicit true/false is kept."""
    if topo.algo.use_kl_loss is None:
        topo.algo.use_kl_loss = bool(topo.train.enabled)


def _switch_stages(topo: Topology) -> None:
    """Remove stages the algorithm does not need, then link each stage to its predecessor."""
    algo = topo.algo
    for name, off, key in (("critic", algo.advantage_estimator != "gae", "algo.advantage_estimator"),
                           ("reference", algo.init_kl_coef == 0, "algo.init_kl_coef")):
        # the seed forces critic_pretrain=None unless gae; KL coef 0: no initial model (docs/numerics.md §10)
        if off and topo.stages[name].enabled:
            topo.stages[name].enabled, topo.switched_off[name] = False, key
    previous = topo.topics.input
    seen: dict[str, str] = {previous: "topics.input"}
    for st in topo.enabled_stages():
        st.input = previous
        if st.output in seen:
            raise ConfigError(f"stages.{st.name}.output: topic {st.output!r} is already used by {seen[st.output]}; "
                              "give every stage its own output topic")
        seen[st.output] = f"stages.{st.name}.output"
        previous = st.output


def _check_cross_fields(topo: Topology) -> None:
    algo, gen, models = topo.algo, topo.generate, topo.models
    if topo.rewards.sources is None and models.reward is None and models.reward_fn is None:
        raise ConfigError("models.reward: no reward source: set models.reward to a model directory (or builtin:tiny) "
                          "or models.reward_fn to 'module:function', or name sources under rewards.sources")
    if topo.rewards.sources is not None and models.reward_fn is not None:
        raise ConfigError("models.reward_fn: set, but rewards.sources names the reward sources, so it would be "
                          "ignored", field="models.reward_fn",
                          fix="add it as a source (name: {kind: fn, fn: ...}) and set models.reward_fn=null")
    est = algo.advantage_estimator
    if est == "gae" and not models.critic:
        raise ConfigError("algo.advantage_estimator: gae needs a critic (per-token values) but models.critic is "
                          "null; set models.critic to a model directory (or builtin:tiny), or pick an estimator "
                          "without a critic such as group_norm or reinforce")
    if est in GROUP_ESTIMATORS and gen.n_samples_per_prompt < 2:
        raise ConfigError(f"generate.n_samples_per_prompt: {est} compares the samples of one prompt group, so "
                          f"it needs at least 2 per prompt (got {gen.n_samples_per_prompt}); set "
                          "generate.n_samples_per_prompt=4, or use reinforce/gae for one sample per prompt")
    if algo.init_kl_coef != 0 and not models.reference:
        raise ConfigError("models.reference: init_kl_coef is not 0, so a reference model is needed; set "
                          "models.reference (builtin:tiny or a directory), or set algo.init_kl_coef=0")
    if algo.overlong_buffer and algo.overlong_buffer_len > gen.max_new_tokens:
        raise ConfigError("algo.overlong_buffer_len: larger than generate.max_new_tokens, so every response "
                          "would be penalised; make it at most generate.max_new_tokens")
    record = topo.run.prompt_batch_size * gen.n_samples_per_prompt
    if topo.train.enabled and topo.train.batch_size % record:
        raise ConfigError(f"train.batch_size: {topo.train.batch_size} is not a multiple of the samples in one prompt "
                          f"record (run.prompt_batch_size x generate.n_samples_per_prompt = {record}); admission "
                          "control admits whole records, so a step must take whole records",
                          field="train.batch_size", fix=f"set train.batch_size to a multiple of {record}, e.g. "
                          f"{record * max(1, round(topo.train.batch_size / record))}")
    if algo.dynamic_sampling and gen.n_samples_per_prompt < 2:
        raise ConfigError("algo.dynamic_sampling: drops prompt groups whose rewards are all equal, which needs "
                          "generate.n_samples_per_prompt >= 2")
