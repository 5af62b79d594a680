"""Every command the README and the docs show is one the real parsers accept.

A command is any ``ddpwatch …``, ``torchrun … train.py …``, ``python train.py …`` or
``python -m instrumented_ddp.train …`` in a shell block (```bash, ```sh, ```console) or in an
inline code span, split at ``&&``, ``;`` and ``|``. Each is parsed by ``ddpwatch.cli``'s parser
(and its rule that a command refuses the top-level options it does not read) or by train.py's:
an unknown flag, a missing argument or a value of the wrong type fails. Placeholders stand only
where a value is free text (``--out DIR``, ``--listen tcp://HOST:PORT``). The raw GPU outputs
(``docs/gpu-runs/``) are evidence, not instructions, and are not read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from launch import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # the docs build's hook, not a package
from cli_reference import parser_for, render, subcommands  # noqa: E402

SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
SEPARATORS = {"&&", "||", ";", "|", "&"}
TRAIN_MODULES = {"instrumented_ddp.train", "instrumented_ddp.training.train"}


class Command(NamedTuple):
    where: str  # file:line
    program: str  # "ddpwatch" or "train.py"
    argv: list[str]
    inline: bool  # in a code span of the prose, not a shell block


def documents() -> list[Path]:
    docs = [path for path in sorted((REPO_ROOT / "docs").rglob("*.md")) if "gpu-runs" not in path.parts]
    return [REPO_ROOT / "README.md", *docs]


def shell_lines(text: str) -> list[tuple[int, str, bool]]:
    """Each shell block's commands with their line numbers, continuation lines joined and
    prompts (``$ ``) dropped; then each inline code span that starts with a program (True)."""
    found: list[tuple[int, str, bool]] = []
    for block in SHELL_BLOCK.finditer(text):
        first_line = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", first_line
        for offset, line in enumerate(block.group(1).splitlines()):
            if not pending:
                start = first_line + offset
            pending += line.rstrip().removeprefix("$ ")
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            found.append((start, pending, False))
            pending = ""
    for span in INLINE_CODE.finditer(text):
        code = span.group(1).strip()
        if re.match(r"(ddpwatch|torchrun|python3? (train\.py|-m instrumented_ddp\.train))\b", code):
            found.append((text.count("\n", 0, span.start()) + 1, code, True))
    return found


def simple_commands(line: str) -> list[list[str]]:
    """A shell line as its simple commands' words (comments dropped, split at separators)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    commands: list[list[str]] = []
    for word in lexer:
        if word in SEPARATORS:
            commands.append(words)
            words = []
        else:
            words.append(word)
    return [command for command in [*commands, words] if command]


