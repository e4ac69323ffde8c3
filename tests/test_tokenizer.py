"""The tokenizer, held side by side with llama.cpp's own (through llama-cpp-python 0.3.36).

The reference vocab is the real Qwen3.5 one (151,936 tokens) that ships with the package
(``p2pswarm.model.vocab.qwen35_vocab_path``, sha256-pinned); the other pre-tokenizers' vocabularies
(llama.cpp's, also pinned) are under tests/data/vocab. Nothing is downloaded. Every comparison is
exact: same ids, same bytes.
"""
from __future__ import annotations

import ctypes
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from p2pswarm.engine.text.tokenizer import Tokenizer
from p2pswarm.errors import ModelFormatError, UserError
from p2pswarm.model import vocab as vocab_mod

REPO = Path(__file__).resolve().parent.parent

try:
    import llama_cpp
except ImportError:  # pragma: no cover - depends on the environment
    llama_cpp = None

LLAMA_SKIP_REASON = "llama_cpp cannot be imported (pip install llama-cpp-python==0.3.36): no llama.cpp tokenizer to compare with"
needs_llama = pytest.mark.skipif(llama_cpp is None, reason=LLAMA_SKIP_REASON)


# --- fixtures ----------------------------------------------------------------------------------
#: The other pre-tokenizers' vocab-only GGUFs (llama.cpp's, MIT), stored under tests/data/vocab.
TEST_VOCAB_DIR = REPO / "tests" / "data" / "vocab"
TEST_VOCABS = {
    "gpt-2": "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
    "mpt": "59dc382612866d1fc6c11ea531318d327598f3412d9c8f8600607cdf3030898f",
    "llama-bpe": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
}
#: llama.cpp's ggml-vocab-qwen2.gguf: the Qwen3.5 file with tokenizer.ggml.pre = "qwen2", byte for byte.
QWEN2_SHA256 = "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c"


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory) -> Path:
    """Where derived vocabularies (qwen2) are written, once per session."""
    return tmp_path_factory.mktemp("vocab")


def _with_pre(src: Path, dst: Path, pre: str) -> Path:
    """``src`` with its ``tokenizer.ggml.pre`` string replaced, every other byte kept."""
    data = src.read_bytes()
    key = b"tokenizer.ggml.pre"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    vtype, n = struct.unpack_from("<IQ", data, at)
    assert vtype == gguf.GGUFValueType.STRING
    body = at + 12
    dst.write_bytes(data[:at + 4] + struct.pack("<Q", len(pre)) + pre.encode() + data[body + n:])
    return dst


def _vocab(vocab_dir: Path, name: str) -> Path:
    if name == "qwen35":
        return vocab_mod.qwen35_vocab_path()
    if name == "qwen2":
        path = vocab_dir / "ggml-vocab-qwen2.gguf"
        if not path.exists():
            _with_pre(vocab_mod.qwen35_vocab_path(), path, "qwen2")
        assert vocab_mod.sha256_file(path) == QWEN2_SHA256, "the derived qwen2 vocab is not llama.cpp's file"
        return path
    path = TEST_VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    assert vocab_mod.sha256_file(path) == TEST_VOCABS[name], f"{path} does not match its pinned sha256"
    return path


@pytest.fixture(scope="session")
def qwen35(qwen35_path) -> Tokenizer:
    return Tokenizer.from_gguf(qwen35_path)


