"""The package's import graph is layered: no import cycles among `tdutils` modules, no arrow that runs back up, and
every internal import inside a function says why it is not at the module top (`# cycle: ...` or `# cost: ...`).

Read from the source with `ast` (nothing is imported). An edge `a -> b` is an internal import in module `a` of module
`b`, plus `b`'s parent packages that `a` is not inside (importing `tdutils.engines.base` runs
`tdutils/engines/__init__.py` first). Imports under `if TYPE_CHECKING:` are for annotations only and are no edges.
`python tests/test_layering.py` prints the graph's in-function imports and cycles.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tdutils

PACKAGE = Path(tdutils.__file__).parent
REASONS = ("# cycle:", "# cost:")


@dataclass(frozen=True)
class Import:
    """One internal import statement: the importing module, its line, the modules it loads, and where it sits."""

    module: str
    line: int
    targets: frozenset[str]
    in_function: bool
    reason: str | None  # "cycle" / "cost" from a comment on the line or the line above; None without one


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (`tdutils.engines.base`; a package by its own name)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict) -> set[str]:
    """The package modules `node` loads (a `from pkg import name` loads `pkg.name` when that is a module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = {f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names}
    return {t for t in found if t in known}


def _walk(node: ast.AST, in_function: bool = False):
    """(import node, in_function) for every import under `node`, skipping `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (x for branch in child.orelse for x in _walk(ast.Module([branch], []), in_function))
        else:
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _walk(child, inner)


def _reason(lines: list[str], line: int) -> str | None:
    for text in (lines[line - 1], lines[line - 2] if line >= 2 else ""):
        for tag in REASONS:
            if tag in text:
                return tag[2:-1]
    return None


def internal_imports(package: Path = PACKAGE) -> list[Import]:
    """Every import of a package module by a package module (TYPE_CHECKING imports excluded)."""
    known = module_names(package)
    out = []
    for module, path in sorted(known.items()):
        source = path.read_text()
        lines = source.splitlines()
        for node, in_function in _walk(ast.parse(source)):
            targets = _targets(node, module, path.name == "__init__.py", known)
            if targets:
                out.append(Import(module, node.lineno, frozenset(targets), in_function, _reason(lines, node.lineno)))
    return out


def graph(imports: list[Import]) -> dict[str, set[str]]:
    """Module -> modules it imports, with the parent packages of each target the importer is not inside."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        out = edges.setdefault(imp.module, set())
        for target in imp.targets:
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                name = ".".join(parts[:i])
                if name != imp.module and not imp.module.startswith(name + "."):
                    out.add(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each holds at least one cycle), by DFS
    (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


def test_parent_packages_are_edges():
    """`tdutils.runs` importing `tdutils.engines.base` runs `tdutils/engines/__init__.py`; a module inside
    `tdutils.engines` importing its sibling does not add its own package."""
    imports = [Import("tdutils.runs", 1, frozenset({"tdutils.engines.base"}), False, None),
               Import("tdutils.engines.hf", 1, frozenset({"tdutils.engines.base"}), False, None)]
    assert graph(imports) == {"tdutils.runs": {"tdutils.engines", "tdutils.engines.base"},
                              "tdutils.engines.hf": {"tdutils.engines.base"}}


def test_no_import_cycles_at_module_top():
    imports = internal_imports()
    assert len({i.module for i in imports}) > 30  # the scan found the package
    assert cycles(graph([i for i in imports if not i.in_function])) == []


def test_no_arrow_runs_back_up():
    """With the in-function imports added (all but those marked `# cycle:`), the graph still has no cycle: an
    import deferred into a function for its cost still points down."""
    found = cycles(graph([i for i in internal_imports() if i.reason != "cycle"]))
    assert found == [], f"import cycles through in-function imports: {found}"


def test_every_in_function_import_says_why():
    bare = [f"{i.module}:{i.line}" for i in internal_imports() if i.in_function and i.reason is None]
    assert bare == [], (f"{len(bare)} internal imports inside functions without a '# cycle: ...' or '# cost: ...' "
                        f"comment (move them to the module top, or say why not): {bare}")


# The command line's wing sits above the library: the only imports of it from outside are the package's own start
# (`tdutils/__init__.py` installs the stdlib-only Ctrl-C hook first) and `python -m tdutils`'s entry point.
CLI = "tdutils.cli"
CLI_ENTRIES = {"tdutils": {"tdutils.cli.startup"}, "tdutils.__main__": {"tdutils.cli.main"}}


def cli_imports_from_below(imports: list[Import]) -> list[str]:
    """`module:line -> target` for every import of the command-line wing (`tdutils.cli`, any depth) by a module
    outside it, other than `CLI_ENTRIES` (in-function imports count too)."""
    out = []
    for imp in imports:
        if imp.module == CLI or imp.module.startswith(CLI + "."):
            continue
        for target in sorted(imp.targets):
            if (target == CLI or target.startswith(CLI + ".")) and target not in CLI_ENTRIES.get(imp.module, ()):
                out.append(f"{imp.module}:{imp.line} -> {target}")
    return out


def test_the_cli_rule_finds_an_import_from_below():
    imports = [Import("tdutils.eval.runner", 3, frozenset({"tdutils.cli.args"}), True, "cost"),
               Import("tdutils.cli.eval", 5, frozenset({"tdutils.eval.runner"}), False, None),
               Import("tdutils", 8, frozenset({"tdutils.cli.startup"}), False, None),
               Import("tdutils", 9, frozenset({"tdutils.cli.main"}), False, None)]
    assert cli_imports_from_below(imports) == ["tdutils.eval.runner:3 -> tdutils.cli.args", "tdutils:9 -> tdutils.cli.main"]


def test_nothing_below_the_command_line_imports_it():
    """Every subcommand, its options and its argument types live in `tdutils/cli/`; the library never imports them."""
    names = module_names()
    assert {"tdutils.cli.main", "tdutils.cli.args", "tdutils.cli.eval", "tdutils.cli.doctor"} <= set(names)
    assert cli_imports_from_below(internal_imports()) == []
    assert len(names["tdutils.__main__"].read_text().splitlines()) < 15  # a thin entry point: the CLI is in tdutils.cli


HEAVY = ("pandas", "scipy", "matplotlib", "transformers", "httpx", "gguf")  # loaded where used, never by --help


def test_the_command_line_help_loads_no_heavy_library():
    """`python -m tdutils --help` (which imports `tdutils` and every subcommand's module) loads none of the heavy
    libraries that only some commands need: an internal import moved to a module top must not drag one in."""
    probe = ("import runpy, sys\nsys.argv = ['tdutils', '--help']\n"
             "try:\n    runpy.run_module('tdutils', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run([sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m tdutils" in out.stdout
    assert out.stdout.splitlines()[-1] == "", f"--help loaded {out.stdout.splitlines()[-1]}"


if __name__ == "__main__":
    every = internal_imports(Path(sys.argv[1]) / "tdutils" if len(sys.argv) > 1 else PACKAGE)
    inner = [i for i in every if i.in_function]
    print(f"{len(every)} internal import statements, {len(inner)} inside functions")
    for i in inner:
        print(f"  {i.module}:{i.line} {i.reason or '-'} {sorted(i.targets)}")
    print("cycles at module top:", cycles(graph([i for i in every if not i.in_function])))
    print("cycles with in-function imports:", cycles(graph([i for i in every if i.reason != "cycle"])))