def program_and_argv(words: list[str]) -> tuple[str, list[str]] | None:
    """``("ddpwatch", argv)`` or ``("train.py", argv)`` where ``words`` run one of them."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value before the program
        words = words[1:]
    if not words:
        return None
    if words[0] == "ddpwatch":
        return "ddpwatch", words[1:]
    if words[0] in ("torchrun", "python", "python3"):
        for i, word in enumerate(words[1:], start=1):
            if word.endswith("train.py"):
                return "train.py", words[i + 1:]
            if word == "-m" and i + 1 < len(words):
                if words[i + 1] in TRAIN_MODULES:
                    return "train.py", words[i + 2:]
                if words[i + 1] == "ddpwatch":
                    return "ddpwatch", words[i + 2:]
                return None
    return None


def documented_commands() -> list[Command]:
    commands = []
    for path in documents():
        for line_number, line, inline in shell_lines(path.read_text()):
            try:
                split = simple_commands(line)
            except ValueError:  # unbalanced quotes: not a shell command
                continue
            for words in split:
                found = program_and_argv(words)
                if found is not None:
                    commands.append(Command(f"{path.relative_to(REPO_ROOT)}:{line_number}", *found, inline))
    return commands


def refusal(program: str, argv: list[str], inline: bool = False) -> str | None:
    """What the real parser says of ``argv`` (None where it accepts it). ``inline``: prose names
    a command by itself (`` `ddpwatch switch` ``): a lone word need only be one of its commands."""
    parser = parser_for(program)
    if inline and len(argv) <= 1 and not (argv and argv[0].startswith("-")):
        names = subcommands(parser)
        return None if not argv or argv[0] in names else f"{argv[0]} is not one of {program}'s commands"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            args = parser.parse_args(argv)
    except SystemExit as exit:
        return None if exit.code == 0 else stderr.getvalue().strip() or f"exit {exit.code}"
    if program == "ddpwatch":
        from ddpwatch.cli import refuse_unread_options
        try:
            refuse_unread_options(args, parser)
        except ValueError as error:
            return str(error)
    return None


COMMANDS = documented_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.program} {' '.join(c.argv)}"[:120] for c in COMMANDS])
def test_the_documented_command_parses(command: Command) -> None:
    assert refusal(command.program, command.argv, command.inline) is None, f"{command.where}: {command.program} {shlex.join(command.argv)}"


def test_the_readme_and_the_docs_show_commands_of_both_programs() -> None:
    programs = {c.program for c in COMMANDS}
    assert programs == {"ddpwatch", "train.py"}
    assert any(c.where.startswith("README.md") and c.argv[:1] == ["demo"] for c in COMMANDS)


def test_a_line_splits_into_its_programs_commands() -> None:
    line = "FOO=1 torchrun --nproc_per_node=2 train.py --strategy async & ddpwatch record --out runs/a  # two"
    assert [program_and_argv(words) for words in simple_commands(line)] == [
        ("train.py", ["--strategy", "async"]), ("ddpwatch", ["record", "--out", "runs/a"])]
    assert program_and_argv(["python", "-m", "instrumented_ddp.train", "--steps", "5"]) == ("train.py", ["--steps", "5"])
    assert program_and_argv(["pip", "install", "-e", "."]) is None


def test_blocks_join_continued_lines_and_inline_spans_count() -> None:
    text = "Run\n\n```bash\n$ torchrun --nproc_per_node=2 \\\n    train.py --steps 5\n```\n\nthen `ddpwatch summary runs/a`.\n"
    assert shell_lines(text) == [(4, "torchrun --nproc_per_node=2      train.py --steps 5", False),
                                 (8, "ddpwatch summary runs/a", True)]


@pytest.mark.parametrize(("program", "argv", "said"), [
    ("ddpwatch", ["record", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("ddpwatch", ["replay", "runs/a", "--speed", "N"], "invalid float value"),
    ("ddpwatch", ["--listen", "tcp://127.0.0.1:6001", "demo"], "--listen does nothing for demo"),
    ("train.py", ["--strategy", "nine"], "invalid choice"),
])
def test_a_command_the_parser_refuses_is_caught(program: str, argv: list[str], said: str) -> None:
    assert said in (refusal(program, argv) or "")


def test_prose_may_name_a_command_but_not_one_that_does_not_exist() -> None:
    assert refusal("ddpwatch", ["switch"], inline=True) is None
    assert refusal("ddpwatch", ["switch"]) is not None  # in a shell block: its strategy is missing
    assert "not one of ddpwatch's commands" in (refusal("ddpwatch", ["swich"], inline=True) or "")


@pytest.mark.parametrize("program", ["ddpwatch", "train.py"])
def test_the_cli_reference_names_every_command_and_option(program: str) -> None:
    parser = parser_for(program)
    page = render(program, parser)
    for name, sub in [("", parser), *subcommands(parser).items()]:
        title = f"{program} {name}" if name else program
        assert f"`{title}`" in page
        for action in sub._actions:
            if not isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
                for flag in action.option_strings:
                    assert f"`{flag}" in page, f"{program} {name}: {flag}"