class Ref:
    """llama.cpp's tokenizer for one GGUF, through llama-cpp-python."""

    def __init__(self, path: Path) -> None:
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._buf = ctypes.create_string_buffer(4096)

    def tokenize(self, text: str, special: bool, add_bos: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def detokenize(self, ids: list[int], special: bool) -> bytes:
        """``llama_detokenize(remove_special=False, unparse_special=special)`` -- the C function.

        (``Llama.detokenize`` stitches ``llama_token_to_piece`` calls through a 32-byte buffer
        and garbles longer pieces, so the C entry point is the reference.)
        """
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 16 * len(ids)
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self.vocab, arr, len(ids), buf, size, False, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def piece(self, token: int, special: bool) -> bytes:
        n = llama_cpp.llama_token_to_piece(self.vocab, token, self._buf, len(self._buf), 0, special)
        assert 0 <= n <= len(self._buf)
        return self._buf.raw[:n]


@pytest.fixture(scope="session")
def qwen35_ref(qwen35_path) -> Ref:
    if llama_cpp is None:
        pytest.skip(LLAMA_SKIP_REASON)
    return Ref(qwen35_path)


def assert_same(tok: Tokenizer, ref: Ref, text: str) -> None:
    """Encode (both special modes, with and without add_special) and decode agree with llama.cpp."""
    for special in (False, True):
        ids = ref.tokenize(text, special)
        assert tok.encode(text, special=special, add_special=False) == ids, (text, special)
        assert tok.encode(text, special=special) == ref.tokenize(text, special, add_bos=True), (text, special)
        for render in (False, True):
            want = ref.detokenize(ids, render)
            assert tok.decode_bytes(ids, special=render) == want, (text, special, render)
            assert tok.decode(ids, special=render) == want.decode("utf-8", errors="replace")


# --- the Qwen3.5 vocab against llama.cpp ------------------------------------------------------
TEXTS = {
    "empty": "",
    "space": " ",
    "spaces": "   ",
    "space_runs": "a  b   c    d     e\t\tf \t \tg",
    "trailing_spaces": "end with spaces   ",
    "leading_spaces": "     indented",
    "tabs": "\tx\t\ty\t\t\t",
    "mixed_ws": " \t \u00a0 \u3000x\u2028y\x0b\x0c\x85z",
    "newlines": "a\nb\n\nc\n\n\nd",
    "crlf": "line1\r\nline2\r\n\r\nline3\r\r\n",
    "ws_then_newline": "x   \n   \n\t\ny  \r\n  z",
    "only_newlines": "\n\n\n\n",
    "digits": "0 1 12 123 1234 12345 123456789012345678901234567890",
    "digit_grouping": "1,234,567.89 and 3.14159 and 1e-10 and 0x1F and ½ ² ٣ Ⅻ",
    "accents": "Äpfel café naïve Ñandú Cửa Việt Straße",
    "combining": "e\u0301 a\u0300\u0301\u0302 \u0301start x\u0308\u0308\u0308y n\u0303",
    "cjk": "我想在apple工作1314151天～ 日本語のテキスト 한국어 텍스트",
    "scripts": "нещо на Български ไทย क्षत्रिय ক্ষ កាន់តែពិសេស العربية עברית",
    "emoji": "🦙 🚀 (normal) 😶‍🌫️ ✅ 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇺🇳",
    "code": "def f(x):\n    return {'a': [x**2 for x in range(10)]}  # comment\n\tif (a && b || !c) { y->z(); }\n",
    "contractions": "I'm you're he's we've they'll she'd don't I'M YOU'RE HE'S 'tis o'clock rock'n'roll",
    "punctuation": "Hello, world!!! What?!?... (yes) [no] {maybe} -- --- ... ;;; ::: @@@ ### $$$ %%% ^^^",
    "symbols": "<<< >>> === !== <= >= => -> |> <| ~~ `` ''' \"\"\" \\\\ //",
    "unicode16": "x\U000105C1y \U00010D40\U00010D41 1\U00010D40 \U0001FA89!",
    "private_use": "\ue000\ue001 a\U000F0000b",
    "controls": "a\x00b\x01c\x7fd\u200be\ufefff",
    "chatml": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "special_glued": "x<|im_start|><|im_end|>y<|endoftext|>",
    "special_partial": "<|im_start| <|im_end <|endoftext|",
    "user_defined": "[PAD151650] and [PAD151700][PAD151935]",
    "long": "The quick brown fox jumps over the lazy dog. " * 40 + "\n" + "=" * 300 + " " * 200 + "x",
}


@needs_llama
@pytest.mark.parametrize("name", list(TEXTS))
def test_qwen35_matches_llama_cpp(qwen35, qwen35_ref, name):
    assert_same(qwen35, qwen35_ref, TEXTS[name])


@needs_llama
def test_qwen35_special_flag(qwen35, qwen35_ref):
    text = "<|im_start|>user"
    plain = qwen35.encode(text)
    parsed = qwen35.encode(text, special=True)
    assert parsed[0] == 151644 and 151644 not in plain
    assert plain == qwen35_ref.tokenize(text, False)
    # user-defined tokens are recognised even without special=True, as in llama.cpp
    assert qwen35.encode("[PAD151650]") == [151650]


@needs_llama
def test_qwen35_fuzz(qwen35, qwen35_ref):
    pool = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "a", "Z", "é", "e\u0301", "\u0301", "ß",
            "İ", "ſ", "\u212a", "'", "'s", "'S", "'ll", "'Re", "0", "7", "123", "٣", "½", "!", "?", "...",
            "-", "==", "<", "|", "$", "_", "(", ")", "中", "你好", "日本語", "한국어", "क्षि", "🦙", "👍🏽",
            "👨‍👩‍👧", "\u200d", "\ufe0f", "\ue000", "\x00", "\x7f", "\U000105C0", "\U00010D40",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "[PAD151700]", "<|im_start|", "def f(x):\n    "]
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 12)))
        assert_same(qwen35, qwen35_ref, text)


