"""Accuracy of token-dropping policies on CPU: registered tasks in query-aware and query-agnostic modes.

Modules, from the bottom up: `common` (seeds, checks run once at an entry, the Wilson interval of a cell),
`statistics` (paired tests of cells on the same prompts: exact McNemar, paired bootstrap, Holm), `tasks`
(the task registry, and datasets as tasks: `load_rows`, `score_rows`; each family of tasks is one file
`task_<name>.py`: passkey, word-level, RULER's templates, the bundled samples, partial credit, text fidelity),
`runner` (`task_eval`, `passkey_eval`: one loop over `build_cells` / `run_cells`), `grid` (`LEADERBOARD`, the
default real-model grid, `eval --tasks leaderboard`), `precision` (`dtype_fidelity`:
bfloat16 against float32 on the same prompts), `report` (tables, leaderboard, ranking, notes, JSON, plots); its command line, `python -m tdutils eval`, is
`tdutils.cli.eval`. This package re-exports their public names
(docs/design.md §7).
"""

# isort: skip_file
# Each module's `__all__` is its public face; the modules are imported bottom up (each imports only those below it).
from . import common, statistics, tasks, runner, grid, precision, report
from .common import *
from .statistics import *
from .tasks import *
from .runner import *
from .grid import *
from .precision import *
from .report import *

__all__ = (common.__all__ + statistics.__all__ + tasks.__all__ + runner.__all__ + grid.__all__ + precision.__all__
           + report.__all__)

# Register the built-in task families now, in their fixed order, so that importing one family's module directly
# (e.g. `from tdutils.eval.task_fidelity import ...`) cannot register its tasks ahead of the others.
tasks._discover()
