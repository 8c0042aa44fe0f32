"""Command-line options for the policies' parameters, generated from their parameter dataclasses.

Every distinct field name of the registered policies' parameters becomes one option, `--window` for
`window`, `--n-sink` for `n_sink` (`policy_options`), so a new policy with a new parameter reaches
`python -m tdutils run` and `eval` with no edit here. From the field:

- the type: its annotation (`int`, `float`, `str`, `bool`; `X | None` reads as `X`), else its default's type;
  `metadata={"type": callable}` overrides it;
- the choices: a `Literal[...]` annotation, or `metadata={"choices": (...)}`;
- the help: `metadata={"help": "..."}` (one sentence, no trailing period), then each policy's default;
- `metadata={"cli": False}` keeps a field off the command line.

Every option defaults to None, "the policy's own default"; only the options given reach a policy
(`policy_params`), and the policy's dataclass checks their values (`__post_init__`), as it does for Python
callers. A name shared by several policies is one option (`--window` reaches all that have a window).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass

from ..policies.registry import get_policy, policy_names


@dataclass(frozen=True)
class PolicyOption:
    """One command-line option: the field `name` of some policies' parameters.

    Attributes:
        name: the field name (the argparse `dest`); `flag` its option, `--` + name with `-` for `_`.
        type: parses the option's text (None: a bool field, given as `--name` / `--no-name`).
        choices: allowed values, or None.
        help: the help text (without defaults); `defaults` `{policy: default}` of the policies that have it.
    """

    name: str
    type: typing.Callable | None
    choices: tuple | None
    help: str
    defaults: dict

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def help_text(self) -> str:
        """`help` then the defaults: "(snapkv; default: avg)" for one policy, "(default: each policy's own: 64
        snapkv; 16 rkv, random)" for several."""
        by_value: dict[str, list[str]] = {}
        for policy, value in self.defaults.items():
            by_value.setdefault("unset" if value is None else str(value), []).append(policy)
        if len(self.defaults) == 1:
            (value, (policy,)), = by_value.items()
            tail = f"{policy}; default: {value}"
        else:
            own = "; ".join(f"{v} {', '.join(names)}" for v, names in by_value.items())
            tail = f"default: each policy's own: {own}"
        return f"{self.help} ({tail})".replace("%", "%%")  # argparse formats help with %


def policy_options(names=None, *, skip=()) -> dict[str, PolicyOption]:
    """`{field name: PolicyOption}` over the parameters of the policies `names` (default: every registered
    one), in registration order, leaving out the fields in `skip` and those marked `metadata={"cli": False}`.

    Raises:
        TypeError: a field's annotation names no type that can be parsed from text and it has no
            `metadata={"type": ...}`.
    """
    found: dict[str, list] = {}
    for policy in policy_names() if names is None else names:
        params = get_policy(policy).params
        hints = _hints(params)
        for f in dataclasses.fields(params):
            if f.name in skip or f.metadata.get("cli", True) is False:
                continue
            found.setdefault(f.name, []).append((policy, f, hints.get(f.name, f.type)))
    return {name: _option(name, fields) for name, fields in found.items()}


def policy_arguments(parser, *, skip=(), title: str = "policy parameters") -> list[PolicyOption]:
    """Add one option per policy parameter (`policy_options(skip=skip)`) to `parser`, in an argument group
    `title`; returns them.

    Raises:
        ValueError: a parameter whose option or name the parser already has for something else (name it in
            `skip`, or give the field `metadata={"cli": False}`).
    """
    options = list(policy_options(skip=skip).values())
    taken = {s for a in parser._actions for s in a.option_strings} | {a.dest for a in parser._actions}
    clash = [o for o in options if o.flag in taken or o.name in taken]
    if clash:
        raise ValueError(f"policy parameters {[o.name for o in clash]} clash with options the command already has; "
                         "pass them in skip= or give the field metadata={'cli': False}")
    group = parser.add_argument_group(
        title, "each reaches the policies that have a parameter of that name; unset, the policy's own default applies")
    for o in options:
        if o.type is None:
            group.add_argument(o.flag, dest=o.name, action=argparse.BooleanOptionalAction, default=None,
                               help=o.help_text())
        else:
            group.add_argument(o.flag, dest=o.name, type=o.type, choices=o.choices, default=None, help=o.help_text())
    return options


