"""Import-only stand-in (see ``tools/sglang_cpu/torchvision/__init__.py``)."""

import enum

from torchvision._stub import missing


class InterpolationMode(enum.Enum):
    """Names read at import time (default arguments); nothing here resizes an image."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = missing("torchvision.transforms")