@needs_llama
def test_qwen35_vocab_facts(qwen35, qwen35_ref):
    llm = qwen35_ref.llm
    assert qwen35.n_vocab == llm.n_vocab() == 151_936
    assert qwen35.eos_id == llm.token_eos() == 151643
    assert qwen35.bos_id == llm.token_bos() == 151643
    assert qwen35.add_bos is False and qwen35.add_eos is False
    v = qwen35_ref.vocab
    eog = {i for i in range(qwen35.n_vocab) if llama_cpp.llama_vocab_is_eog(v, i)}
    control = {i for i in range(qwen35.n_vocab) if llama_cpp.llama_vocab_is_control(v, i)}
    assert qwen35.eog_ids == eog
    assert {i for i in range(qwen35.n_vocab) if qwen35.is_control(i)} == control


@needs_llama
@pytest.mark.slow
def test_qwen35_every_piece_matches(qwen35, qwen35_ref):
    """token_bytes(id) is llama_token_to_piece(id) for every token, special or not."""
    for i in range(qwen35.n_vocab):
        for special in (False, True):
            assert qwen35.token_bytes(i, special) == qwen35_ref.piece(i, special), (i, special)


@needs_llama
def test_qwen35_decode_invalid_utf8(qwen35, qwen35_ref):
    text = " 🦙𠜎"  # pieces that split these characters' UTF-8 bytes between tokens
    ids = qwen35.encode(text)
    assert len(ids) > 2
    for cut in range(1, len(ids)):
        part = ids[:cut]
        raw = qwen35_ref.detokenize(part, False)
        assert qwen35.decode_bytes(part) == raw
        assert qwen35.decode(part) == raw.decode("utf-8", errors="replace")  # no exception
    assert qwen35.decode(ids) == text


def test_qwen35_roundtrip_and_stream(qwen35):
    for text in TEXTS.values():
        ids = qwen35.encode(text)
        assert qwen35.decode(ids) == text  # byte-level BPE is lossless
        dec = qwen35.stream_decoder()
        assert "".join(dec.push(i) for i in ids) + dec.flush() == text
    assert qwen35.token_text(qwen35.encode(" world")[0]) == " world"
    assert qwen35.token_text(151644) == "" and qwen35.token_text(151644, special=True) == "<|im_start|>"


def test_qwen35_bad_ids(qwen35):
    for bad in (-1, qwen35.n_vocab, 10**9):
        with pytest.raises(UserError, match="out of range"):
            qwen35.decode([1, bad])
    with pytest.raises(TypeError):
        qwen35.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="surrogate"):
        qwen35.encode("a\ud800b")


@pytest.mark.slow
def test_from_reader_equals_from_path(qwen35, qwen35_path):
    from p2pswarm.engine.text.tokenizer import open_gguf

    tok = Tokenizer.from_gguf(open_gguf(qwen35_path))
    text = TEXTS["code"] + TEXTS["emoji"]
    assert tok.encode(text) == qwen35.encode(text)


# --- other pre-tokenizers llama.cpp ships vocabs for -------------------------------------------
OTHER_TEXTS = [TEXTS[k] for k in ("space_runs", "crlf", "ws_then_newline", "digits", "combining", "cjk",
                                  "emoji", "code", "contractions", "punctuation", "symbols", "unicode16",
                                  "special_glued", "empty")]
OTHER_TEXTS += ["Hello , world ! ' quoted ' it 's I 'm we 're they 've 'll 'd 't x ' ' y",
                "<|endoftext|> <|begin_of_text|>hi<|eot_id|>"]


