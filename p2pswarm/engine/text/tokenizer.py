"""Text <-> token ids exactly as llama.cpp does it, built from a GGUF's tokenizer metadata.

Why this shape: the backbone must feed the model the very ids llama.cpp would feed it, or the
swarm's logits stop being comparable with the reference implementation. So we do not write a
BPE of our own. The merge loop and the byte-level mapping run in Hugging Face ``tokenizers``
(a ``BPE`` model plus a ``Split`` + ``ByteLevel`` pre-tokenizer); what this module adds is only
what llama.cpp does *around* its BPE and what a ``tokenizers`` pipeline cannot express by itself:

* the pre-tokenizer regex llama.cpp picks for ``tokenizer.ggml.pre`` (the regex strings are
  data, taken from llama.cpp's ``src/llama-vocab.cpp``), with its Unicode classes pinned to the
  Unicode version of llama.cpp's own tables (see :data:`p2pswarm.engine.text.vocab_rules.UNASSIGNED_IN_LLAMA_CPP`);
* the special-token partition (``tokenizer_st_partition``): control tokens are only recognised
  when ``special=True``, user-defined tokens always, longest token text first;
* BOS/EOS insertion from ``tokenizer.ggml.add_bos_token``/``add_eos_token`` (or llama.cpp's
  default for the pre-tokenizer type), and the end-of-generation set;
* detokenization as ``llama_detokenize`` does it: control tokens render empty unless asked,
  user-defined tokens render their raw text, normal tokens go through the GPT-2 byte map, and
  the ``clean_spaces`` pass for the pre-tokenizers that enable it.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported; anything else raises
:class:`~p2pswarm.errors.ModelFormatError` with a one-line reason.

This is engine code: it reads a memory-mapped GGUF handed to it (or opens one), never the network.
"""
from __future__ import annotations

import codecs
import logging
import os
from typing import Iterable, Sequence

import gguf
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _hf_models
from tokenizers import pre_tokenizers as _hf_pre

from p2pswarm.engine.text.vocab_rules import (ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNDEFINED, ATTR_UNKNOWN,
                                         ATTR_UNUSED, ATTR_USER_DEFINED, CHAR_TO_BYTE, EOG_TEXTS, EOM_TEXTS,
                                         EOT_TEXTS, FIM_TEXTS, SUPPORTED_PRE, TYPE_TO_ATTR, pin_unicode)
from p2pswarm.errors import ModelFormatError, SwarmError, UserError
from p2pswarm.model.gguf_read import array_field as _array
from p2pswarm.model.gguf_read import open_gguf
from p2pswarm.model.split_gguf import check_first_part
from p2pswarm.model.gguf_read import scalar as _scalar

log = logging.getLogger(__name__)

__all__ = ["Tokenizer", "StreamDecoder", "open_gguf", "SUPPORTED_PRE"]

# --- GGUF access -------------------------------------------------------------------------------
def _strings(reader: gguf.GGUFReader, key: str) -> list[str] | None:
    f = _array(reader, key, gguf.GGUFValueType.STRING)
    if f is None:
        return None
    out = []
    for n, i in enumerate(f.data):
        try:
            out.append(bytes(f.parts[i]).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"GGUF {key}[{n}] is not valid UTF-8") from exc
    return out


