"""expstream/models/resolve.py: model directories and the reward function, checked once, with the field and fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.models.resolve import build_builtin_models, check_models, model_dir, model_roles, reward_fn

ROOT = Path(__file__).resolve().parents[1]


def saved_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_roles_follow_the_enabled_stages():
    assert model_roles(load_topology()) == ["tokenizer", "actor", "reference", "reward"]
    gae = load_topology(overrides=["algo.advantage_estimator=gae", "algo.init_kl_coef=0"])
    assert model_roles(gae) == ["tokenizer", "actor", "critic", "reward"]
    fn_only = load_topology(overrides=["models.reward=null", "models.reward_fn=tests.rewardfns:label_length"])
    assert "reward" not in model_roles(fn_only)


def test_directories_are_checked_with_field_and_fix(tmp_path):
    actor = saved_model(tmp_path / "actor")
    (tmp_path / "tok").mkdir()  # a tokenizer directory needs no config.json
    topo = load_topology(overrides=[f"models.actor={actor}", f"models.tokenizer={tmp_path / 'tok'}"])
    check_models(topo)
    assert model_dir(topo, "actor") == actor

    missing = load_topology(overrides=[f"models.reference={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError) as err:
        check_models(missing)
    assert err.value.field == "models.reference"
    assert "does not exist" in str(err.value) and "save_pretrained" in str(err.value)

    (tmp_path / "empty").mkdir()
    empty = load_topology(overrides=[f"models.reward={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match=r"models\.reward.*config\.json"):
        check_models(empty)
    with pytest.raises(ConfigError, match=r"models\.reward.*config\.json"):
        model_dir(empty, "reward")  # what a stage started on its own calls: the same message


def test_a_disabled_stage_is_not_checked(tmp_path):
    topo = load_topology(overrides=[f"models.critic={tmp_path / 'nope'}"])  # group_norm: no critic stage
    check_models(topo)


def test_null_model_a_stage_needs():
    topo = load_topology(overrides=["models.critic=null"])
    with pytest.raises(ConfigError, match="models.critic: is null"):
        model_dir(topo, "critic")


def test_reward_fn_is_imported_and_returned():
    from tests import rewardfns

    assert reward_fn("tests.rewardfns:label_length") is rewardfns.label_length
    with pytest.raises(ConfigError) as err:
        reward_fn("no_such_module_x:score")
    assert err.value.field == "models.reward_fn" and "make it importable" in str(err.value)
    with pytest.raises(ConfigError, match="package.module:function"):
        reward_fn("tests.rewardfns:no_such_fn")
    with pytest.raises(ConfigError, match="models.reward_fn"):
        check_models(load_topology(overrides=["models.reward_fn=tests.rewardfns:no_such_fn"]))


def test_checks_do_not_import_torch(tmp_path):
    """The checks run before anything starts, so they must stay cheap (torch takes seconds)."""
    code = ("import sys; from expstream.config.topology import load_topology; from expstream.models.resolve import check_models;"
            "check_models(load_topology()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_unwritable_cache_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    topo = load_topology(overrides=[f"models.cache_dir={blocker / 'models'}"])
    with pytest.raises(ConfigError) as err:
        build_builtin_models(topo)
    assert err.value.field == "models.cache_dir"
