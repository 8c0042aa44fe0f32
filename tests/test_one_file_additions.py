"""Adding a policy, a task or an engine is one file (issue 46): a module dropped into `tdutils/policies/`,
`tdutils/eval/` (named `task_*.py`) or `tdutils/engines/` registers itself, with no import list to edit. Checked
on a copy of the package (the checkout stays untouched) in a fresh process, which is how a user's new file is met."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import tdutils

PACKAGE = Path(tdutils.__file__).parent

FILES = {
    "policies/keep_first_test.py": """
        from dataclasses import dataclass

        import torch

        from ..selection import keep_count
        from .registry import register_policy


        @dataclass
        class KeepFirstParams:
            pass


        register_policy("keep_first_test", params=KeepFirstParams, needs="kv", needs_model=False,
                        keep=lambda kv, q, r, *, params, facts: torch.arange(keep_count(kv.shape[2], r)))
        """,
    "eval/task_one_file_test.py": """
        from .task_passkey import _make
        from .tasks import PASSKEY, PASSKEY_DEFAULTS, Task, register_task

        register_task(Task("one_file_test", PASSKEY, _make, None, lambda values, text: (True, 1.0),
                           lambda examples, tokenizer: 8, defaults=PASSKEY_DEFAULTS, grouped=False))
        """,
    "engines/one_file_test.py": """
        from .base import register_engine
        from .hf import HFEngine


        @register_engine("one-file-test")
        class OneFileEngine(HFEngine):
            pass
        """,
}

PROBE = """
import tdutils
from tdutils.engines import engine_kinds
from tdutils.eval.tasks import get_task, task_names
from tdutils.policies import get_policy, policy_names

print("keep_first_test" in policy_names(), get_policy("keep_first_test").needs, policy_names()[0])
print("one_file_test" in task_names(), get_task("one_file_test").suite, task_names()[0])
print(engine_kinds())
print(tdutils.__file__)
"""


def test_a_policy_a_task_and_an_engine_are_one_file_each(tmp_path):
    copy = tmp_path / "tdutils"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    (copy / "assets").symlink_to(PACKAGE / "assets")
    for name, text in FILES.items():
        (copy / name).write_text(textwrap.dedent(text))
    out = subprocess.run([sys.executable, "-c", PROBE], env={"PYTHONPATH": str(tmp_path), "PATH": ""},
                         capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    policy, task, engines, where = out.stdout.splitlines()
    assert where == str(copy / "__init__.py")  # the copy, not the checkout
    assert policy == "True kv snapkv"  # registered by name; the built-in order stays first
    assert task == "True passkey passkey"  # found by name; the built-in default task stays first
    assert engines == "['hf', 'lmcache', 'one-file-test']"
