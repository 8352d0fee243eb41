"""Topology loading: defaults, --set overrides, unknown keys, stage switching, start-up refusals."""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys
from pathlib import Path

import pytest

from expstream.config.kafka import KafkaConfig
from expstream.config.topology import (
    PACKAGED_SOURCE,
    STAGE_ORDER,
    default_topology_text,
    find_topology,
    load_topology,
)
from expstream.errors import ConfigError, unknown_key_error


def test_default_topology_links_the_enabled_stages_in_order():
    topo = load_topology()
    names = [s.name for s in topo.enabled_stages()]
    # group_norm needs no critic (the seed forces critic_pretrain=None unless gae)
    assert names == [n for n in STAGE_ORDER if n != "critic"]
    assert topo.stages["generate"].input == "prompts"
    assert topo.stages["reward"].input == "reference"  # re-linked around the critic
    assert topo.output_topic == "experiences"
    assert set(topo.all_topics()) == {"prompts", "rollouts", "batches", "actor", "reference", "rewarded",
                                      "scored", "experiences"}


def test_gae_keeps_the_critic_and_zero_kl_drops_the_reference():
    topo = load_topology(overrides=["algo.advantage_estimator=gae", "algo.init_kl_coef=0"])
    names = [s.name for s in topo.enabled_stages()]
    assert "critic" in names and "reference" not in names
    assert topo.stages["critic"].input == "actor"


def test_set_parses_yaml_values():
    topo = load_topology(overrides=["algo.gamma=0.9", "stages.advantage.replicas=2", "algo.kl_target=null",
                                    "generate.skip_special_tokens=true"])
    assert topo.algo.gamma == 0.9
    assert topo.stages["advantage"].replicas == 2
    assert topo.algo.kl_target is None
    assert topo.generate.skip_special_tokens is True


@pytest.mark.parametrize("item, expected", [
    ("algo.gamam=0.9", "algo.gamma"),
    ("algoo.gamma=0.9", "algo"),
    ("stages.advantge.replicas=2", "stages.advantage"),
    ("kafka.session_timeout=10", "kafka.session_timeout_ms"),
])
def test_unknown_keys_name_the_closest_valid_one(item, expected):
    with pytest.raises(ConfigError) as err:
        load_topology(overrides=[item])
    assert expected in str(err.value)


def test_unknown_key_in_a_file_is_named(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("algo:\n  advantage_estimatr: gae\n")
    with pytest.raises(ConfigError, match=r"algo\.advantage_estimatr.*algo\.advantage_estimator"):
        load_topology(path)


@pytest.mark.parametrize("est", ["rloo", "group_norm", "grpo", "reinforce_baseline"])
def test_group_estimators_refuse_one_sample_per_prompt(est):
    with pytest.raises(ConfigError, match="n_samples_per_prompt") as err:
        load_topology(overrides=[f"algo.advantage_estimator={est}", "generate.n_samples_per_prompt=1"])
    assert "at least 2" in str(err.value)


def test_gae_without_critic_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="models.critic"):
        load_topology(overrides=["algo.advantage_estimator=gae", "models.critic=null"])


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match="algo.kl_estimator"):
        load_topology(overrides=["algo.kl_estimator=k4"])
    with pytest.raises(ConfigError, match="set dotted.key=value|dotted.key=value"):
        load_topology(overrides=["algo.gamma"])


# --- where the topology comes from -----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_packaged_copy_is_the_repository_root_file():
    """One source: the package ships the root's topology.yaml (a symlink here, a file in a wheel)."""
    packaged = importlib.resources.files("expstream").joinpath("topology.yaml").read_bytes()
    assert packaged == (ROOT / "topology.yaml").read_bytes()
    assert default_topology_text() == (ROOT / "topology.yaml").read_text()


def test_find_topology_order(tmp_path, monkeypatch):
    given = tmp_path / "given.yaml"
    monkeypatch.chdir(tmp_path)
    assert find_topology(None) is None, "no ./topology.yaml: the packaged copy"
    (tmp_path / "topology.yaml").write_text("algo:\n  gamma: 0.5\n")
    assert find_topology(None) == tmp_path / "topology.yaml"
    assert find_topology(str(given)) == given, "--topology wins over ./topology.yaml"
    topo = load_topology(find_topology(None))
    assert topo.algo.gamma == 0.5 and topo.source == str((tmp_path / "topology.yaml").resolve())
    assert load_topology().source == PACKAGED_SOURCE and load_topology().algo.gamma != 0.5


def test_missing_topology_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"--topology.*cannot read"):
        load_topology(tmp_path / "nope.yaml")


def test_cli_reads_topology_yaml_from_the_current_directory(tmp_path):
    """`expstream run` in a directory with a topology.yaml uses it (and says so), before the packaged copy."""
    (tmp_path / "topology.yaml").write_text("models:\n  actor: /nonexistent/local-topology-actor\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "2+2?", "label": "4"}\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "expstream", "run", "--prompts", "prompts.jsonl", "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"topology: {(tmp_path / 'topology.yaml').resolve()}" in proc.stderr
    assert "models.actor" in proc.stderr and "/nonexistent/local-topology-actor" in proc.stderr


# --- one unknown-key message for every block -------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("algo:\n  gamam: 0.9\n", "algo.gamam: unknown key. Did you mean algo.gamma?"),
    ("kafka:\n  sesion_timeout_ms: 6000\n", "kafka.sesion_timeout_ms: unknown key. Did you mean kafka.session_timeout_ms?"),
    ("stages:\n  advantge: {}\n", "stages.advantge: unknown stage. Did you mean stages.advantage?"),
    ("stages:\n  reward:\n    replica: 2\n", "stages.reward.replica: unknown key. Did you mean stages.reward.replicas?"),
    ("algoo:\n  gamma: 0.9\n", "algoo: unknown block. Did you mean algo?"),
])
def test_unknown_keys_read_the_same_in_every_block(tmp_path, text, expected):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_topology(path)
    assert str(err.value).startswith(expected), str(err.value)
    assert err.value.field == expected.split(":")[0]


def test_kafka_config_uses_the_same_helper():
    with pytest.raises(ConfigError) as err:
        KafkaConfig.from_dict({"lingr_ms": 5})
    assert str(err.value).startswith("kafka.lingr_ms: unknown key. Did you mean kafka.linger_ms? (valid keys: ")
    assert str(err.value) == str(unknown_key_error("kafka", "lingr_ms", KafkaConfig.field_names()))


def test_far_keys_get_the_list_not_a_guess():
    err = unknown_key_error("algo", "zzz", ["gamma", "lambd"])
    assert str(err) == "algo.zzz: unknown key (valid keys: gamma, lambd)"


def test_train_batch_size_must_take_whole_prompt_records_when_the_loop_is_on():
    from expstream.config.topology import load_topology
    from expstream.errors import ConfigError

    # off: the trainer's batch size is not used, so it is not checked
    assert load_topology(None, ["train.batch_size=12"]).train.batch_size == 12
    with pytest.raises(ConfigError, match=r"train\.batch_size.*multiple.*= 8") as info:
        load_topology(None, ["train.enabled=true", "train.batch_size=12"])  # records of 2 prompts x 4
    assert "multiple of 8" in info.value.fix
    assert load_topology(None, ["train.enabled=true", "train.batch_size=24"]).train.batch_size == 24