# --- the tokenizer -----------------------------------------------------------------------------
class Tokenizer:
    """llama.cpp's tokenizer for a byte-level BPE GGUF, on top of Hugging Face ``tokenizers``.

    Build one with :meth:`from_gguf`. ``encode`` mirrors ``llama_tokenize`` and ``decode``
    mirrors ``llama_detokenize`` (``remove_special=False``) of the llama.cpp that
    llama-cpp-python 0.3.36 ships; the tests hold the two side by side.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str],
        *,
        pre: str = "default",
        bos_id: int | None = None,
        eos_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        special_ids: dict[str, int] | None = None,
    ) -> None:
        """Build from the raw ``tokenizer.ggml.*`` arrays (see :meth:`from_gguf` for the usual way).

        ``special_ids`` holds the optional eot/eom/fim_* ids found in the GGUF; missing ones are
        detected by token text, as llama.cpp does.
        """
        if pre not in SUPPORTED_PRE:
            raise ModelFormatError(
                f"unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(sorted(SUPPORTED_PRE))})"
            )
        n = len(tokens)
        if n == 0:
            raise ModelFormatError("tokenizer.ggml.tokens is empty")
        if token_types is not None and len(token_types) < n:
            raise ModelFormatError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")
        self._pre = SUPPORTED_PRE[pre]
        self.pre = pre
        # llama.cpp replaces empty token texts with a placeholder so every text maps to one id.
        self._texts: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._ids: dict[str, int] = {}
        for i, t in enumerate(self._texts):
            if t in self._ids:
                raise ModelFormatError(f"token text {t!r} appears twice in the vocab (ids {self._ids[t]} and {i})")
            self._ids[t] = i
        attrs = [ATTR_NORMAL] * n if token_types is None else [TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in token_types[:n]]

        def _check(name: str, v: int | None) -> int | None:
            if v is None:
                return None
            if not 0 <= v < n:
                log.warning("tokenizer: %s %d is out of range (vocab %d); ignoring it", name, v, n)
                return None
            return v

        self.bos_id: int | None = _check("bos_token_id", bos_id)
        self.eos_id: int | None = _check("eos_token_id", eos_id)
        self.add_bos: bool = self._pre.add_bos if add_bos is None else bool(add_bos)
        self.add_eos: bool = bool(add_eos)

        # Roles llama.cpp detects by token text when the GGUF does not name them; those tokens are
        # forced to CONTROL, which decides both special-token parsing and rendering.
        ids = {k: _check(k, v) for k, v in (special_ids or {}).items()}

        def _detect(role: str, texts: Iterable[str]) -> int | None:
            if ids.get(role) is not None:
                return ids[role]
            for text in texts:
                tid = self._ids.get(text)
                if tid is not None:
                    attrs[tid] |= ATTR_CONTROL
                    return tid
            return None

        self.eot_id = _detect("eot", EOT_TEXTS)
        self.eom_id = _detect("eom", EOM_TEXTS)
        fim = {role: _detect(f"fim_{role}", texts) for role, texts in FIM_TEXTS.items()}
        eog = {v for v in (fim["pad"], fim["rep"], fim["sep"]) if v is not None}
        for text in EOG_TEXTS:
            tid = self._ids.get(text)
            if tid is not None:
                eog.add(tid)
                attrs[tid] |= ATTR_CONTROL
        for tid in (self.eos_id, self.eot_id, self.eom_id):
            if tid is not None:
                eog.add(tid)
        # llama.cpp marks control tokens named "unused" as UNUSED (they still render as control).
        for i, a in enumerate(attrs):
            if a & ATTR_CONTROL and "unused" in self._texts[i]:
                attrs[i] = a | ATTR_UNUSED
        self._attrs = attrs
        self.eog_ids: frozenset[int] = frozenset(eog)

        # llama.cpp's special-token partition: CONTROL | USER_DEFINED | UNKNOWN, longest text first.
        specials = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        specials.sort(key=lambda i: -len(self._texts[i].encode("utf-8")))
        self._specials_all = [(self._texts[i], i) for i in specials]
        self._specials_user = [(t, i) for t, i in self._specials_all if not attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]

        self._hf = self._build_hf(merges)
        self._pieces: list[bytes | None] = [None] * n

    # -- construction ---------------------------------------------------------------------------
    def _build_hf(self, merges: Sequence[str]) -> _HFTokenizer:
        """The ``tokenizers`` pipeline for text between special tokens: regex split(s), byte map, BPE."""
        vocab = self._ids
        pairs: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        dropped = 0
        for m in merges:
            # llama.cpp splits a merge at the first space after position 0 and keeps the first
            # rank of a repeated pair.
            p = m.find(" ", 1)
            if p < 0:
                dropped += 1
                continue
            pair = (m[:p], m[p + 1:])
            if pair in seen:
                continue
            if pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
                # tokenizers refuses merges whose parts/result are not tokens; llama.cpp could
                # apply them but then has no id for the result. Never seen in a sane vocab.
                dropped += 1
                continue
            seen.add(pair)
            pairs.append(pair)
        if dropped:
            log.warning("tokenizer: ignored %d malformed merges", dropped)
        try:
            bpe = _hf_models.BPE(vocab=dict(vocab), merges=pairs, ignore_merges=self._pre.ignore_merges)
        except Exception as exc:
            raise ModelFormatError(f"tokenizer vocab/merges rejected: {' '.join(str(exc).split())}") from exc
        hf = _HFTokenizer(bpe)
        splits = [_hf_pre.Split(Regex(pin_unicode(r)), behavior="isolated", invert=False) for r in self._pre.regexes]
        hf.pre_tokenizer = _hf_pre.Sequence(
            splits + [_hf_pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
        )
        return hf

    @classmethod
    def from_gguf(cls, reader_or_path: gguf.GGUFReader | str | os.PathLike) -> "Tokenizer":
        """Read ``tokenizer.ggml.*`` from a GGUF (an open :class:`gguf.GGUFReader` or a path).

        Raises :class:`ModelFormatError` if the file has no tokenizer, or one we do not support.
        """
        if isinstance(reader_or_path, gguf.GGUFReader):
            reader = reader_or_path
            where = "GGUF"
        else:
            reader, where = open_gguf(reader_or_path), str(reader_or_path)
            check_first_part(reader_or_path, reader)  # a split model's tokenizer is in its first part
        try:
            return cls._from_reader(reader)
        except ModelFormatError as exc:
            raise ModelFormatError(f"{where}: {exc}") from exc
        except SwarmError:
            raise
        except Exception as exc:  # a corrupt field the reader let through
            raise ModelFormatError(f"{where}: unreadable tokenizer metadata ({type(exc).__name__}: {exc})") from exc

    @classmethod
    def _from_reader(cls, reader: gguf.GGUFReader) -> "Tokenizer":
        model = _scalar(reader, "tokenizer.ggml.model", (str,))
        if model is None:
            raise ModelFormatError("no tokenizer in this GGUF (tokenizer.ggml.model missing)")
        if model != "gpt2":
            raise ModelFormatError(
                f"unsupported tokenizer.ggml.model {model!r} (only 'gpt2' byte-level BPE is supported)"
            )
        tokens = _strings(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelFormatError("no tokenizer vocab in this GGUF (tokenizer.ggml.tokens missing)")
        merges = _strings(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise ModelFormatError("tokenizer.ggml.merges missing (required by the gpt2 tokenizer)")
        tt = _array(reader, "tokenizer.ggml.token_type", gguf.GGUFValueType.INT32)
        types = None
        if tt is not None:
            types = [int(tt.parts[i][0]) for i in tt.data]
        pre = _scalar(reader, "tokenizer.ggml.pre", (str,))
        if not pre:
            log.warning("tokenizer: GGUF has no tokenizer.ggml.pre; using 'default' as llama.cpp does")
            pre = "default"
        ints = (int,)
        special_ids = {}
        for role, keys in {
            "eot": ("eot_token_id",), "eom": ("eom_token_id",),
            "fim_pre": ("fim_pre_token_id", "prefix_token_id"), "fim_suf": ("fim_suf_token_id", "suffix_token_id"),
            "fim_mid": ("fim_mid_token_id", "middle_token_id"), "fim_pad": ("fim_pad_token_id",),
            "fim_rep": ("fim_rep_token_id",), "fim_sep": ("fim_sep_token_id",),
        }.items():
            for key in keys:
                v = _scalar(reader, f"tokenizer.ggml.{key}", ints)
                if v is not None:
                    special_ids[role] = v
        return cls(
            tokens,
            types,
            merges,
            pre=pre,
            bos_id=_scalar(reader, "tokenizer.ggml.bos_token_id", ints),
            eos_id=_scalar(reader, "tokenizer.ggml.eos_token_id", ints),
            add_bos=_scalar(reader, "tokenizer.ggml.add_bos_token", (bool,)),
            add_eos=_scalar(reader, "tokenizer.ggml.add_eos_token", (bool,)),
            special_ids=special_ids,
        )

    # -- properties -----------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocab (ids are 0..n_vocab-1)."""
        return len(self._texts)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocab entry (byte-level alphabet for normal tokens), e.g. ``'Ġworld'``."""
        self._check_id(token_id)
        return self._texts[token_id]

    def is_control(self, token_id: int) -> bool:
        """Whether llama.cpp treats the token as control (parsed only with special=True, rendered empty)."""
        self._check_id(token_id)
        return bool(self._attrs[token_id] & ATTR_CONTROL)

    def is_eog(self, token_id: int) -> bool:
        """Whether generation stops at this token (llama.cpp's ``llama_vocab_is_eog``)."""
        return token_id in self.eog_ids

    def _check_id(self, token_id: int) -> None:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < len(self._texts):
            raise UserError(f"token id {token_id!r} is out of range (vocab has {len(self._texts)} tokens: 0..{len(self._texts) - 1})")

    # -- encode ---------------------------------------------------------------------------------
    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Split ``text`` around special tokens the way llama.cpp's ``tokenizer_st_partition`` does.

        Each special token (longest text first) is searched for, left to right, in every piece of
        raw text still left; matches become ids. Control/unknown tokens only take part when
        ``special`` is true; user-defined tokens always do.
        """
        frags: list[str | int] = [text]
        for tok_text, tid in self._specials_all if special else self._specials_user:
            if tok_text not in text:
                continue
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok_text not in frag:
                    out.append(frag)
                    continue
                start = 0
                while True:
                    m = frag.find(tok_text, start)
                    if m < 0:
                        break
                    if m > start:
                        out.append(frag[start:m])
                    out.append(tid)
                    start = m + len(tok_text)
                if start < len(frag):
                    out.append(frag[start:])
            frags = out
        return frags

    def encode(self, text: str, special: bool = False, add_special: bool = True) -> list[int]:
        """Token ids for ``text``, as ``llama_tokenize(text, add_special, parse_special=special)``.

        ``special=True`` turns control-token texts such as ``<|im_start|>`` into their ids; with
        the default False they are tokenized as plain text (user-defined tokens are always
        recognised -- llama.cpp does the same). ``add_special`` adds BOS/EOS only where the GGUF
        asks for them (``tokenizer.ggml.add_bos_token``/``add_eos_token``, or llama.cpp's default
        for the pre-tokenizer when the key is absent); for Qwen3.5 that is never.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() wants str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UserError(f"text is not valid Unicode (lone surrogate at index {exc.start})") from exc
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise ModelFormatError("the GGUF asks for a BOS token but has no tokenizer.ggml.bos_token_id")
            out.append(self.bos_id)
        if text:
            frags = self._partition(text, special) if self._specials_all else [text]
            for frag in frags:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._hf.encode(frag, add_special_tokens=False).ids)
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise ModelFormatError("the GGUF asks for an EOS token but has no tokenizer.ggml.eos_token_id")
            out.append(self.eos_id)
        return out

    # -- decode ---------------------------------------------------------------------------------
    def _piece_full(self, token_id: int) -> bytes:
        """The token's bytes as llama.cpp's piece cache holds them (``special=True``)."""
        piece = self._pieces[token_id]
        if piece is None:
            attr = self._attrs[token_id]
            text = self._texts[token_id]
            if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
                piece = text.encode("utf-8")
            elif attr & ATTR_NORMAL:
                buf = bytearray()
                for ch in text:
                    b = CHAR_TO_BYTE.get(ch)
                    if b is not None:
                        buf.append(b)
                    else:  # llama_decode_text's marker for a character outside the byte alphabet
                        enc = ch.encode("utf-8")
                        buf += b"[UNK_BYTE_0x" + enc.hex().encode() + text.encode("utf-8") + b"]"
                piece = bytes(buf)
            elif attr & ATTR_BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                try:
                    piece = bytes([int(text[3:5], 16)])
                except ValueError:
                    piece = b""
            else:  # unused / undefined tokens render as nothing
                piece = b""
            self._pieces[token_id] = piece
        return piece

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """One token's bytes, as ``llama_token_to_piece(token, lstrip=0, special)``.

        May be a fragment of a UTF-8 character; for streaming text use :meth:`stream_decoder`.
        """
        self._check_id(token_id)
        if not special and self._attrs[token_id] & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        return self._piece_full(token_id)

    def token_text(self, token_id: int, special: bool = False) -> str:
        """One token's text for display; bytes that are not whole UTF-8 characters show as U+FFFD."""
        return self.token_bytes(token_id, special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        """The bytes ``llama_detokenize(ids, remove_special=False, unparse_special=special)`` returns."""
        data = b"".join(self.token_bytes(int(i) if not isinstance(i, int) else i, special) for i in ids)
        if self._pre.clean_spaces and data:
            data = _clean_spaces(data)
        return data

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text for ``ids`` as llama.cpp detokenizes it; invalid UTF-8 becomes U+FFFD, never an error."""
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = False) -> "StreamDecoder":
        """An incremental decoder that emits text only once its UTF-8 characters are complete."""
        return StreamDecoder(self, special)

    def __repr__(self) -> str:
        return f"Tokenizer(n_vocab={self.n_vocab}, pre={self.pre!r}, bos={self.bos_id}, eos={self.eos_id})"


class StreamDecoder:
    """Turns a stream of token ids into text pieces without splitting a UTF-8 character.

    Pieces are token_to_piece outputs joined as they come (as llama.cpp's server streams them);
    the ``clean_spaces`` pass of :meth:`Tokenizer.decode` is not applied.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self._tok = tokenizer
        self._special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return whatever text is now complete (possibly '')."""
        return self._dec.decode(self._tok.token_bytes(token_id, self._special))

    def flush(self) -> str:
        """End of stream: return what is left, with an incomplete character as U+FFFD."""
        return self._dec.decode(b"", final=True)


def _clean_spaces(data: bytes) -> bytes:
    """``llama_detokenize``'s clean_up_tokenization_spaces, pass for pass, on bytes."""
    t = bytearray(data)
    # 1: drop the space in " ?", " !", " .", " ,"
    total, n = 1, len(t)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    # 2: " ' " -> "'" (llama.cpp also blanks the skipped space in place, which the next check sees)
    n, total, i = total, 1, 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    # 3: drop the space before 's 'm 're 've
    n, total = total, 1
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n:
                x2 = t[i + 2]
                if (x1, x2) in ((0x72, 0x65), (0x76, 0x65)):  # 're 've
                    total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])
