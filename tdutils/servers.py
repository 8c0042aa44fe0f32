"""Moved to `tdutils.serving.servers`; this name stays importable (the same module object)."""

import sys

from .serving import servers as _module

sys.modules[__name__] = _module
