"""`mars-hf`: every listed subcommand is registered, and a missing command module fails loudly."""

import importlib
import pkgutil

import pytest

import mars_hf.commands
from mars_hf import cli


def _subcommands(parser):
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return action.choices


def test_every_command_module_is_a_subcommand():
    modules = {m.name for m in pkgutil.iter_modules(mars_hf.commands.__path__)} - {"comma_lists"}
    assert {name.replace("-", "_") for name in cli.COMMANDS} == modules
    subcommands = _subcommands(cli.build_parser())
    assert list(subcommands) == cli.COMMANDS
    for name, parser in subcommands.items():
        assert parser.get_default("_run") is not None, name


def test_a_missing_command_module_is_an_error_not_a_silently_absent_command(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, "no-such-command"])
    with pytest.raises(ModuleNotFoundError, match="mars_hf.commands.no_such_command"):
        cli.build_parser()


def test_help_lists_every_command_with_its_help_text(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in cli.COMMANDS:
        module = importlib.import_module(f"mars_hf.commands.{name.replace('-', '_')}")
        assert name in text and " ".join(module.HELP.split())[:40] in text, name


@pytest.mark.parametrize("name", cli.COMMANDS)
def test_every_command_help_renders(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out
