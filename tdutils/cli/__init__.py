"""The command line, `python -m tdutils SUBCOMMAND` (`main`), above the rest of the package: nothing outside this
package imports it, except `tdutils/__init__.py` (the stdlib-only `startup` hook) and `tdutils/__main__.py`.

- `main`: the top parser, `run`, and the subcommands by module (`SUBCOMMANDS`): `eval`, `doctor`, `patches`
- `args`: argument types, the one-line parser and the error report (also used by `bench/` and `tools/`)
- `startup`: Ctrl-C while the imports run ends the process in one line
- `policy_options`: one option per policy parameter (`--window`, `--n-sink`, ...)
- `eval`, `doctor`, `patches`: one subcommand each (`add_arguments(parser)`, `run(args) -> exit status`)

Kept empty of imports: `tdutils/__init__.py` loads `startup` before anything heavy.
"""
