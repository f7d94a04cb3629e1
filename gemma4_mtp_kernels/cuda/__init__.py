"""The `cuda` backend: the compiled extension `gemma4_mtp_kernels._C` (torch.ops.gemma4_mtp.*).

The extension is imported lazily, on first use, so that `import gemma4_mtp_kernels` works where it
was not built; `extension_status()` says why it is unusable when it is.
"""
from __future__ import annotations

import functools
import importlib
import os


@functools.lru_cache(maxsize=None)
def extension_status() -> tuple[bool, str]:
    try:
        importlib.import_module("gemma4_mtp_kernels._C")
    except ModuleNotFoundError:
        return False, f"the compiled extension gemma4_mtp_kernels._C is {_build_status()}"
    except (ImportError, OSError) as e:
        return False, f"the compiled extension failed to load, likely a torch version mismatch: {e}"
    return True, "compiled extension gemma4_mtp_kernels._C"


def _build_status() -> str:
    """What setup.py recorded about the extension build ("not built because ...")."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_build_status.txt")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "not built (no build record: was the package installed with pip install?)"
