"""Moved to `tdutils.eval.tasks` (the task registry); this name stays importable (the same module object)."""

import sys

from .eval import tasks as _module

sys.modules[__name__] = _module