def policy_params(args, policy: str, *, skip=(), strict: bool = True) -> dict:
    """The parameters the command line's policy options give `policy`: `{field: value}` of the options that
    were given (not None) and that `policy` has. Not checked here: the policy's dataclass checks them when the
    drop function is built.

    Args:
        args: the parsed namespace (`policy_arguments` added the options; a missing one counts as not given).
        skip: as given to `policy_arguments`.
        strict: an option given that `policy` has no parameter for is an error (one policy on the command
            line, `run`); else it is left out (several policies, `eval`: it reaches those that have it).

    Raises:
        ValueError: with `strict`, "--kernel-size does not apply to policy 'knorm'; its parameters are [...]".
    """
    own = set(get_policy(policy).defaults())
    params, stray = {}, []
    for o in policy_options(skip=skip).values():
        value = getattr(args, o.name, None)
        if value is None:
            continue
        if o.name in own:
            params[o.name] = value
        else:
            stray.append(o.flag)
    if stray and strict:
        raise ValueError(f"{', '.join(stray)} does not apply to policy {policy!r}; its parameters are "
                         f"{sorted(own) or 'none'}")
    return params


def checked_params(policy: str, params: dict, *, name_policy: bool = False):
    """`get_policy(policy).make_params(**params)`, the policy's own check failing in terms of the command line.

    Raises:
        ValueError: "--window 0: window must be a positive integer, got 0" (the options the message names, else
            every option given; with `name_policy`, "... (policy 'snapkv')": several policies share the options).
    """
    try:
        return get_policy(policy).make_params(**params)
    except ValueError as exc:  # the policy's own check ("window must be ..."): name the options given
        given = [(k, f"--{k.replace('_', '-')} {v}") for k, v in params.items()]
        named = [flag for k, flag in given if k in str(exc)] or [flag for _, flag in given]
        where = f" (policy {policy!r})" if name_policy else ""
        raise ValueError(f"{', '.join(named)}: {exc}{where}" if named else str(exc)) from None


def _hints(params: type) -> dict:
    """The dataclass's resolved annotations; {} when they cannot be resolved (a class in a function, whose
    annotations under `from __future__ import annotations` name local types): defaults decide then."""
    try:
        return typing.get_type_hints(params)
    except Exception:  # noqa: BLE001 - any unresolvable name; the field's default still tells the type
        return {}


def _option(name: str, fields: list) -> PolicyOption:
    """One option from `[(policy, field, annotation)]` of the policies that have the field `name`."""
    types, choices, helps = [], [], {}
    for policy, f, hint in fields:
        kind, allowed = _kind(hint, f)
        types.append(f.metadata.get("type", kind))
        choices.append(f.metadata.get("choices", allowed))
        helps.setdefault(f.metadata.get("help", f"parameter {name} of policy {policy}"), []).append(policy)
    parse = types[0] if all(t == types[0] for t in types) else str  # policies that disagree: text, their check
    allowed = None
    if all(c is not None for c in choices):
        allowed = tuple(dict.fromkeys(v for c in choices for v in c))
    if len(helps) == 1:
        text = next(iter(helps))
    else:
        text = ". ".join(f"{', '.join(policies)}: {h}" for h, policies in helps.items())
    defaults = {policy: _default(f) for policy, f, _ in fields}
    return PolicyOption(name, parse, allowed, text, defaults)


def _kind(hint, f: dataclasses.Field):
    """`(parse function or None for a bool, choices or None)` of one field's annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else str
        origin = typing.get_origin(hint)
    if origin is typing.Literal:
        values = typing.get_args(hint)
        return _kind(type(values[0]), f)[0], values
    if not isinstance(hint, type):  # an unresolved annotation (a string): the default's type tells
        default = _default(f)
        hint = type(default) if default is not None else str
    if hint is bool:
        return None, None
    if hint in (int, float, str):
        return hint, None
    raise TypeError(f"parameter {f.name}: cannot read a {hint!r} from the command line; annotate it int, float, str, "
                    f"bool or a Literal, or give it metadata={{'type': parse_function}}")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


__all__ = ["checked_params", "PolicyOption", "policy_arguments", "policy_options", "policy_params"]
