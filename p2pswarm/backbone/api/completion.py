"""What ``/v1/completions`` and ``/v1/chat/completions`` share: the request's generation parameters
(parsed and checked the way OpenAI documents them), the sampler they make, and the text loop that
turns generated tokens into emitted text (stop strings held back across token boundaries, the
finish reason, the usage counts).

Parameters the backbone cannot honour are refused with a 400 that names them, never accepted and
silently ignored: ``n`` > 1, ``best_of`` > 1, ``logprobs`` / ``top_logprobs``, ``echo``, ``suffix``,
``tools`` / ``functions``, and any ``response_format`` but text. ``frequency_penalty``,
``presence_penalty`` and ``logit_bias`` are implemented (OpenAI's formula, on the logits before
sampling). ``seed`` absent means a fresh random seed per request; given, the same request gives
the same text.
"""
from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

import numpy as np

from p2pswarm.backbone.api.openai_errors import APIError, bad_request
from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.backbone.serving.items import Rewind, Step
from p2pswarm.backbone.api.stops import StopMatcher, parse_stop

MAX_TOKENS_LIMIT = 4096
SEED_MAX = 2**63 - 1


class PenalizedSampler(Sampler):
    """:class:`Sampler` plus OpenAI's penalties and ``logit_bias``, applied to the logits first:

        logit[j] += bias[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty

    ``count[j]``: how often token j was sampled so far in this completion (the sampler sees every
    token it picks, so it keeps the counts itself and works under any caller that calls it once
    per step)."""

    def __init__(self, temperature: float, top_p: float, seed: int, *, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, logit_bias: dict[int, float] | None = None):
        super().__init__(temperature, top_p, seed)
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty
        self.logit_bias = dict(logit_bias or {})
        self.counts: dict[int, int] = {}

    def __call__(self, logits: np.ndarray, position: int | None = None) -> int:
        if self.logit_bias or self.counts and (self.frequency_penalty or self.presence_penalty):
            logits = np.array(logits, dtype=np.float32, copy=True)
            for tok, b in self.logit_bias.items():
                logits[tok] += b
            if self.frequency_penalty or self.presence_penalty:
                for tok, c in self.counts.items():
                    logits[tok] -= c * self.frequency_penalty + self.presence_penalty
        tok = super().__call__(logits, position)
        self.counts[tok] = self.counts.get(tok, 0) + 1
        return tok


@dataclass
class GenParams:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def sampler(self) -> Sampler:
        return PenalizedSampler(self.temperature, self.top_p, self.seed, frequency_penalty=self.frequency_penalty,
                                presence_penalty=self.presence_penalty, logit_bias=self.logit_bias)


def number(body: dict, key: str, default, kind, lo, hi):
    """``body[key]`` as ``kind`` within [lo, hi]; absent or null gives ``default``."""
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise bad_request(f"'{key}' must be a number", param=key)
    v = kind(v)
    if not lo <= v <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}", param=key)
    return v


def _refuse(body: dict, key: str, ok, why: str) -> None:
    if key in body and body[key] is not None and not ok(body[key]):
        raise bad_request(f"'{key}' {why}", param=key, code="unsupported_parameter")


def parse_params(body: dict, *, chat: bool, n_vocab: int, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> GenParams:
    """The generation parameters of a completions (``chat=False``) or chat request; APIError (400)
    on a bad or unsupported one."""
    _refuse(body, "n", lambda v: v == 1, "> 1 is not supported: this backbone returns one choice per request "
                                         "(send n requests; concurrent requests share decode steps)")
    _refuse(body, "best_of", lambda v: v == 1, "> 1 is not supported (one choice per request)")
    _refuse(body, "logprobs", lambda v: v is False or v == 0, "is not supported: the backbone returns no log "
                                                               "probabilities")
    _refuse(body, "top_logprobs", lambda v: v == 0, "is not supported: the backbone returns no log probabilities")
    _refuse(body, "echo", lambda v: v is False, "is not supported: the response never repeats the prompt")
    _refuse(body, "suffix", lambda v: v == "", "is not supported (no fill-in-the-middle)")
    for key in ("tools", "functions"):
        _refuse(body, key, lambda v: v == [], "is not supported: this backbone does not parse tool calls")
    _refuse(body, "tool_choice", lambda v: v == "none", "is not supported: this backbone does not parse tool calls")
    _refuse(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
            "other than {\"type\": \"text\"} is not supported")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = number(body, "max_completion_tokens", 16, int, 1, max_tokens_limit)
    else:
        max_tokens = number(body, "max_tokens", 16, int, 1, max_tokens_limit)
    seed = body.get("seed")
    seed = secrets.randbelow(SEED_MAX) if seed is None else number(body, "seed", 0, int, -SEED_MAX, SEED_MAX)
    try:
        stop = parse_stop(body.get("stop"))
    except ValueError as exc:
        raise bad_request(str(exc), param="stop") from None
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", param="stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise bad_request("'stream_options' must be {\"include_usage\": true|false}", param="stream_options")
        include_usage = opts.get("include_usage", False)
    bias_in = body.get("logit_bias") or {}
    if not isinstance(bias_in, dict):
        raise bad_request("'logit_bias' must map token ids to numbers", param="logit_bias")
    bias = {}
    for k, v in bias_in.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' key {k!r} is not a token id", param="logit_bias") from None
        if not 0 <= tok < n_vocab:
            raise bad_request(f"'logit_bias' token id {tok} is outside the vocabulary (0..{n_vocab - 1})",
                              param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100] (token {tok})", param="logit_bias")
        bias[tok] = float(v)
    return GenParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0, float, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, float, 1e-6, 1.0),
        seed=seed % 2**63,
        stop=stop,
        stream=bool(stream),
        include_usage=include_usage,
        frequency_penalty=number(body, "frequency_penalty", 0.0, float, -2.0, 2.0),
        presence_penalty=number(body, "presence_penalty", 0.0, float, -2.0, 2.0),
        logit_bias=bias,
    )