@pytest.mark.slow
@needs_llama
@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "gpt-2", "mpt"])
def test_other_vocabs_match_llama_cpp(vocab_dir, name):
    path = _vocab(vocab_dir, name)
    tok, ref = Tokenizer.from_gguf(path), Ref(path)
    for text in OTHER_TEXTS:
        assert_same(tok, ref, text)


def _rewrite(src: Path, dst: Path, **set_kv) -> Path:
    """Copy a vocab-only GGUF's tokenizer into a new GGUF, overriding some tokenizer keys.

    ``pre=None`` drops tokenizer.ggml.pre; ``model=...`` replaces tokenizer.ggml.model.
    """
    r = gguf.GGUFReader(src)

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode() for i in f.data]

    def uint(key):
        f = r.fields.get(key)
        return None if f is None else int(f.parts[f.data[0]][0])

    w = gguf.GGUFWriter(dst, arch="gpt2")
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(16)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_tokenizer_model(set_kv.get("model", "gpt2"))
    pre = set_kv.get("pre", bytes(r.fields["tokenizer.ggml.pre"].parts[-1]).decode())
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(strings("tokenizer.ggml.tokens"))
    tt = r.fields["tokenizer.ggml.token_type"]
    w.add_token_types([int(tt.parts[i][0]) for i in tt.data])
    w.add_token_merges(strings("tokenizer.ggml.merges"))
    for key, add in (("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", w.add_eos_token_id)):
        if uint(key) is not None:
            add(uint(key))
    if "add_bos" in set_kv:
        w.add_add_bos_token(set_kv["add_bos"])
    if "add_eos" in set_kv:
        w.add_add_eos_token(set_kv["add_eos"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="session")
def gpt2_path(vocab_dir) -> Path:
    return _vocab(vocab_dir, "gpt-2")


@pytest.mark.slow
@needs_llama
@pytest.mark.parametrize("variant", ["default_pre", "missing_pre", "add_bos", "add_bos_eos"])
def test_rewritten_vocabs_match_llama_cpp(gpt2_path, tmp_path, variant):
    kw = {"default_pre": {"pre": "default"}, "missing_pre": {"pre": None},
          "add_bos": {"add_bos": True}, "add_bos_eos": {"add_bos": True, "add_eos": True}}[variant]
    path = _rewrite(gpt2_path, tmp_path / f"{variant}.gguf", **kw)
    tok, ref = Tokenizer.from_gguf(path), Ref(path)
    for text in OTHER_TEXTS:
        assert_same(tok, ref, text)
    if "add_bos" in kw:
        assert tok.encode("hi")[0] == tok.bos_id == 50256
        assert tok.encode("hi", add_special=False)[0] != tok.bos_id


@pytest.mark.slow
@needs_llama
def test_synthetic_model_tokenizer_matches_llama_cpp(tiny_f32):
    """The tokenizer `make-model` writes into its GGUFs reads back as llama.cpp reads it."""
    tok, ref = Tokenizer.from_gguf(tiny_f32), Ref(tiny_f32)
    for text in ("Hello world", TEXTS["code"], TEXTS["chatml"], TEXTS["crlf"], TEXTS["emoji"]):
        assert_same(tok, ref, text)


# --- refusals ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_unsupported_tokenizers_are_one_line_errors(gpt2_path, tmp_path):
    spm = _rewrite(gpt2_path, tmp_path / "spm.gguf", model="llama")
    with pytest.raises(ModelFormatError, match=r"unsupported tokenizer\.ggml\.model 'llama'") as e:
        Tokenizer.from_gguf(spm)
    assert "\n" not in str(e.value)
    odd = _rewrite(gpt2_path, tmp_path / "odd.gguf", pre="no-such-pre")
    with pytest.raises(ModelFormatError, match=r"unsupported tokenizer\.ggml\.pre 'no-such-pre'") as e:
        Tokenizer.from_gguf(odd)
    assert "\n" not in str(e.value)


def _no_tokenizer_gguf(path: Path) -> Path:
    w = gguf.GGUFWriter(path, arch="gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFormatError, match="not a valid GGUF"):
        Tokenizer.from_gguf(junk)
    with pytest.raises(ModelFormatError, match="no tokenizer"):
        Tokenizer.from_gguf(_no_tokenizer_gguf(tmp_path / "bare.gguf"))


def test_vocab_is_the_shipped_pinned_file(qwen35_path):
    """The vocabulary comes from the package itself (p2pswarm/data), matching the pinned sha256."""
    assert qwen35_path.name == "ggml-vocab-qwen35.gguf"
    assert qwen35_path.parent == REPO / "p2pswarm" / "data"
    assert vocab_mod.sha256_file(qwen35_path) == vocab_mod.QWEN35_VOCAB_SHA256


@pytest.mark.parametrize("damage", ["missing", "altered"])
def test_damaged_shipped_vocab_is_one_line(tmp_path, monkeypatch, damage):
    fake = tmp_path / "data" / vocab_mod.QWEN35_VOCAB_NAME
    if damage == "altered":
        fake.parent.mkdir()
        fake.write_bytes(vocab_mod.qwen35_vocab_path().read_bytes()[:-1] + b"!")
    monkeypatch.setattr(vocab_mod, "shipped_data_path", lambda name: tmp_path / "data" / name)
    vocab_mod.qwen35_vocab_path.cache_clear()
    try:
        with pytest.raises(UserError, match="missing" if damage == "missing" else "expected 63ed952f") as e:
            vocab_mod.qwen35_vocab_path()
    finally:
        vocab_mod.qwen35_vocab_path.cache_clear()
    assert "\n" not in str(e.value) and "reinstall" in str(e.value)


# --- the CLI -----------------------------------------------------------------------------------
def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``python -m p2pswarm.cli tokenize ARGS``; stdout/stderr decoded as UTF-8, newlines untouched."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "p2pswarm.cli", "tokenize", *args], capture_output=True,
                          env=env, cwd=REPO, input=None if stdin is None else stdin.encode(), timeout=300)
    proc.stdout = proc.stdout.decode("utf-8")
    proc.stderr = proc.stderr.decode("utf-8", errors="replace")
    return proc


def assert_refused(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.mark.slow
@needs_llama
def test_cli_json_matches_llama_cpp(qwen35_path, qwen35_ref):
    text = "Hello <|im_start|>user\n你好 🦙 it's 12345!"
    for special in (False, True):
        proc = cli(str(qwen35_path), "--text", text, "--json", *(["--special"] if special else []))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == qwen35_ref.tokenize(text, special)


@pytest.mark.slow
def test_cli_text_file_readable_and_decode(qwen35_path, qwen35, tmp_path):
    f = tmp_path / "p.txt"
    text = "line one\r\n\tcafé 🦙\n"
    f.write_bytes(text.encode())
    proc = cli(str(qwen35_path), "--text-file", str(f))
    assert proc.returncode == 0, proc.stderr
    ids = qwen35.encode(text)
    lines = proc.stdout.splitlines()
    assert lines[-1] == f"{len(ids)} tokens"
    assert [int(ln.split()[0]) for ln in lines[:-1]] == ids
    assert "'line'" in lines[0]

    proc = cli(str(qwen35_path), "--decode", ",".join(map(str, ids)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text
    proc = cli(str(qwen35_path), "--decode", "9707,220,151644", "--special", "--json")
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == "Hello <|im_start|>"
    proc = cli(str(qwen35_path), "--text-file", "-", "--json", stdin="a b")
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == qwen35.encode("a b")


@pytest.mark.slow
def test_cli_refusals(qwen35_path, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(qwen35_path.read_bytes()[:4096])  # truncated inside the vocab array
    assert_refused(cli(str(corrupt), "--text", "hi"), "not a valid GGUF")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(1000))
    assert_refused(cli(str(junk), "--text", "hi"), "not a valid GGUF")
    assert_refused(cli(str(tmp_path / "missing.gguf"), "--text", "hi"), "no such file")
    assert_refused(cli(str(_no_tokenizer_gguf(tmp_path / "bare.gguf")), "--text", "hi"), "no tokenizer")
    assert_refused(cli(str(qwen35_path), "--decode", "1,x,3"), "'x' is not a token id")
    assert_refused(cli(str(qwen35_path), "--decode", ","), "--decode needs")
    assert_refused(cli(str(qwen35_path), "--decode", "1,151936"), "token id 151936 is out of range")
    assert_refused(cli(str(qwen35_path), "--text-file", str(tmp_path / "none.txt")), "no such file")
