"""The command-line reference, written from the argparse parsers themselves so that it cannot drift.

An MkDocs hook (``mkdocs.yml``: ``hooks``): a page holding ``<!-- cli-reference: ddpwatch -->``
gets every ``ddpwatch`` command's usage, options and example in its place; one holding
``<!-- cli-reference: train.py -->`` gets the training script's. ``render`` is pure, so the
suite checks the same text the site shows.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

MARKER = re.compile(r"<!-- cli-reference: (ddpwatch|train\.py) -->")


def parser_for(program: str) -> argparse.ArgumentParser:
    """The real parser of ``ddpwatch`` or of ``train.py`` (imported only when asked: train.py's brings torch)."""
    if program == "ddpwatch":
        from ddpwatch.cli import build_parser
        return build_parser()
    from instrumented_ddp.training.train import build_parser as build_train_parser
    return build_train_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name, in the order they were added (none for a plain parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The option's help as ``--help`` prints it (``%(default)s`` and ``%%`` expanded)."""
    if not action.help:
        return ""
    return parser._get_formatter()._expand_help(action)


def _flags_of(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    takes_value = action.nargs != 0
    metavar = action.metavar or (action.dest.upper() if takes_value else "")
    if action.choices and not action.metavar:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    return ", ".join(f"`{flag} {metavar}`" if takes_value else f"`{flag}`" for flag in action.option_strings)


def _default_of(action: argparse.Action) -> str:
    default: Any = action.default
    if default is None or default is argparse.SUPPRESS or action.nargs == 0 or not action.option_strings:
        return ""
    return f"`{default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = [action for action in parser._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))]
    if not rows:
        return []
    lines = ["| argument | default | meaning |", "|---|---|---|"]
    lines += [f"| {_cell(_flags_of(a))} | {_cell(_default_of(a))} | {_cell(_help_of(parser, a))} |" for a in rows]
    return lines + [""]


def _section(title: str, parser: argparse.ArgumentParser, level: str) -> list[str]:
    lines = [f"{level} `{title}`", ""]
    if parser.description:
        lines += [parser.description.strip(), ""]
    usage = parser.format_usage().rstrip().removeprefix("usage: ").splitlines()
    lines += ["```text", usage[0], *(line.removeprefix(" " * len("usage: ")) for line in usage[1:]), "```", ""]
    lines += _options_table(parser)
    if parser.epilog and parser.epilog.startswith("example:"):
        example = parser.epilog.removeprefix("example:").strip()
        lines += ["Example:", "", "```bash", example, "```", ""]
    return lines


def render(program: str, parser: argparse.ArgumentParser) -> str:
    """Markdown for ``program``: its own options, then a section per subcommand."""
    lines = _section(program, parser, "##")
    commands = subcommands(parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in commands.items():
                section = _section(f"{program} {name}", sub, "###")
                if not sub.description and summaries.get(name):
                    section[1:1] = ["", str(summaries[name])]
                lines += section
    return "\n".join(lines).rstrip() + "\n"


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs' hook: each marker replaced by its program's reference."""
    return MARKER.sub(lambda found: render(found.group(1), parser_for(found.group(1))), markdown)
