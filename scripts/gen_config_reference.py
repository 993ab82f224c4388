#!/usr/bin/env python3
"""Write docs/configuration.md, the configuration reference, from the code itself: the `specray` command's
argparse parsers (every subcommand, its flags by argument group) and the pydantic config models' fields
(ServeConfig, EngineConfig, ChainConfig, every model they reference, each speculator's parameters).

    .venv/bin/python scripts/gen_config_reference.py          # write docs/configuration.md
    .venv/bin/python scripts/gen_config_reference.py --check  # exit 1, with a diff, if the page is out of date

The page depends on the code only, never on the machine or the environment it is generated on: defaults are
read from the parsers and the models (none of them is computed from the host; a default that depends on the
host is written in words in the help or the description), help texts are expanded as argparse does but never
wrapped to a terminal's width, and nothing is read from the environment.

A flag's default is the `(default: ...)` its help ends with, where it says one (`specray serve`'s flags default
to argparse.SUPPRESS and say their real default there), else the parser's default. A field's default is the
model's.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"
REGEN = ".venv/bin/python scripts/gen_config_reference.py"

#: the subcommand documented first; the others follow in the parser's order
FIRST_COMMAND = "serve"

#: argparse `type=` callables of the CLI that are not int/float/str, in words
CUSTOM_TYPES = {
    "_shares": "comma-separated numbers",
    "_csv": "comma-separated names",
    "_layers": "three comma-separated integers",
    "_count": "a count such as 1.5B or 300M",
}

#: words that make a default said in the help prose, not a value (shown in code type)
WORD_DEFAULTS = {"a", "all", "an", "and", "by", "else", "free", "in", "it", "its", "limit", "no", "none", "of",
                 "off", "on", "one", "only", "or", "per", "the", "them", "to", "unless", "where", "with"}


# ---- Markdown --------------------------------------------------------------------------------------------------

def _escape_prose(text: str) -> str:
    """Text outside code spans, for a table cell: Markdown's emphasis and HTML characters escaped, `docs/X.md`
    references made links."""
    text = text.replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;").replace("|", "\\|")
    # underscores next to a non-word character or each other could open or close emphasis (`__internal__`);
    # one inside a word (n_max) cannot
    text = re.sub(r"_{2,}|(?<!\w)_|_(?!\w)", lambda m: "\\_" * len(m.group()), text)

    def link(m: re.Match) -> str:
        page, anchor = m.group(1), m.group(2) or ""
        if page == "configuration.md" and not anchor:
            return "[this page](#serveconfig)"
        return f"[{page}{anchor}]({page}{anchor})"

    return re.sub(r"\bdocs/([a-z0-9-]+\.md)(#[a-z0-9-]+)?", link, text)


def md(text: str) -> str:
    """One line of Markdown for a table cell: whitespace collapsed, prose escaped, code spans kept as they are
    (MkDocs' tables do not split a row at a `|` inside a code span)."""
    text = " ".join(str(text).split())
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1 else _escape_prose(p) for p in parts)


def sentence(text: str) -> str:
    """text ended as a sentence, ready for another after it ("" stays "")."""
    text = text.rstrip()
    if not text:
        return ""
    return text + (" " if text[-1] in ".!?" else ". ")


def code(text: Any) -> str:
    text = str(text)
    return f"``{text}``" if "`" in text else f"`{text}`"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def anchor(heading: str) -> str:
    """MkDocs' anchor of a heading: lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\s-]", "", heading.lower())
    return re.sub(r"\s+", "-", text.strip())


def yamlish(value: Any) -> str:
    """A default as it would be written in a YAML config file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yamlish(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yamlish(v)}" for k, v in value.items()) + "}"
    return repr(value)


# ---- the command line ------------------------------------------------------------------------------------------

