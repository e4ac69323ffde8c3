"""``p2pswarm tokenize``: text -> token ids (or ids -> text) with a GGUF's own tokenizer.

Why a command: it is the quickest way to check that our tokenizer agrees with llama.cpp on a
given model file, and to get the ids of a prompt for ``logits``/``generate`` experiments.

    p2pswarm tokenize MODEL.gguf --text "Hello"            # ids and pieces, one per line
    p2pswarm tokenize MODEL.gguf --text-file p.txt --json  # last line: JSON list of ids
    p2pswarm tokenize MODEL.gguf --text "<|im_start|>" --special
    p2pswarm tokenize MODEL.gguf --decode 9707,1879        # text

Every bad input (missing/corrupt file, no tokenizer, malformed id list, id out of range) is a
:class:`~p2pswarm.errors.UserError`, which the CLI prints as one line with exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from p2pswarm.errors import UserError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tokenize",
        help="tokenize text (or decode ids) with a GGUF's tokenizer, as llama.cpp does",
        description="Tokenize text, or decode token ids, with the tokenizer stored in a GGUF file "
                    "(byte-level BPE, matching llama.cpp).",
    )
    p.add_argument("model", metavar="MODEL.gguf", help="a GGUF file with tokenizer metadata (a vocab-only GGUF will do)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to tokenize")
    src.add_argument("--text-file", metavar="F", help="tokenize the UTF-8 contents of file F ('-' for stdin)")
    src.add_argument("--decode", metavar="IDS", help="comma-separated token ids to turn back into text")
    p.add_argument("--json", action="store_true", help="print a JSON list of ids (or a JSON string when decoding) as the last line")
    p.add_argument("--special", action="store_true",
                   help="parse control-token texts such as <|im_start|> as tokens (and render them when decoding)")
    p.add_argument("--add-special", action="store_true",
                   help="add BOS/EOS where the GGUF asks for them (llama_tokenize's add_special)")
    p.set_defaults(func=run)
    return p


def _parse_ids(spec: str) -> list[int]:
    parts = [s.strip() for s in spec.replace(" ", ",").split(",")]
    parts = [s for s in parts if s]
    if not parts:
        raise UserError("--decode needs a comma-separated list of token ids, e.g. --decode 9707,1879")
    ids = []
    for s in parts:
        try:
            ids.append(int(s, 10))
        except ValueError:
            raise UserError(f"--decode: {s!r} is not a token id (expected integers separated by commas)") from None
    return ids


def _read_text(args) -> str:
    if args.text is not None:
        return args.text
    if args.text_file == "-":
        data = sys.stdin.buffer.read()
        where = "stdin"
    else:
        path = Path(args.text_file)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise UserError(f"--text-file {path}: no such file") from None
        except IsADirectoryError:
            raise UserError(f"--text-file {path}: is a directory") from None
        except OSError as exc:
            raise UserError(f"--text-file {path}: cannot read ({exc.strerror or exc})") from None
        where = str(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--text-file {where}: not valid UTF-8 (byte {exc.start})") from None


def _emit(text: str) -> None:
    """Write UTF-8 whatever the locale says (token pieces are arbitrary Unicode)."""
    stream = sys.stdout
    buf = getattr(stream, "buffer", None)
    if buf is None:
        stream.write(text)
        return
    stream.flush()
    buf.write(text.encode("utf-8", errors="replace"))
    buf.flush()


def _show_piece(piece: bytes) -> str:
    """A readable, unambiguous form of one token's bytes: a str repr, or a bytes repr if not UTF-8."""
    try:
        return repr(piece.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(piece)


def run(args) -> int:
    # Imported here so `p2pswarm --help` does not pay for numpy/gguf/tokenizers.
    from p2pswarm.engine.text.tokenizer import Tokenizer

    ids = _parse_ids(args.decode) if args.decode is not None else None
    text = _read_text(args) if ids is None else ""  # read first: a missing file is told before the model loads
    tok = Tokenizer.from_gguf(args.model)

    if ids is not None:
        for i in ids:
            if not 0 <= i < tok.n_vocab:
                raise UserError(f"--decode: token id {i} is out of range (vocab has {tok.n_vocab} tokens: 0..{tok.n_vocab - 1})")
        decoded = tok.decode(ids, special=args.special)
        if args.json:
            _emit(json.dumps(decoded, ensure_ascii=False) + "\n")
        else:
            _emit(decoded if decoded.endswith("\n") else decoded + "\n")
        return 0

    result = tok.encode(text, special=args.special, add_special=args.add_special)
    if args.json:
        _emit(json.dumps(result) + "\n")
        return 0
    width = len(str(max(result))) if result else 1
    # repr() keeps whitespace and control characters visible; control tokens show their text.
    lines = [f"{i:>{width}}  {_show_piece(tok.token_bytes(i, special=True))}\n" for i in result]
    lines.append(f"{len(result)} tokens\n")
    _emit("".join(lines))
    return 0
