"""Every option of every `pipeline` command says what it does in --help: the walk
covers the whole click tree (the global options, subgroups such as `topics`,
`index`, `model`, `offsets`), so an option added without help fails here. No broker."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main


def walk(
    command: click.Command, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Each command of the tree with the words that name it, the groups included."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from walk(sub, (*path, name))


def options(root: click.Command) -> Iterator[tuple[str, click.Option]]:
    for path, command in walk(root):
        for param in command.params:
            if isinstance(param, click.Option):
                yield " ".join(("pipeline", *path, param.opts[0])), param


def missing_help(root: click.Command) -> list[str]:
    return [name for name, option in options(root) if not (option.help or "").strip()]


def unshown_defaults(root: click.Command) -> list[str]:
    """Valued options with a default that --help neither shows nor states. (An option
    without one has None, or a sentinel in click 8.3, as its `default`.)"""
    return [
        name
        for name, option in options(root)
        if not option.is_flag
        and isinstance(option.default, int | float | str)
        and not option.show_default
        and "default" not in (option.help or "")
    ]


ALL_COMMANDS = [" ".join(path) for path, _ in walk(main)]


def test_the_walk_reaches_every_subgroup() -> None:
    for expected in (
        "run",
        "produce",
        "status",
        "audit",
        "search",
        "compact",
        "topics create",
        "index rebuild",
        "index check",
        "model check",
        "offsets reset",
    ):
        assert expected in ALL_COMMANDS


def test_every_option_has_help() -> None:
    assert missing_help(main) == []


def test_every_default_is_shown() -> None:
    assert unshown_defaults(main) == []


def test_every_output_option_takes_a_directory_or_s3() -> None:
    outputs = [(name, option) for name, option in options(main) if option.name == "output"]
    commands = {name.rsplit(" ", 1)[0] for name, _ in outputs}
    assert commands >= {
        "pipeline run",
        "pipeline audit",
        "pipeline status",
        "pipeline search",
        "pipeline compact",
        "pipeline index rebuild",
        "pipeline index check",
    }
    for name, option in outputs:
        assert "s3://" in (option.help or ""), name
        assert "director" in (option.help or ""), name


def test_the_walk_catches_an_option_without_help() -> None:
    @click.group()
    @click.option("--fine", help="Says what it does.")
    def root(fine: str) -> None:
        pass

    @root.group()
    def inner() -> None:
        pass

    @inner.command()
    @click.option("--bare", default=3)
    @click.option("--flag", is_flag=True, help="")
    def leaf(bare: int, flag: bool) -> None:
        pass

    assert missing_help(root) == ["pipeline inner leaf --bare", "pipeline inner leaf --flag"]
    assert unshown_defaults(root) == ["pipeline inner leaf --bare"]


@pytest.mark.parametrize("command", [c for c in ALL_COMMANDS if c])
def test_help_renders(command: str) -> None:
    result = CliRunner().invoke(main, [*command.split(), "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output
    for line in result.output.splitlines():
        if line.strip().startswith("--output"):
            assert "DIR|s3://BUCKET/PREFIX" in line