def split_default(help_text: str) -> tuple[str, str | None]:
    """(help without its default, the default in words) where the help ends with one: `... (default: X)`,
    `... (other; default: X)` or `...; default: X`; else (help, None).

    >>> split_default("HTTP port (default: 8000)")
    ('HTTP port', '8000')
    >>> split_default("draft cells (llama.cpp's -cd; default: the target's (n_ctx), + 16)")
    ("draft cells (llama.cpp's -cd)", "the target's (n_ctx), + 16")
    >>> split_default("layers; default: all of them")
    ('layers', 'all of them')
    >>> split_default("a note (not a default)")
    ('a note (not a default)', None)
    """
    text = help_text.strip()
    default_re = re.compile(r"\s*default:?\s+(.*)$", re.S | re.I)

    def split(s: str) -> tuple[str, str | None]:
        """s's top-level `;`-separated segments from the first that is a default on: (before it, the default)."""
        depth, starts = 0, [0]
        for i, c in enumerate(s):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if c == ";" and depth == 0:
                starts.append(i + 1)
        for start in starts[1:]:
            m = default_re.fullmatch(s[start:])
            if m:
                return s[:start - 1].rstrip(), m.group(1).strip()
        return s, None

    if text.endswith(")"):
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                break
        else:
            return text, None
        inner = text[i + 1:-1]
        m = default_re.fullmatch(inner)
        if m:
            return text[:i].rstrip(), m.group(1).strip()
        before, default = split(inner)
        return (f"{text[:i]}({before})", default) if default is not None else (text, None)
    return split(text)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _value_text(action: argparse.Action) -> str:
    if _is_switch(action):
        return "switch"
    if action.choices is not None:
        kind = "one of " + ", ".join(code(c) for c in action.choices)
    elif action.type in (None, str):
        kind = "text"
    elif action.type is int:
        kind = "integer"
    elif action.type is float:
        kind = "number"
    else:
        kind = CUSTOM_TYPES.get(getattr(action.type, "__name__", ""), "text")
    if action.nargs == "+":
        kind += ", one or more"
    elif action.nargs == "*":
        kind += ", zero or more"
    elif isinstance(action.nargs, int) and action.nargs > 1:
        kind += f", {action.nargs} of them"
    if isinstance(action, argparse._AppendAction):
        kind += ", repeatable"
    return kind


def _flag_text(action: argparse.Action, prog: str) -> str:
    names = ", ".join(code(s) for s in action.option_strings)
    if _is_switch(action) or action.choices is not None:
        return names
    fmt = argparse.HelpFormatter(prog)
    metavar = fmt._format_args(action, action.dest.upper())
    return ", ".join(code(f"{s} {metavar}") for s in action.option_strings)


def _default_cell(words: str | None, action: argparse.Action, fallback: dict[str, Any]) -> str:
    if words is not None:
        tokens = words.split()
        words_only = WORD_DEFAULTS - ({"none"} if len(tokens) > 1 else set())  # `none ngram_mod`: chains
        value = all(re.fullmatch(r"[\w.,:/@+$-]+", t) and t.lower() not in words_only for t in tokens)
        return code(words) if value else md(words)
    if action.required:
        return "required"
    default = action.default
    if default is argparse.SUPPRESS:
        if action.dest not in fallback:
            return "not set"
        default = fallback[action.dest]
    if _is_switch(action) and isinstance(default, bool):
        return "on" if default else "off"
    if default is None:
        return "not set"
    if isinstance(default, (list, tuple)):
        return code(" ".join(map(str, default))) if default else "none"
    return code(default)


def _serve_fallback_defaults() -> dict[str, Any]:
    """`specray serve` dest -> ServeConfig's default of the field the flag sets (for flags whose help does not
    say it: they default to argparse.SUPPRESS)."""
    from specray.cli.serve import _FLAG_FIELDS
    from specray.deployments.config import ServeConfig

    cfg = ServeConfig()
    out = {}
    for dest, path in _FLAG_FIELDS.items():
        node: Any = cfg
        for key in path:
            node = getattr(node, key)
        out[dest] = node
    return out


def command_section(name: str, sp: argparse.ArgumentParser, summary: str | None) -> list[str]:
    lines = [f"## specray {name}", ""]
    if summary:
        lines += [md(summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else ".")), ""]
    if sp.description:
        desc = sp.description.replace("%(prog)s", sp.prog)
        if issubclass(sp.formatter_class, argparse.RawDescriptionHelpFormatter):
            lines += ["```text", desc.rstrip("\n"), "```", ""]
        else:
            lines += [md(desc), ""]
    fallback = _serve_fallback_defaults() if name == "serve" else {}
    exclusive: dict[argparse.Action, tuple[list[argparse.Action], bool]] = {}
    for group in sp._mutually_exclusive_groups:
        for a in group._group_actions:
            exclusive[a] = ([b for b in group._group_actions if b is not a], group.required)
    fmt = argparse.HelpFormatter(sp.prog)
    for group in sp._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)
                   and a.help is not argparse.SUPPRESS]
        if not actions:
            continue
        title = {sp._optionals: "options", sp._positionals: "arguments"}.get(group, group.title)
        lines += [f"### specray {name}: {title}", ""]
        if group.description:
            lines += [md(group.description), ""]
        rows = []
        for a in actions:
            text, words = split_default(" ".join(fmt._expand_help(a).split()) if a.help else "")
            desc = md(text)
            if a in exclusive:
                others, required = exclusive[a]
                names = ", ".join(code(o.option_strings[0]) for o in others)
                desc = sentence(desc) + (f"One of this and {names} is required." if required
                                         else f"Not with {names}.")
            rows.append([_flag_text(a, sp.prog), _value_text(a), _default_cell(words, a, fallback), desc.strip()])
        lines += table(["Flag", "Value", "Default", "Description"], rows) + [""]
    return lines


