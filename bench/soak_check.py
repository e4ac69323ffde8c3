"""bench/soak.py's load generator and checker: the requests (the official ``openai`` client, streamed
and not, greedy and seeded, some clients hanging up mid-stream), what became of each, and the
verdict: every completed answer equal to the monolithic reference token for token, nothing lost
or hung, the dishonest worker banned, full worker service back after every fault, and the slopes
of the sampled memory, descriptors, trio tasks and DHT records."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

RECOVERY_BOUND_S = 60.0  # every honest worker live again this long after a fault is undone, except:
#: a partition longer than a worker's record TTL (60 s) makes its record expire and the backbones drop
#: it ("left the coverage map"); after the heal it is back once its next record refresh (every 20 s)
#: has landed and each backbone's coverage map refresh (every 30 s) has read it: 50 s on an idle
#: machine plus the dial; 90 s leaves the 2 loaded cores their margin.
RECOVERY_BOUNDS_S = {"partition": 90.0}
RECOVERY_WAIT_S = 180.0  # how long the nemesis waits for full service (past a bound: measured, and a problem)


def recovery_bound(kind: str) -> float:
    return RECOVERY_BOUNDS_S.get(kind, RECOVERY_BOUND_S)
LONG_LIVED = ("w0", "w1")  # never faulted: their slopes are sampled
PROMPTS = ["Tell me about experts.", "What is a swarm?", "Count to five.", "Name a colour.",
           "Why is the sky blue?", "Say hello."]
SAMPLINGS = [None, 1, 2, 3]  # None: greedy; else temperature 0.8 with this seed
MAX_TOKENS = (6, 16)


def _now() -> float:
    return time.monotonic()


def _request(p: int, seed, max_tokens: int) -> dict:
    kw = {"messages": [{"role": "user", "content": PROMPTS[p]}], "max_tokens": max_tokens}
    return {**kw, "temperature": 0} if seed is None else {**kw, "temperature": 0.8, "top_p": 0.95, "seed": seed}


@dataclass
class Outcome:
    key: tuple
    stream: bool
    hangup: bool
    t0: float
    t1: float = 0.0
    kind: str = "pending"  # ok | error | hung | lost | hangup
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    error: str = ""
    token_times: list = field(default_factory=list)  # seconds between streamed pieces
    base: str = ""  # the backbone asked


class Load:
    """``clients`` threads sending requests until ``stop`` is set; every outcome recorded. Client
    ``i`` talks to ``bases[i % len(bases)]`` (several backbones: the load is spread over them)."""

    def __init__(self, bases: list[str], clients: int, seed: int, timeout_s: float = 120,
                 prompts: int = len(PROMPTS)):
        self.bases, self.clients, self.timeout_s, self.prompts = list(bases), clients, timeout_s, prompts
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, args=(self.rng.randrange(1 << 30),
                                                               self.bases[i % len(self.bases)]), daemon=True)
                   for i in range(self.clients)]
        for t in threads:
            t.start()
        return threads

    def _client(self, seed: int, base: str) -> None:
        import openai

        rng = random.Random(seed)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=self.timeout_s)
        while not self.stop.is_set():
            key = (rng.randrange(self.prompts), rng.choice(SAMPLINGS), rng.choice(MAX_TOKENS))
            stream = rng.random() < 0.5
            o = Outcome(key, stream, hangup=stream and rng.random() < 0.15, t0=_now(), base=base)
            with self.lock:
                self.outcomes.append(o)
            try:
                if stream:
                    self._streamed(client, o)
                else:
                    r = client.chat.completions.create(model="tiny", **_request(*key))
                    o.text, o.tokens = r.choices[0].message.content, r.usage.completion_tokens
                    o.finish, o.kind = r.choices[0].finish_reason, "ok"
            except openai.APITimeoutError:
                o.kind, o.error = "hung", f"no answer within {self.timeout_s:g} s"
            except openai.APIStatusError as exc:  # an HTTP error status: must be OpenAI's shape
                body = exc.body if isinstance(exc.body, dict) else {}
                shaped = isinstance(body.get("message"), str) or isinstance(body.get("error"), dict)
                o.kind = "error" if shaped else "lost"
                o.error = f"{exc.status_code}: {exc.message}"
            except openai.APIError as exc:  # a stream's in-band error event, or the connection
                shaped = getattr(exc, "body", None) is not None or "error" in str(exc).lower()
                o.kind = "error" if shaped and not isinstance(exc, openai.APIConnectionError) else "lost"
                cause = exc.__cause__  # "Connection error." alone does not say which (httpx's error)
                o.error = f"{type(exc).__name__}: {exc}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
            o.t1 = _now()

    def _streamed(self, client, o: Outcome) -> None:
        pieces, last = [], _now()
        with client.chat.completions.create(model="tiny", stream=True, stream_options={"include_usage": True},
                                            **_request(*o.key)) as s:
            for chunk in s:
                if chunk.usage is not None:
                    o.tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                ch = chunk.choices[0]
                if ch.delta.content:
                    pieces.append(ch.delta.content)
                    now = _now()
                    o.token_times.append(now - last)
                    last = now
                if ch.finish_reason:
                    o.finish = ch.finish_reason
                if o.hangup and len(pieces) >= 2:
                    o.kind = "hangup"
                    return  # leaving the block closes the connection mid-stream
        o.text, o.kind = "".join(pieces), "ok"


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value), per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 3600 * sum((t - mt) * (v - mv) for t, v in points) / var if var else None


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(outcomes: list[Outcome], refs: dict, faults: list[dict], windows, samples: list[dict],
              warmup_s: float, swarm_health: list[dict], liar_id: str, started: float, ended: float) -> dict:
    """The checker's numbers (see :func:`check` for the verdict). ``swarm_health``: each
    backbone's /health at the end (the first one verifies, bans and replays)."""
    wrong = [o for o in outcomes if o.kind == "ok" and (o.text, o.tokens, o.finish) != refs[o.key]]
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.kind in ("error", "lost", "hung"):
            why = o.error[:120]
            errors[why] = errors.get(why, 0) + 1

    def in_fault(o: Outcome) -> bool:
        return any(a <= o.t1 and o.t0 <= b for a, b in windows)

    per_token = {"faults": [], "calm": []}
    for o in outcomes:
        if o.kind == "ok" and o.stream and len(o.token_times) > 1:
            per_token["faults" if in_fault(o) else "calm"] += o.token_times[1:]
    by_kind: dict[str, dict] = {}
    for f in faults:
        k = by_kind.setdefault(f["kind"], {"count": 0, "recovery_s": [], "unrecovered": 0,
                                           "bound_s": recovery_bound(f["kind"])})
        k["count"] += 1
        if f.get("recovery_s") is None or f["recovery_s"] > recovery_bound(f["kind"]):
            k["unrecovered"] += 1  # past its bound (the recovery, if measured, is still listed)
        if f.get("recovery_s") is not None:
            k["recovery_s"].append(round(f["recovery_s"], 1))
    slopes: dict[str, dict] = {}
    late = [s for s in samples if s["t"] - started >= warmup_s]
    for who in sorted({k for s in samples for k in s if k not in ("t", "load1")}):
        slopes[who] = {}
        for metric in ("rss_mb", "fds", "tasks", "records"):
            pts = [(s["t"], s[who][metric]) for s in late if s.get(who, {}).get(metric) is not None]
            if pts:
                slopes[who][metric] = {"first": pts[0][1], "last": pts[-1][1],
                                       "max": max(v for _, v in pts), "slope_per_h": slope_per_hour(pts)}
    return {
        "duration_s": round(ended - started, 1), "requests": len(outcomes), "outcomes": kinds,
        "wrong": len(wrong), "wrong_examples": [(o.key, o.text, refs[o.key][0]) for o in wrong[:3]],
        "errors": errors, "faults": faults, "faults_by_kind": by_kind,
        "per_token_ms": {k: {"n": len(v), "p50": _ms(_pct(v, 0.5)), "p99": _ms(_pct(v, 0.99))}
                         for k, v in per_token.items()},
        "liar_banned": swarm_health[0].get("banned_workers", 0) >= 1, "liar": liar_id,
        "replays": [h.get("replays") for h in swarm_health], "fallbacks": [h.get("fallbacks") for h in swarm_health],
        "http_refused": [h.get("http_refused") for h in swarm_health],
        "per_backbone": {b: dict(_count(o.kind for o in outcomes if o.base == b)) for b in {o.base for o in outcomes}},
        # when each lost or hung request ran (seconds from the start) and the faults it overlapped
        "unanswered": [{"key": o.key, "stream": o.stream, "t0": round(o.t0 - started, 1), "t1": round(o.t1 - started, 1),
                        "error": o.error, "faults": [f["kind"] for f, (a, b) in zip(faults, windows)
                                                     if a <= o.t1 and o.t0 <= b]}
                       for o in outcomes if o.kind in ("lost", "hung")],
        "slopes": slopes, "samples": len(samples)}


