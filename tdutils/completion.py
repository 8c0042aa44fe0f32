"""Moved to `tdutils.serving.completion`; this name stays importable (the same module object)."""

import sys

from .serving import completion as _module

sys.modules[__name__] = _module
