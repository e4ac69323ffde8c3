"""The one entry point: ``p2pswarm <command> ...``.

Each command lives in its own module under ``p2pswarm/commands/`` and exports
``add_parser(subparsers)`` and ``run(args) -> int``. This file only wires them up and turns the
project's expected failures (:class:`p2pswarm.errors.SwarmError`) into one clear line on stderr and a
non-zero exit (2 for the user's input, 1 for a peer's or our fault), never a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
from importlib import metadata
import logging
import signal
import sys
import threading

from p2pswarm import settings
from p2pswarm.errors import PeerError, SwarmError, UserError, first_error

# Order is the order `p2pswarm --help` lists them in.
COMMANDS = [
    "demo",
    "make_model",
    "slice",
    "tokenize",
    "logits",
    "generate",
    "worker",
    "node",
    "bootstrap",
    "swarm_status",
    "rewards",
    "relay",
    "identity",
    "token",
    "manifest",
    "fetch",
    "serve_shards",
]


def package_version() -> str:
    """The version in the installed package's metadata (what pip installed), not a copy here."""
    try:
        return metadata.version("p2pswarm")
    except metadata.PackageNotFoundError:
        return "unknown (p2pswarm is not installed: pip install -e .)"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it: one rule for
    every command, so no option's default goes unstated (argparse's own ArgumentDefaultsHelpFormatter
    would repeat the defaults that help texts already explain, and print "default: None")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and "default" not in text.lower() and "%(default)" not in text
                and not _no_default(action.default)):
            text += " (default: %(default)s)"
        return text


def _no_default(value) -> bool:
    """None, a flag's False/True, an empty list or string: nothing worth stating (0 is a default)."""
    return value is None or isinstance(value, bool) or value == argparse.SUPPRESS or value in ([], "")


class Parser(argparse.ArgumentParser):
    """The parser class of the CLI and all its subcommands: shares :class:`DefaultsHelpFormatter`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="p2pswarm",
        description="Serve a Mixture-of-Experts model from a swarm, cut at the grain of one expert.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: INFO, or $P2PSWARM_LOG_LEVEL)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the installed p2pswarm version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"p2pswarm.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        with _ctrl_c_deferred():
            parser = build_parser()
        return _main(parser, argv)
    except KeyboardInterrupt:  # Ctrl-C before a command runs (importing the commands takes a moment)
        print("p2pswarm: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _ctrl_c_deferred():
    """SIGINT blocked while the commands import; one that came meanwhile is delivered after.

    Why: a KeyboardInterrupt raised inside an import can surface in other shapes. Python 3.11 wraps
    one raised in a class's ``__set_name__`` (dataclasses) in a RuntimeError, which printed a
    traceback. And the interpreter sometimes killed itself with SIGINT at exit after our one line
    (exit -2, not 130; atexit ran, no exception was left): CPython's unhandled-interrupt flag was
    set, most likely by an extension module that runs Python code through ``PyRun_String`` while
    it initialises (PyO3's ``py.run``; cryptography's bindings are PyO3), which sets it when a
    KeyboardInterrupt leaves that code, even if ours catches it later. Measured: 3 of 80 Ctrl-Cs 0.27-0.36 s into ``python -m
    p2pswarm.cli demo``. Blocked, the signal waits in the kernel and raises KeyboardInterrupt in
    our code once the imports are done (a second or less)."""
    block = (hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
             and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if not block:
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _main(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    level = "DEBUG" if args.verbose else settings.LOG_LEVEL.get()
    level = level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO"
    # Our loggers at the chosen level; libraries' (py-libp2p logs chatty DEBUG lines through the
    # root logger) at INFO at most, so a debug log stays readable.
    logging.basicConfig(level="INFO" if level == "DEBUG" else level,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("p2pswarm").setLevel(level)
    try:
        return int(args.func(args) or 0)
    except SwarmError as exc:
        return _one_line(args.command, exc)
    except BaseExceptionGroup as group:  # trio nurseries wrap errors; show the first one plainly
        leaf = first_error(group)
        if isinstance(leaf, SwarmError):
            return _one_line(args.command, leaf)
        if isinstance(leaf, KeyboardInterrupt):
            print(f"p2pswarm {args.command}: interrupted", file=sys.stderr)
            return 130
        raise
    except KeyboardInterrupt:
        print(f"p2pswarm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1


def _one_line(command: str, exc: SwarmError) -> int:
    """Print an expected failure as one line; exit 2 for the user's input, 1 for a peer's fault
    (named) or ours (p2pswarm.errors)."""
    peer = f" (peer {exc.peer})" if isinstance(exc, PeerError) and exc.peer and exc.peer not in str(exc) else ""
    print(f"p2pswarm {command}: error: {exc}{peer}", file=sys.stderr)
    return 2 if isinstance(exc, UserError) else 1


if __name__ == "__main__":
    sys.exit(main())
