"""One source of truth: the Topology dataclasses serialise to the run/topology.yaml the child processes
read (``Topology.to_raw``), and loading that file gives back an equal Topology."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from expstream.config.paths import resolve_run_paths
from expstream.config.topology import load_topology
from expstream.launch.run import write_resolved_topology

VARIATIONS = [
    [],
    ["algo.advantage_estimator=gae", "generate.n_samples_per_prompt=1"],
    ["algo.init_kl_coef=0", "algo.dynamic_sampling=true", "run.target_groups=3"],
    ["stages.reward.replicas=2", "stages.reward.autoscale={min: 1, max: 3}", "record.topics=[prompts]"],
    ["rewards.sources={rm: {kind: model, path: builtin:tiny}, web: {kind: http, url: 'http://u:pw@h:1'}}",
     "rewards.combine=weighted", "rewards.weights={rm: 1.0, web: 0.5}", "train.enabled=true",
     "kafka.extra={producer: {client_id: x}}"],
]


def same(a, b) -> bool:
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


@pytest.mark.parametrize("sets", VARIATIONS, ids=lambda s: ",".join(x.split("=")[0] for x in s) or "default")
def test_to_raw_round_trips_through_the_written_file(tmp_path: Path, sets: list[str]) -> None:
    topo = load_topology(None, sets)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo.to_raw(), sort_keys=False))
    assert same(load_topology(path), topo)
    write_resolved_topology(topo, path)  # credentials redacted: the same but for the URL's password
    again = load_topology(path)
    if "web" in (topo.rewards.sources or {}):
        assert "pw" not in path.read_text()
        assert again.rewards.sources["web"].url != topo.rewards.sources["web"].url
        again.rewards.sources["web"].url = topo.rewards.sources["web"].url
    assert same(again, topo)


def test_a_switched_off_stage_is_decided_again_from_the_algo_block(tmp_path: Path) -> None:
    """The critic switched off by a non-gae estimator is written as configured (on), so a replay that
    sets the estimator to gae gets its critic, as it did when the user's own file was copied."""
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(load_topology(None).to_raw()))
    assert not load_topology(path).stages["critic"].enabled
    assert load_topology(path, ["algo.advantage_estimator=gae"]).stages["critic"].enabled
    path.write_text(yaml.safe_dump(load_topology(None, ["stages.critic.enabled=false"]).to_raw()))
    assert not load_topology(path, ["algo.advantage_estimator=gae"]).stages["critic"].enabled


def test_paths_are_resolved_once_into_the_dataclasses_and_written_from_them(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    topo = resolve_run_paths(load_topology(None, ["train.enabled=true", "models.cache_dir=c"]), Path("out"), media=True)
    assert (topo.models.cache_dir, topo.train.weight_store, topo.run.blob_store) == (
        str(tmp_path / "c"), str(tmp_path / "out" / "weights"), str(tmp_path / "out" / "blobs"))
    write_resolved_topology(topo, tmp_path / "topology.yaml")
    assert same(load_topology(tmp_path / "topology.yaml"), topo)
    plain = resolve_run_paths(load_topology(None), Path("out"), media=False)
    assert plain.run.blob_store is None and plain.train.weight_store is None  # nothing opened that is not used
