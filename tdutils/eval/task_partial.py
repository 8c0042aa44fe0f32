"""Partial credit of RULER's tasks with several references, as tasks of their own: `ruler_<task>_partial`.

RULER scores every task with `string_match_all` (Hsieh et al., arXiv:2404.06654): the fraction of the references
the answer contains. A small model rarely lists all of several values (SmolLM2-135M: 0/6 exact on
`niah_multivalue` with the full cache, 58% of the references), so exact match ranks nothing there while the
fraction still moves with what a policy drops. These tasks are RULER's own (the same prompts, for a seed, as
`ruler_<task>`), ranked by that fraction (`measure="partial"`, a continuous score: paired bootstrap and sign-flip
tests, `tdutils.eval.statistics`). They run when named (`--tasks ruler_niah_multivalue_partial`), not with
`--tasks ruler`, which would decode the same prompts twice.
"""

from __future__ import annotations

from dataclasses import replace

from . import task_ruler  # noqa: F401  (registers the ruler_ tasks this file re-scores)
from .tasks import get_task, register_task

MULTI_REFERENCE = ("niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")  # RULER tasks with several references

for _name in MULTI_REFERENCE:
    register_task(replace(get_task(f"ruler_{_name}"), name=f"ruler_{_name}_partial", measure="partial", grouped=False,
                          about=f"RULER's {_name} ranked by partial credit (fraction of the references found)"))
