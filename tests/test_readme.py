"""Every command in the README's command table is one the CLI takes as written (once the
`slice --layers 0-47` example failed on the model the README had just made). The quick test parses
each with the real argument parser (optional parts `[...]` included, the first of `a|b`); the slow
one runs the file commands for real, in order, on the model `make-model` writes."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import run_cli
from p2pswarm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
# one-letter placeholders of numeric options (`--workers N`, `--temperature T`): a sample value
PLACEHOLDERS = {"N": "2", "T": "0.7", "P": "0.9", "S": "1"}


def readme_commands() -> list[str]:
    """The `p2pswarm ...` commands of the README's command table (first column), as written."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Commands", 1)[1].split("\n\n", 2)[1]
    cmds = []
    for row in table.splitlines()[2:]:
        first = row.split(" | ")[0].lstrip("| ")
        cmds += [c for c in re.findall(r"`([^`]+)`", first) if c.startswith("p2pswarm ")]
    return cmds


def as_argv(cmd: str, *, optional: bool) -> list[str] | None:
    """``cmd``'s arguments: ``[...]`` parts kept (``optional``) or dropped, ``a\\|b`` -> ``a``.
    None for a row that elides part of the command (``...`` as an argument)."""
    cmd = cmd.replace("\\|", "|")
    while True:  # innermost [...] first
        inner = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1) if optional else "", cmd)
        if inner == cmd:
            break
        cmd = inner
    argv = [re.sub(r"\|.*", "", a) if not a.startswith(("/", "shard:")) else a for a in shlex.split(cmd)[1:]]
    argv = [PLACEHOLDERS.get(a, a) for a in argv]
    return None if "..." in argv[1:2] or argv[:1] == ["..."] else argv


def test_readme_lists_commands():
    cmds = readme_commands()
    assert len(cmds) >= 15 and any(c.startswith("p2pswarm slice ") for c in cmds), cmds


@pytest.mark.parametrize("cmd", readme_commands())
def test_readme_command_parses_as_written(cmd, capsys):
    parser = build_parser()
    for optional in (False, True):
        argv = as_argv(cmd, optional=optional)
        if argv is None:
            continue
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"README command does not parse ({'with' if optional else 'without'} its optional parts): "
                        f"p2pswarm {' '.join(argv)}\n{capsys.readouterr().err}")


@pytest.mark.slow
def test_readme_file_commands_run_as_written(tmp_path):
    """make-model, slice, tokenize, logits and generate, run in the README's order in one folder,
    each without its optional parts: all succeed on the model make-model wrote."""
    ran = []
    for cmd in readme_commands():
        argv = as_argv(cmd, optional=False)
        if argv is None or argv[0] not in ("make-model", "slice", "tokenize", "logits", "generate"):
            continue
        proc = run_cli(*argv, env={"P2PSWARM_KERNEL": "numpy"}, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, f"p2pswarm {' '.join(argv)}:\n{proc.stderr[-2000:]}"
        ran.append(argv[0])
    assert ran[0] == "make-model" and {"slice", "tokenize", "logits", "generate"} <= set(ran), ran
    assert (tmp_path / "shard.gguf").is_file() and (tmp_path / "backbone.gguf").is_file()
