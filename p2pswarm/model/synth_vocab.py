"""The vocabulary a synthetic model carries: a small byte-level BPE trained at first use on a
fixed text (deterministic), or the ``tokenizer.*`` keys copied from another GGUF file.

Split from ``synth.py``.
"""

from __future__ import annotations

import functools
import json
import os

from p2pswarm.errors import SwarmError, UserError
from p2pswarm.model.gguf_read import KV, read_gguf_kv
from p2pswarm.model.synth_presets import _gguf
from p2pswarm.model.vocab import bytes_to_unicode

# Built-in vocabulary: 256 byte tokens, the merges BPE training finds in BUILTIN_TEXT (at most
# BUILTIN_MERGES; pairs must occur twice: 281 with this text, so 540 tokens), 3 special tokens.
BUILTIN_MERGES = 384
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# llama.cpp's "qwen2" pre-tokenizer split; the merges are trained on pieces split the same way.
QWEN2_PRETOKENIZER_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

BUILTIN_TEXT = """\
A swarm is many small things acting as one large thing. A single bee cannot build a hive, and a
single phone cannot hold a model with a hundred billion weights, but a few thousand of them, each
holding a small part, can serve the whole model together. The model we care about is a mixture of
experts. In every layer a router looks at the hidden state of each token and picks the few experts
that should work on it. The other experts sleep. That is why the model is cheap to run even though
it is large to store: most of the weight is in the experts, and each token only wakes eight of them.

The experts of one layer do not talk to each other. Each is a small feed-forward network with a
gate, an up and a down projection. Because the expert index is the outermost dimension of the
tensors that hold them, every expert is one contiguous range of bytes in the file. Cutting the model
into shards is therefore a copy of byte ranges, with no need to decode or repack the quantised
blocks. A worker that owns sixty-four experts of layer five downloads exactly those bytes and
nothing else.

The backbone keeps the attention, the key and value cache, the norms and the router. It runs the
router once for each token and layer, and its choice is final. It then sends the normed hidden rows
to the workers that own the chosen experts, waits for their answers, and adds them up in a fixed
order, so that the result is the same whatever the order in which the answers arrive. When a worker
is slow, gone or wrong, the backbone computes the missing experts itself from its own copy.

Nodes find each other through a distributed hash table. A node that owns some experts writes a
record under the key of each shard it covers, and a backbone that needs an expert looks up that key
and dials one of the owners. Phones behind carrier-grade address translation cannot accept calls,
so both sides dial out to a relay on port four hundred forty-three, which joins the two streams.
Every frame carries a length of sixty-four bits, because a length that silently wraps at sixteen
or thirty-two bits corrupts large frames without any error.

Nodes are paid for the work they do. The demand for each expert is measured, the coverage of each
shard is counted, and a new node enrols in the shard with the highest reward: the one that is most
wanted and least covered. Tokens prove what a node may fetch; receipts record what it served. The
backbone checks a sample of the answers it receives by computing them again on its own replica.

Tokens per second is the measure. One round trip across the internet costs far more than the
arithmetic of an expert, so the backbone sends many rows at once, keeps the hottest experts close,
and prefers the replicas that are nearest. The quick brown fox jumps over the lazy dog; numbers
like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 256, 1024 and 3072 appear in the text as well.
"""


@functools.lru_cache(maxsize=1)
def builtin_vocab() -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """``(tokens, token_types, merges)`` of the small built-in byte-level BPE vocabulary.

    Token ids: 0..255 are the bytes 0..255 (as GPT-2 byte-to-unicode characters), then one token
    per merge in merge order, then the special tokens. Deterministic.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=256 + BUILTIN_MERGES,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(BUILTIN_TEXT.splitlines(keepends=True), trainer)
    raw_merges = json.loads(tok.to_str())["model"]["merges"]
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    known = set(tokens)
    merges: list[str] = []
    for m in raw_merges:
        a, b = (m if isinstance(m, (list, tuple)) else m.split(" ", 1))
        if a not in known or b not in known or (a + b) in known:
            raise RuntimeError(f"unexpected BPE merge from the trainer: {a!r} {b!r}")
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
    types = [1] * len(tokens)  # NORMAL
    tokens += SPECIAL_TOKENS
    types += [3] * len(SPECIAL_TOKENS)  # CONTROL
    return tuple(tokens), tuple(types), tuple(merges)


def builtin_tokenizer_kv() -> list[KV]:
    g = _gguf()
    T = g.GGUFValueType
    tokens, types, merges = builtin_vocab()
    eot = tokens.index("<|endoftext|>")
    return [
        KV("tokenizer.ggml.model", "gpt2", T.STRING),
        KV("tokenizer.ggml.pre", "qwen2", T.STRING),
        KV("tokenizer.ggml.tokens", list(tokens), T.ARRAY, T.STRING),
        KV("tokenizer.ggml.token_type", list(types), T.ARRAY, T.INT32),
        KV("tokenizer.ggml.merges", list(merges), T.ARRAY, T.STRING),
        KV("tokenizer.ggml.eos_token_id", eot, T.UINT32),
        KV("tokenizer.ggml.padding_token_id", eot, T.UINT32),
        KV("tokenizer.ggml.bos_token_id", eot, T.UINT32),
        KV("tokenizer.ggml.add_bos_token", False, T.BOOL),
        KV("tokenizer.chat_template", CHATML_TEMPLATE, T.STRING),
    ]


def vocab_tokenizer_kv(path: str | os.PathLike[str]) -> list[KV]:
    """The ``tokenizer.ggml.*`` keys (and ``tokenizer.chat_template``) of another GGUF file."""
    try:
        all_kv = read_gguf_kv(path)
    except SwarmError as exc:
        raise UserError(f"vocabulary: {exc}") from None
    kvs = [kv for kv in all_kv
           if kv.key.startswith("tokenizer.ggml.") or kv.key == "tokenizer.chat_template"]
    keys = {kv.key: kv for kv in kvs}
    for need in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if need not in keys:
            raise UserError(f"bad vocabulary file {path}: it has no {need}")
    if keys["tokenizer.ggml.model"].value not in (b"gpt2",):
        raise UserError(
            f"bad vocabulary file {path}: tokenizer.ggml.model is "
            f"{keys['tokenizer.ggml.model'].value.decode(errors='replace')!r}; only BPE ('gpt2') "
            "vocabularies are supported")
    n = len(keys["tokenizer.ggml.tokens"].value)
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.padding_token_id"):
        if k in keys and not 0 <= int(keys[k].value) < n:
            raise UserError(f"bad vocabulary file {path}: {k} {keys[k].value} is not below {n}")
    return kvs


def _n_vocab(tok_kv: list[KV]) -> int:
    return len(next(kv.value for kv in tok_kv if kv.key == "tokenizer.ggml.tokens"))

