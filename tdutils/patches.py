"""Moved to `tdutils.serving.patches`; this name stays importable (the same module object)."""

import sys

from .serving import patches as _module

if __name__ == "__main__":  # python -m tdutils.patches
    sys.exit(_module.main())
sys.modules[__name__] = _module
