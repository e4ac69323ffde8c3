"""Every command's every option explains itself (argparse help=), `p2pswarm --version` works, and
error messages keep whole words and ids."""
from __future__ import annotations

import argparse
import re
from importlib import metadata

import pytest

from conftest import run_cli

from p2pswarm.cli import COMMANDS, _no_default, build_parser


def _subparsers(parser: argparse.ArgumentParser):
    """(command path, parser) for every (sub)command, nested subcommands included."""
    todo = [("p2pswarm", parser)]
    while todo:
        name, p = todo.pop()
        yield name, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend((f"{name} {sub}", sp) for sub, sp in action.choices.items())


def test_every_option_of_every_command_has_help():
    parser = build_parser()
    seen, missing = set(), []
    for name, p in _subparsers(parser):
        seen.add(name)
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, "options without help text: " + ", ".join(sorted(missing))
    # every command of the CLI was walked (a command not wired in would be missed silently)
    assert {f"p2pswarm {c.replace('_', '-')}" for c in COMMANDS} <= seen, sorted(seen)


def _shown(default) -> set[str]:
    """How a default may appear in help text: 30.0 as "30.0" or "30", a string as itself or quoted."""
    forms = {str(default), repr(default)}
    if isinstance(default, float):
        forms.add(f"{default:g}")
    return forms


def test_every_default_is_stated():
    """Every option with a default says it in --help: the issue's examples by name (node --http
    127.0.0.1:8000, --timeout 30, ...), and all others by the same rule."""
    parser = build_parser()
    unstated = []
    shown_for = {}
    for name, p in _subparsers(parser):
        fmt = p._get_formatter()
        for action in p._actions:
            if not action.option_strings or _no_default(action.default):
                continue
            text = fmt._expand_help(action)
            shown_for[(name, action.option_strings[-1])] = text
            if not any(f in text for f in _shown(action.default)):
                unstated.append(f"{name} {action.option_strings[-1]} (default {action.default!r}): {text!r}")
    assert not unstated, "\n".join(unstated)
    for key, text in {("p2pswarm node", "--http"): "127.0.0.1:8000", ("p2pswarm node", "--timeout"): "30",
                      ("p2pswarm generate", "--timeout"): "30", ("p2pswarm demo", "--transport"): "socket",
                      ("p2pswarm demo", "--prompt"): "A swarm of phones"}.items():
        assert text in shown_for[key], (key, shown_for[key])


@pytest.mark.slow
def test_version_prints_the_package_version():
    proc = run_cli("--version", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"p2pswarm \S+\n", proc.stdout), proc.stdout
    assert proc.stdout.split()[1] == metadata.version("p2pswarm")


def test_clip_keeps_whole_words_and_ids():
    from p2pswarm.errors import clip

    peer = "12D3KooWFr51g7njXDNitqg1LDiaeAy37BXfJAUwaGN7S263sZh4"
    assert clip(f"cannot dial {peer}:\n  connection refused") == f"cannot dial {peer}: connection refused"
    long = " ".join(["word"] * 100)
    cut = clip(f"{long} {peer}", 60)
    assert cut.endswith(" [...]") and len(cut) <= 66 and set(cut[:-6].split()) == {"word"}
    assert clip("x" * 100, 10) == "x" * 10 + " [...]"  # one huge token: cut, but marked
