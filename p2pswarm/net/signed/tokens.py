"""Node tokens: signed capabilities that say what one peer may ask of the swarm's services.

Why tokens: the relay and the shard servers spend bandwidth on whoever connects. A token is an
operator's (issuer's) statement "peer H may reserve relay slots / download these experts until T",
signed with the issuer's Ed25519 node key. A service trusts a fixed set of issuer peer ids and
checks every request against the peer id Noise authenticated for the connection, so a token is
useless to anyone but its holder: copying it off a phone gains nothing.

Wire form (one line, safe in a shell argument, a file or an environment variable)::

    p2pswarm-token-v1:<base64url, no padding, of msgpack {"body": bin, "sig": bin}>

``body`` is a msgpack map ``{"v": 1, "iss": str, "hold": str, "allow": [str], "iat": int,
"exp": int}``; ``sig`` is Ed25519 over ``b"p2pswarm-token-v1\\0" + body`` by the key the issuer's
peer id embeds (an Ed25519 peer id carries its public key, so no key distribution is needed beyond
the issuer's peer id). The body must be the canonical encoding of its fields: a re-encoding
question can never make two parties disagree on what was signed.

Scopes (``allow``): ``relay`` (hold relay reservations), ``shard`` (download any expert range of any
model), ``shard:<model fingerprint or *>`` (any range of one model) and
``shard:<model or *>:<A>-<B>:<C>-<D>`` (layers A..B and experts C..D, inclusive).

No libp2p import here: checking a token is pure Python + ``cryptography``.
"""
from __future__ import annotations

import base64
import binascii
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeGuard
from pathlib import Path

import msgpack

from p2pswarm.errors import SwarmError, UserError
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import short_str
from p2pswarm.signatures import peer_public_key, verify_peer_signature

log = logging.getLogger("p2pswarm.tokens")

TOKEN_PREFIX = "p2pswarm-token-v1:"
TOKEN_VERSION = 1
SIGNING_DOMAIN = b"p2pswarm-token-v1\x00"
SCOPE_RELAY = "relay"
SCOPE_SHARD = "shard"
#: The scope an --auto worker's token needs, said the same way in the docs, --help and errors.
AUTO_SCOPE = "--allow shard (any model) or --allow shard:FINGERPRINT (one model), with no ranges"
MAX_TOKEN_CHARS = 4096
MAX_ALLOW = 32
MAX_SCOPE_CHARS = 256
MAX_PEER_ID_CHARS = 128
MAX_TTL_S = 366 * 24 * 3600
CLOCK_SKEW_S = 300  # a token "issued" up to 5 minutes in the future is accepted (clocks drift)

_B64URL_RE = re.compile(r"[A-Za-z0-9_-]+={0,2}")
_RANGE = r"(\d{1,6})-(\d{1,6})"
_SHARD_SCOPE_RE = re.compile(rf"^shard(?::([0-9a-fA-F]{{1,64}}|\*)(?::{_RANGE}:{_RANGE})?)?$")


