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

from expstream.config.blocks import (  # noqa: F401  (the blocks, re-exported)
    BUILTIN_TINY,
    BUILTIN_TINY_VL,
    OFF_POLICY_MODES,
    AlgoConfig,
    AsyncConfig,
    AutoscaleConfig,
    GenerateConfig,
    ModelsConfig,
    RecordConfig,
    RedisConfig,
    RunConfig,
    StageConfig,
    TopicsConfig,
    TrainConfig,
    from_dict,
)
from expstream.config.chains import Unit, check_chains, parse_chains, units
from expstream.config.environment import ENVIRONMENT_STAGE, EnvironmentConfig, environment_from_raw
from expstream.config.estimators import GROUP_ESTIMATORS
from expstream.config.fieldtypes import check_block
from expstream.config.kafka import KafkaConfig
from expstream.config.overrides import FREE_FORM, parse_override, set_dotted
from expstream.config.rawform import BLOCK_ATTRS, topology_raw  # noqa: F401  (BLOCK_ATTRS re-exported)
from expstream.config.redaction import apply_secrets, env_topology_secrets
from expstream.config.rewards import RewardsConfig, RewardSourceConfig  # noqa: F401  (the rewards block, re-exported)
from expstream.errors import ConfigError, unknown_key_error

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
# The file `expstream` reads from the current directory when no --topology is given.
LOCAL_TOPOLOGY = "topology.yaml"
# How Topology.source names the copy shipped inside the package (the repository root's file).
PACKAGED_SOURCE = "packaged expstream/topology.yaml"

log = logging.getLogger("expstream.topology")


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
    environment: EnvironmentConfig | None = None  # multi-turn episodes (expstream/config/environment.py)
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
    def stage_order(self) -> tuple[str, ...]:
        """STAGE_ORDER, with the environment stage after generate when ``environment`` is set."""
        return STAGE_ORDER[:1] + (ENVIRONMENT_STAGE,) + STAGE_ORDER[1:] if self.environment else STAGE_ORDER

    def enabled_stages(self) -> list[StageConfig]:
        return [self.stages[name] for name in self.stage_order() if self.stages[name].enabled]

    def stage_inputs(self, name: str) -> list[str]:
        """The topics stage ``name`` consumes: its input, and for generate of a multi-turn run the turns topic."""
        extra = [self.environment.turns_topic] if self.environment and name == "generate" else []
        return [self.stages[name].input, *extra]

    def all_topics(self) -> dict[str, int]:
        """Topic -> partitions: ``topics.partitions``, raised for a stage's input topic to the most
        replicas the stage may run (``replicas``, ``autoscale.max``). A replica past the partition
        count would own nothing, and the broker cannot add partitions to a live topic (Tansu
        cannot at all; on Kafka it would move keys between partitions mid-run), so the headroom is
        created up front."""
        topics = {self.topics.input: self.topics.partitions}
        for u in self.units():  # a chain's inner topics are not created
            topics[self.stages[u.last].output] = self.topics.partitions
        for u in self.units():
            head = self.stages[u.head]
            for t in self.stage_inputs(head.name):
                topics[t] = max(topics.get(t, self.topics.partitions), head.max_replicas)
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
        "stages": {name: dict(stage_fields) for name in (*STAGE_ORDER, ENVIRONMENT_STAGE)},
        "topics": fields_of(TopicsConfig),
        "train": fields_of(TrainConfig),
        "async": fields_of(AsyncConfig),
        "record": fields_of(RecordConfig),
        "rewards": {**fields_of(RewardsConfig), "sources": FREE_FORM, "weights": FREE_FORM, "recipe": FREE_FORM},
        "environment": fields_of(EnvironmentConfig),
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
        if name not in (*STAGE_ORDER, ENVIRONMENT_STAGE):
            raise unknown_key_error("stages", name, STAGE_ORDER, what="stage")
    topo = Topology(
        run=from_dict(RunConfig, raw.get("run"), "run"),
        kafka=KafkaConfig.from_dict(raw.get("kafka")),
        redis=from_dict(RedisConfig, raw.get("redis"), "redis"),
        models=from_dict(ModelsConfig, raw.get("models"), "models"),
        generate=from_dict(GenerateConfig, raw.get("generate"), "generate"),
        algo=from_dict(AlgoConfig, raw.get("algo"), "algo"),
        topics=from_dict(TopicsConfig, raw.get("topics"), "topics"),
        train=from_dict(TrainConfig, raw.get("train"), "train"),
        async_=from_dict(AsyncConfig, raw.get("async"), "async"),
        record=from_dict(RecordConfig, raw.get("record"), "record"),
        rewards=from_dict(RewardsConfig, raw.get("rewards"), "rewards"),
        chains=parse_chains(raw.get("chains"), STAGE_ORDER),
        environment=environment_from_raw(raw.get("environment")),
    )
    if stages_raw.get(ENVIRONMENT_STAGE) is not None and topo.environment is None:
        raise ConfigError("set, but there is no environment block", field="stages.environment",
                          fix="add environment: {fn: module:function} (or url: ...), or remove stages.environment")
    for name in topo.stage_order():
        st = check_block(stages_raw.get(name), f"stages.{name}")
        for key in ("name", "input"):
            if key in st:
                raise ConfigError(f"stages.{name}.{key}: set by the loader; remove it from the topology")
        st.setdefault("output", "episodes" if name == ENVIRONMENT_STAGE else name.replace("-", "_"))
        if st.get("autoscale") is not None:
            where = f"stages.{name}.autoscale"
            auto = check_block(st["autoscale"], where)
            if "where" in auto:
                raise unknown_key_error(where, "where", [f.name for f in dataclasses.fields(AutoscaleConfig)][:4])
            st["autoscale"] = from_dict(AutoscaleConfig, {**auto, "where": where}, where)
        topo.stages[name] = from_dict(StageConfig, {**st, "name": name}, f"stages.{name}")
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
    if topo.environment:
        seen[topo.environment.turns_topic] = "environment.turns_topic"
    for st in topo.enabled_stages():
        st.input = previous
        if st.output in seen:
            raise ConfigError(f"stages.{st.name}.output: topic {st.output!r} is already used by {seen[st.output]}; "
                              "give every stage its own output topic")
        seen[st.output] = f"stages.{st.name}.output"
        previous = st.output


def _check_cross_fields(topo: Topology) -> None:
    algo, gen, models = topo.algo, topo.generate, topo.models
    if gen.resumable and gen.backend == "vllm":
        raise ConfigError("generate.resumable: not available with generate.backend=vllm (docs/async.md \"Resumable "
                          "generations\" says why)", field="generate.resumable",
                          fix="use generate.backend=transformers, or set generate.resumable=false")
    for knob in ("in_flight_updates", "resumable"):
        if getattr(gen, knob) and gen.backend == "sglang":
            raise ConfigError(f"generate.{knob}: not available with generate.backend=sglang (docs/sglang.md)",
                              field=f"generate.{knob}", fix=f"use generate.backend=transformers or vllm, or set "
                              f"generate.{knob}=false")
        if getattr(gen, knob) and topo.environment is not None:
            raise ConfigError(f"generate.{knob}: not available with an environment block yet (a multi-turn episode "
                              "records its versions per turn, docs/multi_turn.md)", field=f"generate.{knob}",
                              fix=f"set generate.{knob}=false, or remove the environment block")
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
