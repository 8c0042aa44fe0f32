"""Moved to the package `tdutils.eval` (runner, report, cli, tasks, common); this name stays importable (the same
module object, so `tdutils.evaluate.NAME` is `tdutils.eval.NAME`)."""

import sys

from . import eval as _module

sys.modules[__name__] = _module
