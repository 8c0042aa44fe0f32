"""`python -m tdutils patches check|apply|revert`: the command line of `tdutils.serving.patches` (vLLM's query export
and LMCache's fused K/V layout)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..serving.patches import (
    PatchError,
    apply,
    check_version,
    find_lmcache,
    find_vllm,
    fitting_patch,
    load_patch,
    status,
)

DESCRIPTION = ("Apply, check or revert the patches of the serving path: vLLM's query export (needed by policies "
               "that use queries) and LMCache's fused K/V layout (vLLM's CPU backend).")


def main(argv=None) -> int:
    """`python -m tdutils patches ARGS` from Python: exit status 0 (applied / done), 1 (check: unapplied), 2 (error)."""
    ap = argparse.ArgumentParser(prog="python -m tdutils patches", description=DESCRIPTION)
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap) -> None:
    """The options of `python -m tdutils patches`."""
    ap.add_argument("action", choices=("check", "apply", "revert"))
    ap.add_argument("--vllm-dir", help="folder holding vLLM's __init__.py (default: find it without importing it)")
    ap.add_argument("--python", help="interpreter of the servers' own environment, used to find vLLM and LMCache")
    ap.add_argument("--target", choices=("all", "vllm", "lmcache"), default="all",
                    help="what to patch (default all: vLLM, and LMCache when it is installed next to vLLM)")
    ap.add_argument("--patch", help="patch file for vLLM (default: the shipped patch that fits its version)")
    ap.add_argument("--force", action="store_true",
                    help="on a version no patch was written for, try the newest patch whose context fits")


def run(args) -> int:
    """Check, apply or revert (`args.action`); prints one line per file and returns the exit status."""
    try:
        installs = []
        vllm = None
        if args.target in ("all", "vllm"):
            vllm = find_vllm(args.vllm_dir, args.python)
            installs.append(vllm)
        if args.target in ("all", "lmcache"):
            lmc = find_lmcache(vllm or args.vllm_dir, args.python if vllm is None else None)
            if lmc is not None:
                installs.append(lmc)
            elif args.target == "lmcache":
                raise PatchError("LMCache is not installed there; point at its environment with --python")
        worst = 0
        for inst in installs:
            print(f"{inst.label} {inst.version} at {inst.package_dir}")
            if args.patch and inst.name == "vllm":
                name, patch = Path(args.patch).name, load_patch(args.patch)
                if not args.force:
                    check_version(inst.version, inst.name)
            else:
                try:
                    spec = check_version(inst.version, inst.name)
                except PatchError:
                    if not args.force:
                        raise
                    spec = fitting_patch(inst)
                name, patch = spec.name, load_patch(spec)
            if args.action == "check":
                st = status(inst, patch)
                for path, state in st.files.items():
                    print(f"  {path}: {state}")
                print(f"patch {name}: {st.state}")
                if st.state == "unapplied":
                    print("apply it with: python -m tdutils patches apply" + (f" --python {args.python}" if args.python
                                                                             else ""))
                worst = max(worst, 0 if st.state == "applied" else 1 if st.state == "unapplied" else 2)
                continue
            for line in apply(inst, reverse=args.action == "revert", patch=patch):
                print("  " + line)
        return worst
    except (PatchError, OSError) as exc:
        print(f"tdutils patches: error: {exc}", file=sys.stderr)
        return 2