class TokenError(UserError):
    """A token that is missing, malformed, forged, expired, someone else's or too narrow.

    ``reason`` is a short, stable key for counting refusals ("expired", "wrong holder", ...);
    ``str()`` is the one-line explanation for logs and users."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


# ---- scopes ----------------------------------------------------------------------------------
def shard_scope(model: str, layers: tuple[int, int], experts: tuple[int, int]) -> str:
    """The scope a download of experts ``[experts)`` of layers ``[layers)`` (half-open) of ``model``
    (a fingerprint, or ``*``) needs, written inclusive: ``shard:<model>:<a>-<b>:<c>-<d>``."""
    (l0, l1), (e0, e1) = layers, experts
    if not (0 <= l0 < l1) or not (0 <= e0 < e1):
        raise TokenError(f"empty or negative range in shard scope (layers {l0}..{l1}, experts {e0}..{e1})",
                         "bad scope")
    return f"shard:{model}:{l0}-{l1 - 1}:{e0}-{e1 - 1}"


def parse_scope(scope: str) -> tuple[str, str | None, tuple[int, int] | None, tuple[int, int] | None]:
    """``(kind, model, layers, experts)`` with inclusive ranges; None where the scope is open.
    TokenError for anything that is not a scope we know (a typo must not pass silently)."""
    if not isinstance(scope, str) or not scope or len(scope) > MAX_SCOPE_CHARS:
        raise TokenError(f"bad scope {str(scope)[:40]!r}", "bad scope")
    if scope == SCOPE_RELAY:
        return SCOPE_RELAY, None, None, None
    m = _SHARD_SCOPE_RE.match(scope)
    if not m:
        raise TokenError(f"bad scope {scope[:60]!r}: expected relay, shard, shard:MODEL or "
                         f"shard:MODEL:A-B:C-D (MODEL a fingerprint or *)", "bad scope")
    model, la, lb, ea, eb = m.groups()
    if la is None:
        return SCOPE_SHARD, model, None, None
    layers, experts = (int(la), int(lb)), (int(ea), int(eb))
    if layers[1] < layers[0] or experts[1] < experts[0]:
        raise TokenError(f"bad scope {scope[:60]!r}: a range A-B needs A <= B", "bad scope")
    return SCOPE_SHARD, model.lower(), layers, experts


def scope_covers(allowed: str, requested: str) -> bool:
    """Whether an allow-scope grants a requested scope (see module doc)."""
    try:
        akind, amodel, alayers, aexperts = parse_scope(allowed)
        rkind, rmodel, rlayers, rexperts = parse_scope(requested)
    except TokenError:
        return False
    if akind != rkind:
        return False
    if akind == SCOPE_RELAY or amodel is None:
        return True
    if amodel != "*" and (rmodel is None or rmodel == "*" or rmodel.lower() != amodel.lower()):
        return False
    if alayers is None or aexperts is None:  # (a scope has both ranges or neither)
        return True
    if rlayers is None or rexperts is None:
        return False
    return (alayers[0] <= rlayers[0] and rlayers[1] <= alayers[1]
            and aexperts[0] <= rexperts[0] and rexperts[1] <= aexperts[1])


# ---- the token -------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeToken:
    """A capability: ``holder`` may do what ``allow`` says until ``expires_at``, says ``issuer``."""

    issuer: str  # base58 peer id of the issuer (Ed25519: its public key is embedded)
    holder: str  # base58 peer id of the holder
    allow: tuple[str, ...]
    issued_at: int  # unix seconds
    expires_at: int  # unix seconds
    signature: bytes

    def body(self) -> bytes:
        """The canonical signed bytes."""
        return msgpack.packb({"v": TOKEN_VERSION, "iss": self.issuer, "hold": self.holder, "allow": list(self.allow),
                              "iat": self.issued_at, "exp": self.expires_at}, use_bin_type=True)

    def encode(self) -> str:
        wire = msgpack.packb({"body": self.body(), "sig": self.signature}, use_bin_type=True)
        return TOKEN_PREFIX + base64.urlsafe_b64encode(wire).decode().rstrip("=")

    def verify_signature(self) -> bool:
        return verify_peer_signature(self.issuer, SIGNING_DOMAIN + self.body(), self.signature)

    def allows(self, scope: str) -> bool:
        return any(scope_covers(a, scope) for a in self.allow)

    @classmethod
    def decode(cls, text: str) -> NodeToken:
        """Parse (not check) a token; TokenError for anything malformed. Sizes are bounded before
        anything is decoded."""
        if not isinstance(text, str):
            raise TokenError("malformed token: not text")
        text = text.strip()
        if len(text) > MAX_TOKEN_CHARS:
            raise TokenError(f"malformed token: {len(text)} characters, at most {MAX_TOKEN_CHARS}")
        if not text.startswith(TOKEN_PREFIX):
            raise TokenError(f"malformed token: does not start with {TOKEN_PREFIX!r}")
        b64 = text[len(TOKEN_PREFIX):]
        if not _B64URL_RE.fullmatch(b64):
            raise TokenError("malformed token: not base64url")
        try:
            b64 = b64.rstrip("=")
            wire = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
        except (binascii.Error, ValueError):
            raise TokenError("malformed token: not base64url") from None
        try:
            outer = msgpack.unpackb(wire, raw=False, strict_map_key=True, max_bin_len=MAX_TOKEN_CHARS,
                                    max_str_len=MAX_TOKEN_CHARS, max_array_len=MAX_ALLOW, max_map_len=8)
            if not isinstance(outer, dict) or set(outer) != {"body", "sig"}:
                raise ValueError
            body, sig = outer["body"], outer["sig"]
            if not isinstance(body, bytes) or not isinstance(sig, bytes):
                raise TypeError
            b = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=MAX_TOKEN_CHARS,
                                max_array_len=MAX_ALLOW, max_map_len=8)
        except Exception:  # whatever msgpack or our shape checks raise, it is malformed
            raise TokenError("malformed token: not a token's msgpack") from None
        if not isinstance(b, dict) or b.get("v") != TOKEN_VERSION:
            raise TokenError(f"malformed token: unknown version {b.get('v') if isinstance(b, dict) else None!r}")
        iss, hold, allow, iat, exp = b.get("iss"), b.get("hold"), b.get("allow"), b.get("iat"), b.get("exp")
        if not (short_str(iss, MAX_PEER_ID_CHARS) and short_str(hold, MAX_PEER_ID_CHARS)):
            raise TokenError("malformed token: issuer and holder must be peer ids")
        if not isinstance(allow, list) or not allow or not all(short_str(a, MAX_SCOPE_CHARS) for a in allow):
            raise TokenError("malformed token: allow must be a non-empty list of scopes")
        if not (_is_int(iat) and _is_int(exp)):
            raise TokenError("malformed token: issued/expiry times must be integers")
        tok = cls(iss, hold, tuple(allow), iat, exp, sig)
        if tok.body() != body:
            raise TokenError("malformed token: body is not in canonical form")
        return tok

    def describe(self, now: float | None = None) -> dict:
        """What `token show` prints: plain values, times in UTC and relative."""
        now = time.time() if now is None else now
        return {"issuer": self.issuer, "holder": self.holder, "allow": list(self.allow),
                "issued_at": _utc(self.issued_at), "expires_at": _utc(self.expires_at),
                "expires_in": ago_or_in(self.expires_at - now), "expired": now >= self.expires_at,
                "signature_ok": self.verify_signature()}


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 40)


def _utc(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def human_duration(seconds: float) -> str:
    """2h, 1d 3h, 45s: at most two units, rounded down (for one-line messages)."""
    s = int(abs(seconds))
    units = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    for i, (unit, n) in enumerate(units[:-1]):
        if s >= n:
            sub_unit, sub_n = units[i + 1]
            rest = (s % n) // sub_n
            return f"{s // n}{unit}" + (f" {rest}{sub_unit}" if rest else "")
    return f"{s}s"


def ago_or_in(delta: float) -> str:
    return f"in {human_duration(delta)}" if delta >= 0 else f"{human_duration(delta)} ago"


def parse_ttl(text: str) -> float:
    """``90``, ``45s``, ``30m``, ``12h``, ``7d`` -> seconds; UserError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if not m:
        raise UserError(f"bad ttl {text!r}: expected a number with unit s, m, h or d (e.g. 7d)")
    s = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if s <= 0 or s > MAX_TTL_S:
        raise UserError(f"bad ttl {text!r}: must be more than 0 and at most 366d")
    return s