@dataclass
class Usage:
    """The ``usage`` object. Speculative decoding's counts go where OpenAI reports its predicted
    outputs': ``completion_tokens_details.accepted_prediction_tokens`` (drafts the model confirmed,
    each a token gained) and ``rejected_prediction_tokens`` (drafts computed and dropped)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens_details": {"accepted_prediction_tokens": self.accepted,
                                              "rejected_prediction_tokens": self.drafted - self.accepted}}


class StreamRewound(APIError):
    """A streamed completion whose already-sent text was computed with a worker's outputs that
    turned out wrong (the worker was banned and the sequence replayed): the text cannot be taken
    back, so the stream ends with this error (in-band) instead of silently changing course."""

    def __init__(self, keep: int, sent: int, worker: str):
        super().__init__(503, f"a worker whose unverified outputs this stream used ({worker}) was banned for "
                              f"returning wrong numbers: tokens {keep}-{sent - 1} already streamed differ from the "
                              f"exact result; retry the request (a non-streamed request is corrected instead)",
                         type="server_error", code="replayed_after_ban")


async def generate_text(steps: AsyncGenerator[Step | Rewind, None], n_prompt: int, params: GenParams, usage: Usage, *,
                        on_token=None, hold: bool = False):
    """Yield the completion's text pieces from one request's token ``steps``; fills ``usage``
    (tokens, ``finish_reason``) as it goes. ``finish_reason`` is "stop" at an end-of-generation
    token or a stop string (which is never emitted), else "length".

    ``steps`` is closed when the text ends (a stop string ends the request at once, not when the
    iterator is collected): whoever opened the request (``CompletionsApp``) hands it over, and
    nothing here calls back into the HTTP layer.

    Replay on ban: the steps may include a scheduler ``Rewind`` (tokens from ``keep`` on withdrawn,
    replacements follow). The text is then rebuilt from the kept tokens' pieces. With ``hold``
    (non-streamed responses) nothing is yielded before the end, so the text always ends exact;
    streamed, text already yielded that the rebuilt text does not start with ends the generation
    with :class:`StreamRewound`."""
    matcher = StopMatcher(params.stop)
    usage.prompt_tokens = n_prompt
    finish = "length"
    texts: list[str] = []  # each token's piece, to rebuild the text after a rewind
    out, sent = "", 0  # the text the matcher let through; how much of it was yielded
    async with aclosing(steps):
        async for step in steps:
            if isinstance(step, Rewind):
                del texts[step.keep:]
                usage.completion_tokens = step.keep
                matcher = StopMatcher(params.stop)
                rebuilt = "".join(matcher.push(t) for t in texts)
                if not rebuilt.startswith(out[:sent]):
                    raise StreamRewound(step.keep, step.sent, step.worker)
                out = rebuilt
                continue
            usage.completion_tokens += 1
            usage.drafted += step.drafted
            usage.accepted += step.accepted
            if on_token is not None:
                on_token()
            texts.append(step.text)
            out += matcher.push(step.text)
            if not hold and len(out) > sent:
                yield out[sent:]
                sent = len(out)
            if matcher.stopped or step.end:
                finish = "stop"
                break
    out += matcher.flush()
    if len(out) > sent:
        yield out[sent:]
    usage.finish_reason = finish


__all__ = ["APIError", "GenParams", "PenalizedSampler", "StreamRewound", "Usage", "generate_text", "parse_params"]
