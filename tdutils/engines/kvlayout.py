"""Moved to `tdutils.serving.kvlayout`; this name stays importable (the same module object)."""

import sys

from ..serving import kvlayout as _module

sys.modules[__name__] = _module
