"""Relay limits and settings: defaults, a TOML config file (stdlib ``tomllib``), command-line overrides.

py-libp2p's circuit relay v2 defaults (4 reservations, 8 circuits per reservation, 1 MiB and 2 min
per circuit) are sized for a demo. One relay in front of a swarm of phones holds a reservation per
phone and a circuit per (backbone, phone) pair, each carrying expert traffic for as long as the
backbone runs; our defaults are sized for that. Every value can be set in the file or by a flag
(the flag wins); anything unknown or out of range is refused with one line.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields

from p2pswarm.errors import UserError


@dataclass
class RelaySettings:
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/8080/ws"])
    announce: list[str] = field(default_factory=list)
    identity: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    trust_issuer: list[str] = field(default_factory=list)
    open: bool = False  # no token needed (only when asked for explicitly)
    circuits_need_token: bool = False  # the dialling side of a circuit must hold a token too
    health: str | None = None  # HOST:PORT
    bootstrap: list[str] = field(default_factory=list)
    max_reservations: int = 1024
    max_circuits: int = 4096  # all circuits at once
    max_circuits_per_peer: int = 256  # circuits to one reserved peer at once
    max_circuit_bytes: int = 0  # per circuit, both directions; 0 = unlimited
    max_circuit_duration: int = 0  # seconds; 0 = unlimited
    reservation_ttl: int = 3600  # seconds

    def check(self) -> RelaySettings:
        for name in ("max_reservations", "max_circuits", "max_circuits_per_peer", "reservation_ttl"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"relay setting {name} must be a positive integer, got {v!r}")
        for name in ("max_circuit_bytes", "max_circuit_duration"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UserError(f"relay setting {name} must be an integer >= 0 (0 = unlimited), got {v!r}")
        if self.reservation_ttl < 10:
            raise UserError(f"relay setting reservation_ttl must be at least 10 s, got {self.reservation_ttl}")
        if not self.listen:
            raise UserError("the relay needs at least one listen address")
        if not self.trust_issuer and not self.open:
            raise UserError("no --trust-issuer given: name the token issuers to trust, or pass --open to run "
                            "an open relay (anyone may reserve)")
        if self.trust_issuer and self.open:
            raise UserError("--open and --trust-issuer exclude each other")
        if self.health is not None:
            host, _, port = self.health.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise UserError(f"bad health address {self.health!r}: expected HOST:PORT")
        return self


_LISTS = {"listen", "announce", "trust_issuer", "bootstrap"}


def load_settings(path: str | None, overrides: dict) -> RelaySettings:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides`` (non-None values)."""
    s = RelaySettings()
    known = {f.name for f in fields(RelaySettings)}
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise UserError(f"cannot read relay config {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"relay config {path} is not valid TOML: {exc}") from None
        data = data.get("relay", data)  # a [relay] table or top-level keys
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in known:
                raise UserError(f"relay config {path}: unknown setting {key!r} "
                                f"(known: {', '.join(sorted(known))})")
            if name in _LISTS:
                if isinstance(value, str):
                    value = [value]
                if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                    raise UserError(f"relay config {path}: {key} must be a string or a list of strings")
            setattr(s, name, value)
    for name, value in overrides.items():
        if value is None or (name in _LISTS and not value) or (isinstance(value, bool) and not value):
            continue
        setattr(s, name, value)
    return s.check()
