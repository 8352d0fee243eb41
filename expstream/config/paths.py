"""Where a run's directories are: the relative paths of a topology made absolute, once, by one function.

``expstream run`` calls :func:`resolve_run_paths` once, after loading the topology and reading the
prompt file and before writing the run/topology.yaml the child processes read, so that the
stages, the trainer and a later replay (whatever their working directory) read and write the same
directories. It changes the dataclasses only: the written file is ``Topology.to_raw()``
(expstream/config/topology.py). ``run.media_root`` is not here: it confines the prompt file's
paths while the run reads it (expstream/models/media.py), and no child process reads it.
"""

from __future__ import annotations

from pathlib import Path

from expstream.config.storeurl import is_object_url
from expstream.config.topology import Topology

#: The defaults under the run's --output: the weight store of a continuous run, the blob store.
DEFAULT_STORE_DIR = "weights"
DEFAULT_BLOB_DIR = "blobs"


def absolute(path: str | Path) -> str:
    return str(Path(path).expanduser().resolve())


def resolve_weight_store(topo: Topology, out_dir: Path) -> Path | str:
    """``train.weight_store`` made absolute (default ``<out_dir>/weights``), and ``train.enabled`` set;
    an object-store URL (``s3://``) is kept as it is (and returned as text)."""
    where = topo.train.weight_store
    topo.train.enabled = True
    if is_object_url(where):
        return str(where)
    store = Path(absolute(where or Path(out_dir) / DEFAULT_STORE_DIR))
    topo.train.weight_store = str(store)
    return store


def resolve_blob_store(topo: Topology, out_dir: Path) -> str:
    """``run.blob_store`` (default ``<out_dir>/blobs``) made absolute; a URL is kept as it is."""
    where = topo.run.blob_store
    topo.run.blob_store = where if where and "://" in where else absolute(where or Path(out_dir) / DEFAULT_BLOB_DIR)
    return topo.run.blob_store


def resolve_run_paths(topo: Topology, out_dir: Path, *, media: bool) -> Topology:
    """Every path of ``topo`` a child process reads, made absolute (in place; ``topo`` is returned):
    ``models.cache_dir``; ``train.weight_store`` with ``train.enabled``; ``run.blob_store`` when the
    prompts carry ``media`` (without, it stays unset, so no stage opens a store)."""
    topo.models.cache_dir = absolute(topo.models.cache_dir)
    if topo.train.enabled:
        resolve_weight_store(topo, out_dir)
    if media:
        resolve_blob_store(topo, out_dir)
    return topo
