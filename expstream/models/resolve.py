"""What the topology names outside itself: model directories and the reward functions.

``expstream/config/topology.py`` checks the file on its own terms (keys, ranges, combinations). This module
checks what can only be checked against the machine: that ``models.reward_fn`` imports and names a
function, that every model directory a stage will load exists and holds a saved model, and that the
built-in tiny models can be built; the ``rewards:`` block's sources the same way (a model source's
``path``, a fn source's ``fn``, a ``module:function`` combine rule). It is the one place those checks are written: ``expstream run``
calls :func:`check_models` right after loading the topology, so a bad path stops the run (exit 2)
before anything starts, and the stages resolve their models through :func:`model_dir` and
:func:`reward_fn`, so a stage started on its own (docker-compose) fails with the same message.

Nothing here imports torch at module level: the checks must stay fast (a second, not the ~4 s of
importing torch); only building the tiny models imports it.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from expstream.config.cli_args import Command, add_topology_args
from expstream.config.topology import BUILTIN_TINY, BUILTIN_TINY_VL, RewardSourceConfig, Topology
from expstream.errors import EXIT_OK, ConfigError

__all__ = ["model_roles", "check_models", "builtin_models_missing", "build_builtin_models", "model_dir", "reward_fn", "import_function",
           "source_model_dir", "combine_fn"]


def model_roles(topo: Topology) -> list[str]:
    """The ``models.*`` keys the enabled stages load, in a fixed order."""
    roles = ["tokenizer", "actor"]
    if topo.stages["reference"].enabled:
        roles.append("reference")
    if topo.stages["critic"].enabled:
        roles.append("critic")
    if topo.rewards.sources is None and topo.models.reward:
        roles.append("reward")  # with rewards.sources the reward models are the sources' own paths
    return roles


def check_models(topo: Topology) -> None:
    """Fail fast on what a stage would only discover later; neither torch nor stages is imported.

    Raises ConfigError naming the topology field and the fix: the reward function's import, and
    every model directory given as a path. ``builtin:tiny`` roles are built later, by
    :func:`build_builtin_models`, because building takes seconds.
    """
    if topo.models.reward_fn:
        reward_fn(topo.models.reward_fn)
    if topo.environment is not None and topo.environment.fn:
        import_function(topo.environment.fn, "environment.fn")
    for role in model_roles(topo):
        value = getattr(topo.models, role)
        if value not in (BUILTIN_TINY, BUILTIN_TINY_VL):
            _checked_dir(role, value)
    for cfg in (topo.rewards.sources or {}).values():
        if cfg.kind == "fn":
            import_function(cfg.fn or "", f"{cfg.where}.fn")
        elif cfg.kind == "model" and cfg.path not in (BUILTIN_TINY, BUILTIN_TINY_VL):
            _checked_dir("reward", cfg.path or "", field=f"{cfg.where}.path")
    combine_fn(topo)
    engine = {"vllm": "vLLM", "sglang": "SGLang"}.get(topo.generate.backend)
    if engine is not None and _is_vl_actor(topo):
        raise ConfigError(f"generate.backend={topo.generate.backend}: models.actor is a vision-language model, and "
                          f"images are not passed to {engine} yet", field="generate.backend",
                          fix="use generate.backend=transformers with a vision-language actor")
    if topo.generate.backend == "vllm" and topo.stages["generate"].enabled:
        from expstream.models.vllm_generator import check_generate_config

        check_generate_config(topo.generate)  # installed, and every generate.* knob honoured
    if topo.generate.backend == "sglang" and topo.stages["generate"].enabled:
        from expstream.models.sglang_generator import check_generate_config as check_sglang

        check_sglang(topo.generate)  # an SGLang environment (or server), and every generate.* knob honoured


def _is_vl_actor(topo: Topology) -> bool:
    from expstream.models.vl import is_vl_dir

    actor = topo.models.actor
    return actor == BUILTIN_TINY_VL or (actor != BUILTIN_TINY and is_vl_dir(actor))


def _builtin_roles(topo: Topology) -> tuple[list[str], set[str]]:
    """The roles on a built-in tiny model, and the ``builtin:*`` values of the model reward sources."""
    roles = [role for role in model_roles(topo) if getattr(topo.models, role) in (BUILTIN_TINY, BUILTIN_TINY_VL)]
    sources = (topo.rewards.sources or {}).values()
    builtin_sources = {cfg.path for cfg in sources if cfg.kind == "model" and cfg.path in (BUILTIN_TINY, BUILTIN_TINY_VL)}
    if builtin_sources and "reward" not in roles:
        roles.append("reward")  # a model source on builtin:tiny(-vl) loads that family's tiny reward model
    return roles, builtin_sources


def builtin_models_missing(topo: Topology) -> bool:
    """Whether :func:`build_builtin_models` has anything to build (checked without importing torch)."""
    roles, builtin_sources = _builtin_roles(topo)
    return not _builtin_cached(topo, {getattr(topo.models, r) for r in roles if getattr(topo.models, r)} | builtin_sources)


def build_builtin_models(topo: Topology) -> None:
    """Build the built-in tiny models (once, into ``models.cache_dir``) for the roles that use them,
    before any stage starts, so that stages load them instead of racing to build them. Imports torch
    when there is something to build: ``expstream run`` calls it in a child process
    (expstream/launch/modelbuild.py)."""
    if not builtin_models_missing(topo):
        return  # nothing to build: torch and transformers stay out of this process
    roles, builtin_sources = _builtin_roles(topo)
    for role in roles:
        try:
            if role == "reward" and topo.rewards.sources is not None:
                for value in sorted(builtin_sources):
                    _builtin_family(topo, value)
            else:
                model_dir(topo, role)
        except OSError as exc:  # building the tiny models: cache_dir not writable, disk full
            raise ConfigError(f"cannot build the built-in tiny model for models.{role} ({exc})",
                              field="models.cache_dir", fix="set models.cache_dir to a writable directory") from exc


def _builtin_cached(topo: Topology, values: set[str]) -> bool:
    """Every built-in family in ``values`` is complete in the cache (checked without importing torch);
    the families as :func:`_builtin_family` picks them."""
    from expstream.models.cache import is_complete, tiny_root, tiny_vl_root

    vl = {v == BUILTIN_TINY_VL or topo.models.actor == BUILTIN_TINY_VL for v in values if v in
          (BUILTIN_TINY, BUILTIN_TINY_VL)}
    roots = [tiny_vl_root(topo.models.cache_dir) if is_vl else tiny_root(topo.models.cache_dir) for is_vl in vl]
    return all(is_complete(root) for root in roots)


def model_dir(topo: Topology, role: str) -> Path:
    """Resolve ``models.<role>`` to a directory, building the tiny offline models when asked."""
    value = getattr(topo.models, role)
    if value is None:
        raise ConfigError(f"models.{role}: is null but this stage needs it; set it to a model directory")
    if value in (BUILTIN_TINY, BUILTIN_TINY_VL):
        key = {"reference": "actor"}.get(role, role)
        return Path(_builtin_family(topo, value)[key])
    return _checked_dir(role, value)


def _builtin_family(topo: Topology, value: str) -> dict[str, Path]:
    """The built-in models a ``builtin:*`` value names. With ``models.actor: builtin:tiny-vl`` every
    ``builtin:tiny`` role resolves to the tiny-vl family too (one tokenizer for every model of a run):
    the critic and the reward model are then the vision-language ones (expstream/models/vl.py
    VisionValueModel), fed the pixels. A text-only run (``builtin:tiny`` actor) keeps the text family."""
    if value == BUILTIN_TINY_VL or topo.models.actor == BUILTIN_TINY_VL:
        from expstream.models.vl import build_tiny_vl

        return build_tiny_vl(topo.models.cache_dir)
    from expstream.models.tiny import build_tiny_models

    return build_tiny_models(topo.models.cache_dir)


def source_model_dir(topo: Topology, cfg: RewardSourceConfig) -> Path:
    """The directory of model source ``cfg`` (``rewards.sources.<name>.path``), building the tiny
    offline reward model for ``builtin:tiny``."""
    if cfg.path in (BUILTIN_TINY, BUILTIN_TINY_VL):
        return Path(_builtin_family(topo, cfg.path)["reward"])
    return _checked_dir("reward", cfg.path or "", field=f"{cfg.where}.path")


def _checked_dir(role: str, value: str, field: str | None = None) -> Path:
    field = field or f"models.{role}"
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ConfigError(f"directory {value!r} does not exist", field=field,
                          fix="point it at a directory saved with save_pretrained, or use builtin:tiny")
    if role != "tokenizer" and not (path / "config.json").is_file():
        raise ConfigError(f"directory {value!r} has no config.json, so it is not a saved model",
                          field=field, fix="point it at the directory save_pretrained wrote")
    if role == "reward":
        _check_vl_reward_head(path, field)
    return path


def _check_vl_reward_head(path: Path, field: str) -> None:
    """A vision-language reward model needs its value head file (a VL critic may start from zero)."""
    from expstream.models.media import is_vl_dir

    if not is_vl_dir(path):
        return
    from expstream.models.vl import VALUE_HEAD_FILE, is_vl_scoring_dir  # torch, only for a VL directory

    if is_vl_scoring_dir(path) and not (path / VALUE_HEAD_FILE).is_file():
        raise ConfigError(f"directory {str(path)!r} is a Qwen2-VL model without {VALUE_HEAD_FILE}, so it has no "
                          "reward head", field=field,
                          fix="save a trained VL reward model with expstream.models.vl.save_value_model, or score with a "
                              "reward function (models.reward_fn)")


def reward_fn(path: str) -> Callable:
    """Import ``models.reward_fn`` (``package.module:function``) and return the function."""
    return import_function(path, "models.reward_fn")


def combine_fn(topo: Topology) -> Callable | None:
    """The ``rewards.combine`` function when it is ``module:function`` (None for a built-in rule)."""
    combine = topo.rewards.combine
    if topo.rewards.sources is None or ":" not in combine:
        return None
    return import_function(combine, "rewards.combine")


def import_function(path: str, field: str) -> Callable:
    """Import ``package.module:function`` named by topology key ``field`` and return the function."""
    module_name, _, func_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while importing
        raise ConfigError(f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})", field=field,
                          fix="make it importable (on PYTHONPATH or installed) or fix the name") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(f"module {module_name} has no function {func_name!r}", field=field,
                          fix="write it as 'package.module:function' naming a function of that module")
    return fn


# ---- the command -----------------------------------------------------------------------------
def add_models_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["build"])
    add_topology_args(p)


def models_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream models build``: the tiny models are built by resolving each role's directory."""
    for role in ("tokenizer", "actor", "critic", "reward"):
        if getattr(topo.models, role):
            print(f"{role}: {model_dir(topo, role)}")
    return EXIT_OK


MODELS = Command("models", "build the built-in tiny offline models", add_models_arguments, models_command,
                 reads_topology=True)
