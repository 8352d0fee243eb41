"""Import-only stand-in (see ``tools/sglang_cpu/torchvision/__init__.py``)."""

from torchvision._stub import missing
from torchvision.transforms import InterpolationMode  # noqa: F401

__getattr__ = missing("torchvision.transforms.functional")
