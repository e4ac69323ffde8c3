"""The deployment files under bootstrap/ read as systemd, the CLI and the relay read them: the
parsing helpers tests/test_deploy_files.py checks them with."""
from __future__ import annotations

from __future__ import annotations
import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path
import pytest
from p2pswarm.cli import build_parser
from p2pswarm.relay.config import RelaySettings, load_settings

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is tests/helpers/)
BOOT = ROOT / "bootstrap"
SYSTEMD = BOOT / "systemd"
RELAY_TOML = BOOT / "relay.toml"
ENV_FILE = BOOT / "p2pswarm.env"
INSTANCE_ENV = BOOT / "relay-instance.env"  # /etc/p2pswarm/relay-N.env of p2pswarm-relay@N.service
CONTAINERFILE = BOOT / "Containerfile"
DEPLOY_MD = ROOT / "docs" / "deploy.md"

VENV_BIN = "/opt/p2pswarm/venv/bin/p2pswarm"
STATE_DIR = "/var/lib/p2pswarm"
# Deployed path -> the file in this repository.
DEPLOYED = {"/etc/p2pswarm/relay.toml": RELAY_TOML}
# Values relay.toml states on purpose (everything else must be p2pswarm/relay/config.py's default).
STATED = {
    "announce": ["/dns4/relay.example.com/tcp/443/wss"],
    "identity": "/var/lib/p2pswarm/identity/relay.key",
    "trust_issuer": ["12D3KooW-REPLACE-WITH-YOUR-ISSUER-PEER-ID"],
    "health": "127.0.0.1:8081",
    "reservation_ttl": 90,
}
UNITS = sorted(SYSTEMD.glob("*.service"))
REQUIRED_UNITS = {"p2pswarm-relay.service", "p2pswarm-bootstrap.service", "p2pswarm-backbone.service"}
RELAY_ARGS = ("listen", "announce", "identity", "tls_cert", "tls_key", "trust_issuer", "open", "circuits_need_token",
              "health", "bootstrap", "max_reservations", "max_circuits", "max_circuits_per_peer",
              "max_circuit_bytes", "max_circuit_duration", "reservation_ttl")


# -- parsing helpers ---------------------------------------------------------------------------------
def read_unit(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) in file order; keys may repeat (systemd semantics)."""
    out, section, pending = [], None, ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        assert "=" in line and section, f"{path.name}: not a key=value line inside a section: {line!r}"
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def unit_values(entries, key: str, section: str = "Service") -> list[str]:
    """All values of ``key``, an empty assignment resetting the list (as systemd does)."""
    vals: list[str] = []
    for s, k, v in entries:
        if s == section and k == key:
            vals = [] if v == "" else [*vals, v]
    return vals


def unit_value(entries, key: str, section: str = "Service") -> str | None:
    vals = [v for s, k, v in entries if s == section and k == key]
    return vals[-1] if vals else None


def effective(unit: Path) -> list[tuple[str, str, str]]:
    """The unit plus its drop-ins (``NAME.service.d/*.conf``), in systemd's order."""
    entries = read_unit(unit)
    for conf in sorted((unit.parent / f"{unit.name}.d").glob("*.conf")):
        entries += read_unit(conf)
    return entries


def variants(unit: Path) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The unit alone, and the unit with each of its drop-ins: each is a way it is deployed."""
    out = [(unit.name, read_unit(unit))]
    for conf in sorted((unit.parent / f"{unit.name}.d").glob("*.conf")):
        out.append((f"{unit.name} + {conf.name}", read_unit(unit) + read_unit(conf)))
    return out


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path.name}: bad line {raw!r}"
        env[key] = value
    return env


def env_samples() -> dict[str, str]:
    env = read_env_file(ENV_FILE)
    env.setdefault("CREDENTIALS_DIRECTORY", "/run/credentials/p2pswarm-relay.service")
    return env


def unit_env(name: str) -> dict[str, str]:
    """The environment a unit's ExecStart sees: p2pswarm.env, plus the instance file of a template."""
    return {**env_samples(), **(read_env_file(INSTANCE_ENV) if "@" in name else {})}


def substitute(cmdline: str, env: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in env, f"${name} is used but bootstrap/p2pswarm.env does not set it: {cmdline}"
        return env[name]

    out = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", one, cmdline)
    assert "$" not in out, out
    return out


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """The real parser; an argparse error becomes a test failure that shows its message."""
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`p2pswarm {shlex.join(argv)}` does not parse (exit {exc.code}): {err.getvalue().strip()}")
    # argparse accepts unambiguous abbreviations (--layer for --layers): a file must spell options out.
    options, p = set(parser._option_string_actions), parser
    for token in argv:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            p = subs[0].choices[token]
            options |= set(p._option_string_actions)
        elif token.startswith("--"):
            assert token.split("=", 1)[0] in options, f"`p2pswarm {shlex.join(argv)}`: {token} is not spelled out"
    return args


def relay_settings(args: argparse.Namespace) -> RelaySettings:
    """What `p2pswarm relay` does with its arguments (p2pswarm/commands/relay.py), with the deployed
    config path mapped to the repository's file."""
    config = args.config
    if config is not None:
        assert config in DEPLOYED, f"relay --config {config}: not a file bootstrap/ provides"
        config = str(DEPLOYED[config])
    return load_settings(config, {k: getattr(args, k) for k in RELAY_ARGS})


def exec_start(name: str, entries) -> list[str]:
    starts = unit_values(entries, "ExecStart")
    assert len(starts) == 1, f"{name}: expected one effective ExecStart=, got {starts}"
    argv = shlex.split(substitute(starts[0], unit_env(name)))
    assert argv[0] == VENV_BIN, f"{name}: ExecStart runs {argv[0]}, not {VENV_BIN}"
    return argv[1:]


def listen_ports(args: argparse.Namespace) -> list[int]:
    listen = relay_settings(args).listen if args.command == "relay" else (args.listen or [])
    ports = []
    for a in listen if isinstance(listen, list) else [listen]:
        m = re.search(r"/tcp/(\d+)", a)
        assert m, a
        ports.append(int(m.group(1)))
    return ports
