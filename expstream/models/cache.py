"""Where the built-in tiny models live in ``models.cache_dir``, readable without importing torch.

``expstream run`` checks the cache before anything else starts: when the models are there, the main
process never imports torch or transformers (1.3 s of start-up and ~300 MB of memory it does not
need: only the stage processes run models). Building them, when they are missing, is
expstream/models/tiny.py's (text) and expstream/models/vl.py's (vision-language) job; both name their
directories with the functions here, so there is one naming rule.
"""

from __future__ import annotations

from pathlib import Path

#: The file a finished build writes last (a directory without it is a torn build).
MARKER = "EXPSTREAM_COMPLETE.json"
#: The model directories of a built-in family.
MODEL_KEYS = ("tokenizer", "actor", "critic", "reward")
# 2: heads of size 32 (vLLM refuses 16); the cache directory name carries it, so a v1 cache is not reused
TINY_FORMAT = 2
# 2: the critic and the reward model are VisionValueModels (1 had text models); the directory name carries it
TINY_VL_FORMAT = 2


def tiny_root(cache_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """The directory of the text family ``builtin:tiny`` (and the bench's bigger variants)."""
    return Path(cache_dir) / f"tiny-llama-h{hidden}-l{layers}-s{seed}-f{TINY_FORMAT}"


def tiny_vl_root(cache_dir: str | Path, seed: int = 0) -> Path:
    """The directory of the vision-language family ``builtin:tiny-vl``."""
    return Path(cache_dir) / f"tiny-vl-h64-l2-s{seed}-f{TINY_VL_FORMAT}"


def is_complete(root: Path) -> bool:
    """A finished build: its marker and every model directory are there."""
    return (root / MARKER).is_file() and all((root / k).is_dir() for k in MODEL_KEYS)