# ---- issuing and checking --------------------------------------------------------------------
def issue_token(issuer: Identity, holder: str, allow: Sequence[str], ttl_s: float,
                now: float | None = None) -> NodeToken:
    """Sign a token for ``holder``. Every scope is parsed first: a typo is refused, not issued."""
    now = time.time() if now is None else now
    if not allow:
        raise TokenError("a token must allow something (relay, shard, shard:MODEL:A-B:C-D)", "bad scope")
    if len(allow) > MAX_ALLOW:
        raise TokenError(f"at most {MAX_ALLOW} scopes per token", "bad scope")
    for a in allow:
        parse_scope(a)
    try:
        peer_public_key(holder)
    except SwarmError:
        raise TokenError(f"holder {str(holder)[:60]!r} is not an Ed25519 peer id "
                         f"(`p2pswarm identity --path KEY` prints a node's)", "bad holder") from None
    if not (0 < ttl_s <= MAX_TTL_S) or not math.isfinite(ttl_s):
        raise TokenError(f"ttl {ttl_s} s is out of range (0, {MAX_TTL_S}]", "bad ttl")
    unsigned = NodeToken(issuer.peer_id_str, str(holder), tuple(allow), int(now), int(now + ttl_s), b"")
    return NodeToken(**{**unsigned.__dict__, "signature": issuer.sign(SIGNING_DOMAIN + unsigned.body())})


def check_token(token: NodeToken | str | None, *, peer: str, scope: str, trusted_issuers: Collection[str],
                now: float | None = None) -> NodeToken:
    """The token, if it lets ``peer`` (the Noise-authenticated remote) do ``scope`` now; else
    TokenError with the reason. The signature is checked before anything the token claims."""
    now = time.time() if now is None else now
    if token is None or (isinstance(token, str) and not token.strip()):
        raise TokenError("no token presented", "no token")
    tok = NodeToken.decode(token) if isinstance(token, str) else token
    if not tok.verify_signature():
        raise TokenError(f"signature does not verify (token claims issuer {tok.issuer})", "bad signature")
    if tok.issuer not in trusted_issuers:
        raise TokenError(f"issuer {tok.issuer} is not trusted", "untrusted issuer")
    if now >= tok.expires_at:
        raise TokenError(f"token expired {human_duration(now - tok.expires_at)} ago", "expired")
    if tok.issued_at > now + CLOCK_SKEW_S:
        raise TokenError(f"token is issued {human_duration(tok.issued_at - now)} in the future "
                         f"(check the issuer's clock)", "not yet valid")
    if tok.holder != str(peer):
        raise TokenError(f"token holder is {tok.holder}, not the connecting peer {peer}", "wrong holder")
    if not tok.allows(scope):
        raise TokenError(f"token does not allow {scope!r} (it allows {', '.join(tok.allow)})", "wrong scope")
    return tok


