"""Import-only stand-in (see ``tools/sglang_cpu/torchvision/__init__.py``)."""

from torchvision._stub import missing

__getattr__ = missing("torchvision.transforms.v2")