def _count(items) -> dict:
    out: dict = {}
    for k in items:
        out[k] = out.get(k, 0) + 1
    return out


def _ms(x):
    return None if x is None else round(1000 * x, 1)


def check(report: dict) -> list[str]:
    """What the soak promises, as a list of broken promises (empty: all kept)."""
    bad = []
    if report["wrong"]:
        bad.append(f"{report['wrong']} completed responses differ from the monolithic reference: "
                   f"{report['wrong_examples']}")
    for kind in ("lost", "hung"):
        if report["outcomes"].get(kind):
            bad.append(f"{report['outcomes'][kind]} requests {kind}: {report['errors']}")
    if not report["outcomes"].get("ok"):
        bad.append("no request completed")
    if not report["liar_banned"]:
        bad.append("the dishonest worker was not banned")
    for bb, workers in report.get("nat_relayed", {}).items():
        if not all(workers.values()):
            bad.append(f"{bb} does not reach every NATed worker through the relay: {workers}")
    for f in report["faults"]:
        if f.get("inject_error"):
            bad.append(f"fault {f['kind']} could not be injected: {f['inject_error']}")
        if f.get("recovery_s") is None or f["recovery_s"] > recovery_bound(f["kind"]):
            bad.append(f"no full worker service within {recovery_bound(f['kind']):g} s after {f}")
        if f["kind"] == "corrupt_shard" and (f.get("traceback") or f.get("refused_rc") in (0, None)):
            bad.append(f"a corrupt shard was not refused with one line: {f}")
        if f["kind"] == "garbage" and "HUNG" in f.get("frames", ""):
            bad.append(f"a garbage frame hung its stream: {f}")
    return bad