def check_own_token(token: str, *, peer: str, trusted_issuers: Collection[str], scope: str | None = None,
                    model: str | None = None, now: float | None = None) -> NodeToken:
    """A worker's start-up check of the token it will present: what no source could accept, said
    now as one line (exit 2) instead of a refusal per download attempt, retried forever.

    ``scope``: the exact download scope (a fixed slice); None for an ``--auto`` worker, which may
    pick any unit and so needs ``shard:MODEL`` (or ``shard``/``shard:*``) without ranges. The
    issuer must be a ``--trust-issuer``: the sources honour tokens of the issuer whose manifest
    they serve, the one the worker checks the manifest against."""
    now = time.time() if now is None else now
    tok = NodeToken.decode(token)
    if not tok.verify_signature():
        raise TokenError(f"--token: its signature does not verify (it claims issuer {tok.issuer}): "
                         "a damaged or edited token; issue a new one", "bad signature")
    if tok.holder != str(peer):
        raise TokenError(f"--token was issued to peer {tok.holder}, but this node is {peer}: issue one for this "
                         f"node's id (`p2pswarm token issue --peer {peer} ...`), or start it with the key the "
                         "token names (--identity)", "wrong holder")
    if tok.issuer not in trusted_issuers:
        raise TokenError(f"--token is signed by {tok.issuer}, which is not a --trust-issuer "
                         f"({', '.join(trusted_issuers)}): sources honour the tokens of the issuer that signed "
                         "the model's manifest; use a token from it, or trust this issuer", "untrusted issuer")
    if now >= tok.expires_at:
        raise TokenError(f"--token expired {human_duration(now - tok.expires_at)} ago: issue a new one", "expired")
    if scope is not None:
        if not tok.allows(scope):
            raise TokenError(f"--token does not allow {scope} (it allows {', '.join(tok.allow)})", "wrong scope")
        return tok
    wanted = f"shard:{model}" if model else None
    if not any(_whole_model_scope(a, wanted) for a in tok.allow):
        raise TokenError(f"--token allows {', '.join(tok.allow)}: an --auto worker picks its units itself, so its "
                         f"token needs shard:{model or 'FINGERPRINT'} (`p2pswarm token issue {AUTO_SCOPE}`)",
                         "wrong scope")
    return tok


def _whole_model_scope(allowed: str, wanted: str | None) -> bool:
    """Whether ``allowed`` lets its holder download any slice of a model (``wanted``:
    ``shard:MODEL``, or None for whichever model the swarm serves)."""
    if wanted is not None:
        return scope_covers(allowed, wanted)
    try:
        kind, _model, layers, _experts = parse_scope(allowed)
    except TokenError:
        return False
    return kind == SCOPE_SHARD and layers is None


class TokenGate:
    """A service's door: checks tokens, logs one line per refusal, counts refusals by reason."""

    def __init__(self, trusted_issuers: Collection[str], *, what: str):
        self.trusted_issuers = frozenset(str(i) for i in trusted_issuers)
        self.what = what
        self.refused: Counter[str] = Counter()
        self.accepted = 0

    def check(self, token: str | NodeToken | None, *, peer: str, scope: str, now: float | None = None) -> NodeToken:
        try:
            tok = check_token(token, peer=str(peer), scope=scope, trusted_issuers=self.trusted_issuers, now=now)
        except TokenError as exc:
            self.refused[exc.reason] += 1
            log.warning("%s refused %s: %s", self.what, peer, exc)
            raise
        self.accepted += 1
        return tok


def load_token(arg: str) -> str:
    """``arg`` itself if it is a token, else the contents of the file it names (first line)."""
    arg = (arg or "").strip()
    if arg.startswith(TOKEN_PREFIX):
        return arg
    path = Path(os.path.expanduser(arg))
    if not arg or not path.is_file():
        raise TokenError(f"{arg[:60]!r} is neither a token ({TOKEN_PREFIX}...) nor a token file")
    with open(path, "rb") as f:
        data = f.read(MAX_TOKEN_CHARS + 2)
    if len(data) > MAX_TOKEN_CHARS + 1:
        raise TokenError(f"{path}: too large to be a token file")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenError(f"{path}: not a token file (not ASCII)") from None
    if not text.startswith(TOKEN_PREFIX):
        raise TokenError(f"{path}: not a token file (no {TOKEN_PREFIX} prefix)")
    return text


__all__ = [
    "SCOPE_RELAY",
    "SCOPE_SHARD",
    "TOKEN_PREFIX",
    "NodeToken",
    "TokenError",
    "TokenGate",
    "check_own_token",
    "check_token",
    "human_duration",
    "issue_token",
    "load_token",
    "parse_scope",
    "parse_ttl",
    "scope_covers",
    "shard_scope",
]