def cli_sections() -> tuple[list[str], list[str]]:
    """(the commands' headings, their sections)."""
    from specray.cli.main import build_parser

    subs = _subparsers(build_parser())
    summaries = {a.dest: a.help for a in subs._choices_actions}
    names = sorted(subs.choices, key=lambda n: (n != FIRST_COMMAND, list(subs.choices).index(n)))
    lines: list[str] = []
    for name in names:
        lines += command_section(name, subs.choices[name], summaries.get(name))
    return [f"specray {n}" for n in names], lines


# ---- the config models -----------------------------------------------------------------------------------------

def _is_model(t: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(t, type) and issubclass(t, BaseModel)


def _models_in(annotation: Any) -> list[type]:
    """The pydantic models an annotation refers to (list[ArmConfig] -> [ArmConfig])."""
    if _is_model(annotation):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def model_link(model: type) -> str:
    return f"[{model.__name__}](#{anchor(model.__name__)})"


def type_text(t: Any) -> str:
    """A field's type in words, the way a config file writes it."""
    origin, args = get_origin(t), get_args(t)
    if t is type(None):
        return code("null")
    if _is_model(t):
        return model_link(t)
    if origin is Literal:
        return "one of " + ", ".join(code(yamlish(v)) for v in args)
    if origin in (Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(parts + ([code("null")] if type(None) in args else []))
    if origin in (list, tuple) and len(args) in (1, 2) and (origin is list or args[-1] is Ellipsis):
        if _is_model(args[0]):
            return "list of " + model_link(args[0])
    return code(_py_type(t))


def _py_type(t: Any) -> str:
    origin, args = get_origin(t), get_args(t)
    if t is Any:
        return "Any"
    if origin is Literal:
        return " | ".join(yamlish(v) for v in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_py_type(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list[{_py_type(args[0])}]"  # a YAML list
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_py_type(a) for a in args)}]"
    if t is type(None):
        return "null"
    return getattr(t, "__name__", str(t))


def _bounds(field) -> str:
    b = {}
    for m in field.metadata:
        for key in ("ge", "gt", "le", "lt"):
            if getattr(m, key, None) is not None:
                b[key] = getattr(m, key)
    if "ge" in b and "le" in b:
        return f"{b['ge']} to {b['le']}"
    words = [f"{op} {b[key]}" for key, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if key in b]
    return ", ".join(words)


def _default_text(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if _is_model(type(value)):
        return model_link(type(value)) + " defaults"
    return code(yamlish(value))


def _docstring(model: type) -> str:
    """The model's own docstring, doctest examples left out, as one paragraph."""
    doc = model.__dict__.get("__doc__")
    if not doc:
        return ""
    paras = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        if para.lstrip().startswith(">>>"):
            break
        paras.append(" ".join(para.split()))
    return " ".join(paras)


def _flag_paths() -> dict[tuple[str, ...], str]:
    """ServeConfig path -> the `specray serve` flag that sets it."""
    from specray.cli.main import build_parser
    from specray.cli.serve import _FLAG_FIELDS

    serve = _subparsers(build_parser()).choices["serve"]
    long_name = {a.dest: next(s for s in a.option_strings if s.startswith("--")) for a in serve._actions
                 if a.option_strings}
    paths = {path: long_name[dest] for dest, path in _FLAG_FIELDS.items()}
    paths[("engine", "chain", "speculators")] = long_name["spec"]  # parsed by flag_overrides
    paths[("arms",)] = long_name["arm"]  # by arms_from_flags
    return paths


def config_models() -> list[tuple[type, str, tuple[str, ...] | None]]:
    """(model, where it sits in a config file, its ServeConfig path) in page order: ServeConfig, EngineConfig,
    ChainConfig, the other models ServeConfig refers to (breadth first), then each speculator's parameters."""
    from specray.deployments.config import ServeConfig
    from specray.engine.config import ChainConfig, EngineConfig
    from specray.engine.speculators.registry import MODEL_SPECULATOR_PARAMS, SPECULATOR_TYPES

    found: dict[type, tuple[str, ...]] = {ServeConfig: ()}
    queue = [ServeConfig]
    while queue:
        model = queue.pop(0)
        for name, field in model.model_fields.items():
            for sub in _models_in(field.annotation):
                if sub not in found:
                    is_list = get_origin(field.annotation) in (list, tuple)
                    found[sub] = found[model] + (name + ("[]" if is_list else ""),)
                    queue.append(sub)
    head = [ServeConfig, EngineConfig, ChainConfig]
    out = []
    for model in head + [m for m in found if m not in head]:
        path = found[model]
        where = ("the top level of a `specray serve --config` YAML file" if not path
                 else f"`{'.'.join(path)}` in a config file")
        out.append((model, where, path if all(not p.endswith("[]") for p in path) else None))
    params = {name: cls for name, (cls, _) in SPECULATOR_TYPES.items()} | dict(MODEL_SPECULATOR_PARAMS)
    for name, cls in params.items():
        if cls in found:
            continue
        found[cls] = ("engine", "chain", "params", name)
        out.append((cls, f"the `{name}` speculator's parameters: `engine.chain.params.{name}` in a config file "
                         f"(an A/B arm's `params.{name}` is merged over it)", None))
    return out


def model_sections() -> tuple[list[str], list[str]]:
    """(the models' headings, their sections)."""
    flags = _flag_paths()
    headings, lines = [], []
    for model, where, path in config_models():
        headings.append(model.__name__)
        lines += [f"## {model.__name__}", ""]
        doc = _docstring(model)
        lines += [md(doc + (" " if doc else "") + f"Where: {where}."), ""]
        rows = []
        for name, field in model.model_fields.items():
            kind = type_text(field.annotation)
            bounds = _bounds(field)
            desc = md(field.description or "")
            flag = flags.get(path + (name,)) if path is not None else None
            if flag:
                desc = sentence(desc) + f"Flag: {code(flag)}."
            rows.append([code(name), kind + (f", {bounds}" if bounds else ""), _default_text(field), desc])
        lines += table(["Field", "Type", "Default", "Description"], rows) + [""]
    return headings, lines


# ---- the page --------------------------------------------------------------------------------------------------

INTRO = f"""\
# Configuration reference

<!-- GENERATED by scripts/gen_config_reference.py from the code: do not edit by hand -->

Every setting of `specray serve` is a flag, or a field of the YAML file it reads with `--config`; the other
commands take flags. See them on your own install:

```bash
.venv/bin/specray serve --help
```

This page is generated from the code, the flags from the `specray` command's argparse parsers and the fields
from the pydantic models' descriptions, so it cannot fall behind them. After changing a flag, its help or a
field, regenerate it (a test fails while the page differs from what the script writes):

```bash
{REGEN}
```

`specray serve` takes ServeConfig's defaults, then the `--config` file's fields, then every flag given: a flag
always wins over the file, even when it repeats the default, and a flag not given never overrides the file.
A config file holds the fields of [ServeConfig](#serveconfig), nested models as nested mappings; unknown keys
are errors:

```yaml
mode: distributed
engine:
  model: smollm2-135m
  slots: 8
  chain: {{speculators: [ngram_mod, suffix], n_max: 16}}
```
"""


def render() -> str:
    commands, cli_lines = cli_sections()
    models, model_lines = model_sections()
    toc = ["Commands: " + ", ".join(f"[{c}](#{anchor(c)})" for c in commands) + ".", "",
           "Config models: " + ", ".join(f"[{m}](#{anchor(m)})" for m in models) + ".", ""]
    text = INTRO + "\n" + "\n".join(toc + cli_lines + model_lines)
    return text.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1, with a diff, if {OUT.relative_to(ROOT)} differs from what would be written")
    ap.add_argument("--out", type=Path, default=OUT,
                    help=f"the page to write or check (default: {OUT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    page = render()
    if args.check:
        old = args.out.read_text() if args.out.exists() else ""
        if old == page:
            return 0
        diff = list(difflib.unified_diff(old.splitlines(), page.splitlines(), f"{args.out} (committed)",
                                         f"{args.out} (generated)", lineterm="", n=1))
        shown = diff[:60]
        print(f"{args.out} is out of date: regenerate it with {REGEN}", file=sys.stderr)
        print("\n".join(shown + ([f"... ({len(diff) - len(shown)} more diff lines)"] if len(diff) > 60 else [])),
              file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
