"""llama.cpp's vocabulary rules, as data: token types and attributes, the pre-tokenizer regexes
per ``tokenizer.ggml.pre`` (with their Unicode classes pinned to llama.cpp's tables), the
end-of-generation / fill-in-the-middle token texts, and GPT-2's byte map
(:func:`p2pswarm.model.vocab.bytes_to_unicode`) inverted.

Split out of :mod:`p2pswarm.engine.text.tokenizer` (which applies them) because they change only when
llama.cpp does: a newcomer adding a pre-tokenizer edits this file alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from p2pswarm.model.vocab import bytes_to_unicode  # the byte map lives below the engine: make-model writes it too

# --- llama.cpp's token types (GGUF ``tokenizer.ggml.token_type``) and token attributes ---------
TYPE_UNDEFINED, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = range(7)

ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

TYPE_TO_ATTR = {
    TYPE_UNDEFINED: ATTR_UNDEFINED,
    TYPE_NORMAL: ATTR_NORMAL,
    TYPE_UNKNOWN: ATTR_UNKNOWN,
    TYPE_CONTROL: ATTR_CONTROL,
    TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TYPE_UNUSED: ATTR_UNUSED,
    TYPE_BYTE: ATTR_BYTE,
}

# --- Unicode pinning ---------------------------------------------------------------------------
# llama.cpp classifies code points with tables generated from an older Unicode release than the
# one Oniguruma (the regex engine inside ``tokenizers`` 0.23) knows. Code points assigned since
# then are "undefined" to llama.cpp -- neither letter, mark, number, punctuation nor space -- but
# \p{L}/\p{M}/\p{N}/\p{P} to Oniguruma. These ranges are exactly that difference (measured over
# all of U+0000..U+10FFFF against llama.cpp's tables as shipped in llama-cpp-python 0.3.36; no
# code point changed category otherwise). Every \p{..} class below is rewritten to exclude them
# and every negated class to include them, so both engines split such text the same way.
UNASSIGNED_IN_LLAMA_CPP: tuple[tuple[int, int], ...] = (
    (0x00897, 0x00897), (0x01B4E, 0x01B4F), (0x01B7F, 0x01B7F), (0x01C89, 0x01C8A),
    (0x02427, 0x02429), (0x031E4, 0x031E5), (0x0A7CB, 0x0A7CD), (0x0A7DA, 0x0A7DC),
    (0x105C0, 0x105F3), (0x10D40, 0x10D65), (0x10D69, 0x10D85), (0x10D8E, 0x10D8F),
    (0x10EC2, 0x10EC4), (0x10EFC, 0x10EFC), (0x11380, 0x11389), (0x1138B, 0x1138B),
    (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113C0), (0x113C2, 0x113C2),
    (0x113C5, 0x113C5), (0x113C7, 0x113CA), (0x113CC, 0x113D5), (0x113D7, 0x113D8),
    (0x113E1, 0x113E2), (0x116D0, 0x116E3), (0x11BC0, 0x11BE1), (0x11BF0, 0x11BF9),
    (0x11F5A, 0x11F5A), (0x13460, 0x143FA), (0x16100, 0x16139), (0x16D40, 0x16D79),
    (0x18CFF, 0x18CFF), (0x1CC00, 0x1CCF9), (0x1CD00, 0x1CEB3), (0x1E5D0, 0x1E5FA),
    (0x1E5FF, 0x1E5FF), (0x1F8B2, 0x1F8BB), (0x1F8C0, 0x1F8C1), (0x1FA89, 0x1FA89),
    (0x1FA8F, 0x1FA8F), (0x1FABE, 0x1FABE), (0x1FAC6, 0x1FAC6), (0x1FADC, 0x1FADC),
    (0x1FADF, 0x1FADF), (0x1FAE9, 0x1FAE9), (0x1FBCB, 0x1FBEF),
)
_UNASSIGNED_CLASS = "[" + "".join(
    f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in UNASSIGNED_IN_LLAMA_CPP
) + "]"


def pin_unicode(regex: str) -> str:
    """Rewrite every Unicode-category class of ``regex`` to llama.cpp's view of Unicode.

    ``[...\\p{X}...]`` becomes ``[...&&[^U]]``, ``[^...\\p{X}...]`` becomes ``[[^...]U]`` and a
    bare ``\\p{X}`` becomes ``[\\p{X}&&[^U]]``, where U is :data:`_UNASSIGNED_CLASS`. Only the
    flat bracket expressions llama.cpp's regexes use are handled (no nesting in the input).
    """
    out: list[str] = []
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            if regex.startswith("\\p{", i):
                j = regex.index("}", i) + 1
                out.append(f"[{regex[i:j]}&&[^{_UNASSIGNED_CLASS[1:-1]}]]")
                i = j
            else:
                out.append(regex[i:i + 2])
                i += 2
            continue
        if c == "[":
            j = i + 1
            while regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            body = regex[i + 1:j]
            if "\\p{" not in body:
                out.append(regex[i:j + 1])
            elif body.startswith("^"):
                out.append(f"[[{body}]{_UNASSIGNED_CLASS}]")
            else:
                out.append(f"[{body}&&[^{_UNASSIGNED_CLASS[1:-1]}]]")
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


# --- pre-tokenizers, per ``tokenizer.ggml.pre`` ------------------------------------------------
# The regex strings are llama.cpp's (``llm_tokenizer_bpe`` in src/llama-vocab.cpp); they are
# applied in sequence, each splitting the pieces of the one before, matched and unmatched text
# both kept ("isolated"), which is what llama.cpp's ``unicode_regex_split`` does. The flags are
# the ones llama.cpp's ``llama_vocab::impl::load`` sets for the same names.
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp runs the GPT-2 regex through a hand-written splitter that ends in a plain \s+
# alternative (the regex string itself lacks it); we append it so the regex says the same thing.
_RE_GPT2_FULL = _RE_GPT2 + r"|\s+"
_RE_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _RE_GPT2_FULL,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@dataclass(frozen=True)
class _Pre:
    """What llama.cpp does for one ``tokenizer.ggml.pre`` value."""

    kind: str                 # llama.cpp's LLAMA_VOCAB_PRE_TYPE_*, lower case, for messages
    regexes: tuple[str, ...]
    ignore_merges: bool = False   # a whole pre-token found in the vocab is taken as is
    add_bos: bool = False         # default when the GGUF has no tokenizer.ggml.add_bos_token
    clean_spaces: bool = True     # llama_detokenize's clean_up_tokenization_spaces passes


_DEFAULT = _Pre("default", _RE_DEFAULT)
_LLAMA3 = _Pre("llama3", (_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2 = _Pre("gpt2", (_RE_GPT2_FULL,))
_QWEN2 = _Pre("qwen2", (_RE_QWEN2,), clean_spaces=False)
_QWEN35 = _Pre("qwen35", (_RE_QWEN35,), clean_spaces=False)

SUPPORTED_PRE: dict[str, _Pre] = {
    "default": _DEFAULT,
    **{name: _LLAMA3 for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                  "midm-2.0", "lfm2", "jina-v5-nano")},
    "dbrx": _Pre("dbrx", (_RE_LLAMA3,)),
    "smaug-bpe": _Pre("smaug", (_RE_LLAMA3,)),
    # (llama.cpp's jina-*/roberta/modern-bert names share this regex but add per-token strip
    # rules or a SEP token; they are left out rather than half-supported.)
    **{name: _GPT2 for name in ("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "mpt", "olmo", "jais",
                                "exaone4")},
    **{name: _QWEN2 for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    "megrez": _Pre("qwen2", (_RE_QWEN2,)),          # llama.cpp keeps clean_spaces on for megrez
    "stablelm2": _Pre("stablelm2", (_RE_QWEN2,)),
    "qwen35": _QWEN35,
}

# Token texts llama.cpp recognises as end-of-turn / end-of-generation / fill-in-the-middle
# markers (``llama_vocab::impl::load``); it forces such tokens to be CONTROL.
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))


CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}
_C_ISSPACE = frozenset(" \t\n\v\f\r")
