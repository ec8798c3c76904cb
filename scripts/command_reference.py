"""Write docs/commands.md, the command reference, from each console command's `--help`.

    python scripts/command_reference.py           # rewrite docs/commands.md
    python scripts/command_reference.py --check   # exit 1 if docs/commands.md is stale

The help is rendered in-process by click, as `--help` prints it, at a fixed width and with no
PS_ variable in effect, so the page is the same on every machine and terminal. A group's
subcommands (ps-bench's) follow it. tests/test_docs.py fails when the page is stale.
"""

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "commands.md"
WIDTH = 100  # every command's max_content_width; the terminal's width is not asked

# Each console script of pyproject.toml's [project.scripts], and the module whose `command`
# it runs (through common.startup.run_command). tests/test_docs.py checks the two agree.
COMMANDS = {
    "ps-server": "psserver.cli.server",
    "ps-worker": "psworker.cli",
    "ps-local": "psserver.cli.local",
    "ps-status": "psserver.cli.status",
    "ps-plot": "psserver.cli.plot",
    "ps-keys": "psserver.cli.keys",
    "ps-bench": "psserver.bench.cli",
}

INTRO = """\
# Command reference

This page is generated from each command's `--help` by `python scripts/command_reference.py`;
edit the commands' help texts, not this page. What the options do together is told in the
other pages ([README](../README.md#documentation)).

Every option can also be set from the environment as `PS_` and the option's name in capitals
(`PS_WORKERS=4 ps-server`; `ps-bench`'s take the subcommand's name too: `PS_COMM_ROUNDS=50
ps-bench comm`). A bad option or a bad state ends with a single `Error: ...` line, never a
traceback. An option of the wrong type, out of its range or not among its choices exits 2
(naming the `PS_` variable when it came from one); other bad options (ones that do not fit
together, say `--resume` without `--checkpoint-dir`) and a bad state (no CUDA, missing data, a
corrupt checkpoint, a busy port, no server) exit 1.
"""


@contextlib.contextmanager
def plain_environment() -> Iterator[None]:
    """No PS_ variable and no terminal size from the environment while the help is rendered."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith("PS_") or key in ("COLUMNS", "LINES"):
            del os.environ[key]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def help_text(command: click.Command, name: str, parent: click.Context | None) -> str:
    """`command --help` as click prints it, WIDTH columns wide."""
    settings = {**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    ctx = click.Context(command, info_name=name, parent=parent, **settings)
    return command.get_help(ctx)


def sections(command: click.Command, name: str, parent: click.Context | None = None) -> list[str]:
    """The page's section for `command`, and one for each of its subcommands, in order."""
    level = "#" * (2 if parent is None else 3)
    path = name if parent is None else f"{parent.command_path} {name}"
    found = [f"{level} `{path}`\n\n```text\n{help_text(command, name, parent).rstrip()}\n```\n"]
    if isinstance(command, click.Group):
        settings = {**command.context_settings, "terminal_width": WIDTH}
        ctx = click.Context(command, info_name=name, parent=parent, **settings)
        for sub in command.list_commands(ctx):
            subcommand = command.get_command(ctx, sub)
            assert subcommand is not None, sub
            found.extend(sections(subcommand, sub, ctx))
    return found


def render() -> str:
    """The whole page."""
    with plain_environment():
        parts = [INTRO]
        for name, module in COMMANDS.items():
            parts.extend(sections(importlib.import_module(module).command, name))
    return "\n".join(parts)


@click.command()
@click.option("--check", is_flag=True, help="Only check that docs/commands.md is up to date.")
def main(check: bool) -> None:
    """Write docs/commands.md from the commands' --help."""
    page = render()
    if check:
        if not PAGE.exists() or PAGE.read_text() != page:
            sys.exit(f"{PAGE} is stale: run python scripts/command_reference.py")
        return
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(page)
    click.echo(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
