"""CPU-only import stand-in for ``torchvision`` (see ../README.md); never used on a GPU.

SGLang imports torchvision at start-up (its multimodal processors). The registry's torchvision that
matches the CPU torch is a CUDA build that fails to import (``operator torchvision::nms does not
exist``) and breaks transformers with it, so ``make setup-sglang`` uninstalls it and this package
answers the imports: every public name is a function that raises when called (``_stub.py``).
Text-only models never call into it.
"""

from torchvision._stub import missing

__version__ = "0.0.0+expstream-cpu-standin"
__getattr__ = missing("torchvision")
