"""Token-selection policies: each turns a request's KV (and queries) into the indices to keep.

One file per policy; each registers itself with `register_policy` (see `registry`; import order here is
registration order), which is how `tdutils.make_drop_fn`, the command line, `passkey_eval` and the notebooks
find it. Helpers: `scoring` (attention from captured queries), `params` (field checks); their command-line
options come from `tdutils.cli.policy_options`. Policies never import `tdutils.edit` or the engines. By name (needs):

- `snapkv` (last `window` queries): Li et al. 2024, arXiv:2404.14469
- `rkv` (last `window` queries): Cai et al. 2025, arXiv:2505.24133
- `random`, `middle_chunk` (nothing): baselines
- `streaming_llm` (nothing): Xiao et al. 2023, arXiv:2309.17453
- `h2o` (all prompt queries): Zhang et al. 2023, arXiv:2306.14048
- `tova` (the last query): Oren et al. 2024, arXiv:2401.06104
- `knorm` (keys only): Devoto et al. 2024, arXiv:2406.11430
- `keydiff` (keys only): Park et al. 2025, arXiv:2504.15364
- `expected_attention` (all prompt queries): Devoto et al. 2025 (NVIDIA kvpress), arXiv:2510.00636
- `adakv_snapkv`, `adakv_expected_attention` (as their scorer): Feng et al. 2024, arXiv:2407.11550
- `pyramidkv` (last `window` queries): Cai et al. 2024, arXiv:2406.02069
"""

# isort: skip_file
# Import order is registration order (the order of `policy_names()`, `--help` and tables).
from .registry import NEEDS, Policy, get_policy, policy_names, query_window_for, register_policy, unregister_policy
from .snapkv import SnapKVParams, snapkv_keep, snapkv_scores
from .rkv import RKV_METHODS, RKVParams, rkv_keep, rkv_redundancy, rkv_scores
from .random import MiddleChunkParams, RandomParams, middle_chunk_keep, random_keep
from .streaming_llm import StreamingLLMParams, streaming_llm_keep
from .h2o import H2OParams, h2o_keep, h2o_scores
from .tova import TOVAParams, tova_keep, tova_scores
from .knorm import KNormParams, knorm_keep, knorm_scores
from .keydiff import KeyDiffParams, keydiff_keep, keydiff_scores
from .expected_attention import ExpectedAttentionParams, expected_attention_keep

# A policy added as a new file here registers without an edit to this file: every other module of the package
# is imported after the ones above (in name order), so its `register_policy` call runs.
import importlib as _importlib
import pkgutil as _pkgutil

for _module in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    _importlib.import_module(f"{__name__}.{_module}")

__all__ = ["NEEDS", "RKV_METHODS", "ExpectedAttentionParams", "H2OParams", "KNormParams", "KeyDiffParams",
           "MiddleChunkParams", "Policy", "RKVParams", "RandomParams", "SnapKVParams", "StreamingLLMParams",
           "TOVAParams", "expected_attention_keep", "get_policy", "h2o_keep", "h2o_scores", "keydiff_keep",
           "keydiff_scores", "knorm_keep", "knorm_scores", "middle_chunk_keep", "policy_names", "query_window_for",
           "random_keep", "register_policy", "rkv_keep", "rkv_redundancy", "rkv_scores", "snapkv_keep",
           "snapkv_scores", "streaming_llm_keep", "tova_keep", "tova_scores", "unregister_policy"]
