"""llama.cpp, the independent reference, run so that it can neither crash the suite nor pass by crashing.

Why this exists: llama.cpp's CPU backend picks *extra* weight buffer types when the CPU advertises
them -- AMX tiles (``amx_tile/amx_int8``) or repacked K-quant / Q8_0 blocks (AVX2, AVX-512, NEON).
On CPUs that report AMX (the project's CI machines, in a VM) that path dies in ``llama_decode`` with
a general protection fault at ``ldtilecfg``: a SIGSEGV that killed the whole pytest run after 57
tests. Two guards, both on every reference computation of the suite:

1. **Weights in place.** Every model is loaded with ``use_extra_bufts = False``: the weights stay in
   the memory map and llama.cpp runs its plain CPU kernels on them -- the same kernels our own ggml
   kernel calls. llama.cpp's load log is read back and a model buffer of any type but ``CPU`` or
   ``CPU_Mapped`` (``AMX``, ``CPU_REPACK``, ...) fails the test: the guard is checked, not assumed.
2. **A child process.** The reference runs in a spawned child (one, reused across calls). If that
   child dies -- a signal, an abort from a failed ``GGML_ASSERT``, an exit -- the calling test fails
   with :class:`ReferenceCrashed` naming the signal, the next call starts a fresh child, and the rest
   of the suite runs on. A crash is a failure with a reason, never a pass and never a dead run.

The functions called in the child are the ``_ref_*`` functions below; the parent-side API is
:func:`llama_logits`, :func:`llama_intermediates`, :func:`llama_routing`, :func:`llama_tokenize_eval`.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import re
import signal
import traceback

import numpy as np

IN_PLACE_BUFFERS = frozenset({"CPU", "CPU_Mapped"})
CALL_TIMEOUT_S = 600.0
_BUFFER_RE = re.compile(r"^\s*\S+:\s+(\S+) model buffer size")


class ReferenceCrashed(AssertionError):
    """The llama.cpp reference process died (or hung) instead of answering: a test failure."""


# ---- the child side ---------------------------------------------------------------------------------
_LOG: list[str] = []
_KEEP: list = []  # ctypes callbacks llama.cpp may call later must outlive the call that set them
_GGML = None


def _llama():
    """llama_cpp, initialised once per child, its log captured (the buffer types are read from it)."""
    import llama_cpp

    if not _KEEP:
        def on_log(_level, text, _ud):
            _LOG.append(text.decode("utf-8", "replace"))

        cb = llama_cpp.llama_log_callback(on_log)
        _KEEP.append(cb)
        llama_cpp.llama_log_set(cb, None)
        llama_cpp.llama_backend_init()
    return llama_cpp


def _ggml_base():
    """llama.cpp's own libggml-base (the one its tensors belong to), for reading graph tensors."""
    global _GGML
    if _GGML is None:
        import llama_cpp

        lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
        for fn, res, args in (("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
                              ("ggml_get_data", ctypes.c_void_p, [ctypes.c_void_p]),
                              ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
                              ("ggml_nelements", ctypes.c_int64, [ctypes.c_void_p]),
                              ("ggml_backend_tensor_get", None,
                               [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t])):
            getattr(lib, fn).restype = res
            getattr(lib, fn).argtypes = args
        _GGML = lib
    return _GGML


def _load(path: str, *, extra_bufts: bool = False):
    """(model, buffer type names) -- the model loaded with weights in place unless ``extra_bufts``."""
    llama_cpp = _llama()
    mp_ = llama_cpp.llama_model_default_params()
    mp_.use_extra_bufts = extra_bufts
    del _LOG[:]
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp_)
    if not model:
        raise AssertionError(f"llama.cpp could not load {path}")
    buffers = sorted({m.group(1) for line in "".join(_LOG).splitlines() if (m := _BUFFER_RE.match(line))})
    return model, buffers


def _context(model, n_tokens: int, n_threads: int = 2, cb_eval=None):
    """F32 KV cache, flash attention off (bit-level settings), the whole prompt in one ubatch."""
    llama_cpp = _llama()
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max(128, n_tokens)
    cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = n_threads
    if cb_eval is not None:
        cp.cb_eval, cp.cb_eval_user_data = cb_eval, None
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise AssertionError("llama.cpp could not make a context")
    return ctx


def _decode_all(ctx, tokens: list[int]) -> None:
    """One batch, every position an output (no row is skipped at the last layer)."""
    llama_cpp = _llama()
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise AssertionError(f"llama_decode returned {rc}")
    finally:
        llama_cpp.llama_batch_free(batch)


def _run(path: str, tokens: list[int], *, n_threads: int = 2, cb_eval=None, extra_bufts: bool = False,
         read_logits: bool = True):
    llama_cpp = _llama()
    model, buffers = _load(path, extra_bufts=extra_bufts)
    try:
        ctx = _context(model, len(tokens), n_threads, cb_eval)
        try:
            _decode_all(ctx, tokens)
            logits = None
            if read_logits:
                n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
                ptr = llama_cpp.llama_get_logits(ctx)
                logits = np.ctypeslib.as_array(ptr, shape=(len(tokens), n_vocab)).astype(np.float32)
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    return logits, buffers


def _ref_logits(path, tokens, extra_bufts=False):
    return _run(path, tokens, extra_bufts=extra_bufts)


def _ref_tokenize_eval(path, text):
    """llama.cpp's own tokenization of ``text`` (no BOS, no specials), then all-position logits."""
    llama_cpp = _llama()
    model, _ = _load(path)
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        raw = text.encode("utf-8")
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
        if n < 0:
            raise AssertionError(f"llama_tokenize failed ({n})")
        ids = list(buf[:n])
    finally:
        llama_cpp.llama_model_free(model)
    logits, buffers = _run(path, ids)
    return ids, logits, buffers


class _TensorHead(ctypes.Structure):
    """The leading fields of ggml's ``struct ggml_tensor`` (type, buffer, ne[4], nb[4]): stable across
    ggml versions; checked against ggml_nelements/ggml_nbytes on every read."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4)]


def _ref_intermediates(path, tokens, names):
    """llama.cpp's own intermediate tensors of one prefill, by graph name (e.g. ``l_out-3``).

    Uses the scheduler's eval callback (``cb_eval``): asked for each graph node, it says which ones to
    observe; after such a node is computed it is called again and we copy the tensor out (rows of
    ne[0] values) while its memory is still valid."""
    llama_cpp = _llama()
    lib = _ggml_base()
    dtypes = {llama_cpp.GGML_TYPE_F32: np.float32, llama_cpp.GGML_TYPE_I32: np.int32}
    names = set(names)
    out: dict[str, np.ndarray] = {}
    problems: list[str] = []

    def observe(t, ask, _ud):
        name = lib.ggml_get_name(t).decode(errors="replace")
        if ask:
            return name in names
        if name in names:
            head = _TensorHead.from_address(t)
            ne, nb = list(head.ne), list(head.nb)
            if head.type not in dtypes or lib.ggml_nelements(t) != int(np.prod(ne)):
                problems.append(f"{name}: unexpected tensor header type={head.type} ne={ne}")
                return True
            dt = np.dtype(dtypes[head.type])
            span = sum((n - 1) * s for n, s in zip(ne, nb)) + dt.itemsize
            raw = np.frombuffer((ctypes.c_uint8 * span).from_address(lib.ggml_get_data(t)), np.uint8)
            view = np.lib.stride_tricks.as_strided(raw, shape=(*reversed(ne), dt.itemsize),
                                                   strides=(*reversed(nb), 1))
            out[name] = np.array(view, copy=True).view(dt).reshape(-1, ne[0])  # a copy: memory is reused
        return True

    cb = llama_cpp.ggml_backend_sched_eval_callback(observe)
    _, buffers = _run(path, tokens, cb_eval=cb, read_logits=False)
    if problems:
        raise AssertionError("cannot read llama.cpp's tensors (ggml_tensor layout changed?): " + problems[0])
    missing = names - set(out)
    if missing:
        raise AssertionError(f"llama.cpp's graph has no tensors named {sorted(missing)[:5]}")
    return out, buffers


def _ref_routing(path, tokens, n_threads=2):
    """The experts llama.cpp's router picks, per layer: {layer: ids (n_tokens, k)}, top-k order.

    Read with the eval callback: the ``ffn_moe_topk-<layer>`` tensor (a strided I32 view), its
    strides read from the head of ``struct ggml_tensor`` and checked against the ggml API first."""
    llama_cpp = _llama()
    lib = _ggml_base()
    got: dict[int, np.ndarray] = {}
    problems: list[str] = []

    def observe(t, ask, _ud):
        name = lib.ggml_get_name(t).decode()
        want = name.startswith("ffn_moe_topk-")
        if ask or not want:
            return want if ask else True
        head = _TensorHead.from_address(t)
        ne, nb = list(head.ne), list(head.nb)
        if not (head.type == llama_cpp.GGML_TYPE_I32 and ne[2] == ne[3] == 1 and nb[0] == 4
                and ne[0] * ne[1] == lib.ggml_nelements(t)):
            problems.append(f"{name}: unexpected tensor header type={head.type} ne={ne} nb={nb}")
            return True
        nbytes = lib.ggml_nbytes(t)
        raw = np.zeros(-(-nbytes // 4), np.int32)
        lib.ggml_backend_tensor_get(t, raw.ctypes.data, 0, nbytes)
        got[int(name.split("-")[1])] = np.lib.stride_tricks.as_strided(
            raw, shape=(ne[1], ne[0]), strides=(nb[1], 4)).copy()
        return True

    cb = llama_cpp.ggml_backend_sched_eval_callback(observe)
    _, buffers = _run(path, tokens, n_threads=n_threads, cb_eval=cb, read_logits=False)
    if problems:
        raise AssertionError("cannot read llama.cpp's routing from this ggml build: " + problems[0])
    return got, buffers


def _ref_greedy(path, prompt, n_steps):
    """llama.cpp's own greedy generation: the prompt in one batch, then ``n_steps`` single-token
    decodes, each taking the argmax of the last logits. Returns (tokens, logits (n_steps, n_vocab))."""
    llama_cpp = _llama()
    model, buffers = _load(path)
    try:
        ctx = _context(model, len(prompt) + n_steps)
        try:
            n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
            _decode_all(ctx, list(prompt))
            toks, rows = [], []
            batch = llama_cpp.llama_batch_init(1, 0, 1)
            try:
                for i in range(n_steps):
                    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
                    rows.append(row)
                    toks.append(int(np.argmax(row)))
                    batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = toks[-1], len(prompt) + i, 1, 1
                    batch.seq_id[0][0] = 0
                    batch.n_tokens = 1
                    if llama_cpp.llama_decode(ctx, batch) != 0:
                        raise AssertionError("llama_decode failed")
            finally:
                llama_cpp.llama_batch_free(batch)
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    return toks, np.stack(rows), buffers


def _token_state_batch(llama_cpp, tokens, states, pos0):
    """A classic llama_batch with BOTH token ids and rows of ``embd`` set: llama.cpp's MTP graph
    (``llm_graph_input_embd_h``) takes the tokens for its embedding and the rows as the trunk's
    hidden state (``llama_batch_ext_set_embd_state`` is a stub returning false in this build).
    Returns (batch, the buffers it points into, to keep alive)."""
    T = len(tokens)
    keep = [(llama_cpp.llama_token * T)(*tokens), (llama_cpp.llama_pos * T)(*range(pos0, pos0 + T)),
            (ctypes.c_int32 * T)(*[1] * T), (ctypes.c_int8 * T)(*[1] * T),
            np.ascontiguousarray(states, dtype=np.float32)]
    rows = [(llama_cpp.llama_seq_id * 1)(0) for _ in range(T)]
    ptrs = (ctypes.POINTER(llama_cpp.llama_seq_id) * T)(*[ctypes.cast(r, ctypes.POINTER(llama_cpp.llama_seq_id))
                                                          for r in rows])
    keep += [rows, ptrs]
    b = llama_cpp.llama_batch()
    b.n_tokens = T
    b.token = ctypes.cast(keep[0], ctypes.POINTER(llama_cpp.llama_token))
    b.pos = ctypes.cast(keep[1], ctypes.POINTER(llama_cpp.llama_pos))
    b.n_seq_id = ctypes.cast(keep[2], ctypes.POINTER(ctypes.c_int32))
    b.logits = ctypes.cast(keep[3], ctypes.POINTER(ctypes.c_int8))
    b.embd = keep[4].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    b.seq_id = ctypes.cast(ptrs, ctypes.POINTER(ctypes.POINTER(llama_cpp.llama_seq_id)))
    return b, keep


def _ref_mtp(path, prompt, follow, chain):
    """llama.cpp's MTP context (``LLAMA_CONTEXT_TYPE_MTP``, ``load_mtp``): the trunk's final-normed
    hidden states of ``prompt`` (a default context's embeddings, llama.cpp's ``h_nextn``), then the
    MTP block's logits fed ``follow[i]`` with the trunk's state at position i (all positions in one
    batch), then, for each ``(token, state)`` of ``chain``, one more position (chained drafts)."""
    llama_cpp = _llama()
    mp_ = llama_cpp.llama_model_default_params()
    mp_.use_extra_bufts = False
    mp_.load_mtp = True
    del _LOG[:]
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp_)
    if not model:
        raise AssertionError(f"llama.cpp could not load {path} with its MTP block")
    buffers = sorted({m.group(1) for line in "".join(_LOG).splitlines() if (m := _BUFFER_RE.match(line))})
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    n_embd = llama_cpp.llama_model_n_embd(model)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max(128, len(prompt) + len(chain))
    cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = 2
    try:
        cp.embeddings = True
        cp.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        ctx = llama_cpp.llama_init_from_model(model, cp)
        try:
            _decode_all(ctx, prompt)
            trunk = np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_ith(ctx, i), shape=(n_embd,)).copy()
                              for i in range(len(prompt))])
        finally:
            llama_cpp.llama_free(ctx)
        cp.embeddings = False
        cp.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            raise AssertionError("llama.cpp could not make an MTP context")
        try:
            out = []
            steps = [(list(follow), trunk)] + [([int(t)], np.asarray(h, np.float32).reshape(1, -1)) for t, h in chain]
            pos = 0
            for toks, states in steps:
                batch, _keep = _token_state_batch(llama_cpp, toks, states, pos)
                rc = llama_cpp.llama_decode(ctx, batch)
                if rc != 0:
                    raise AssertionError(f"llama_decode (MTP) returned {rc}")
                out += [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                        for i in range(len(toks))]
                pos += len(toks)
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    return trunk, np.stack(out), buffers


def _ref_crash(sig):
    """Test hook: the child dies of ``sig``, as llama.cpp's AMX path does (proves a crash fails)."""
    os.kill(os.getpid(), sig)


_FUNCS = {f.__name__: f for f in (_ref_logits, _ref_tokenize_eval, _ref_intermediates, _ref_routing, _ref_greedy,
                                   _ref_mtp, _ref_crash)}


def _serve(conn) -> None:
    while True:
        try:
            name, args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, _FUNCS[name](*args, **kwargs)))
        except BaseException as exc:  # everything goes back to the test as text
            conn.send((False, "".join(traceback.format_exception(exc))))


# ---- the parent side --------------------------------------------------------------------------------
class _Child:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that has threads and llama.cpp loaded
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(theirs,), daemon=True, name="llama.cpp reference")
        self.proc.start()
        theirs.close()

    def call(self, name: str, *args, timeout: float = CALL_TIMEOUT_S, **kwargs):
        self.conn.send((name, args, kwargs))
        if not self.conn.poll(timeout):
            self.proc.kill()
            self.proc.join()
            raise ReferenceCrashed(f"the llama.cpp reference ({name}) did not answer in {timeout:.0f} s")
        try:
            ok, value = self.conn.recv()
        except (EOFError, ConnectionError):
            self.proc.join(10)
            raise ReferenceCrashed(f"the llama.cpp reference process died in {name}: "
                                   f"{describe_exit(self.proc.exitcode)}") from None
        if not ok:
            raise AssertionError(f"the llama.cpp reference ({name}) failed:\n{value}")
        return value

    def alive(self) -> bool:
        return self.proc.is_alive()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_child: _Child | None = None


def call(name: str, *args, **kwargs):
    """Run ``name`` in the reference child (started, or restarted after a crash, as needed)."""
    global _child
    if _child is None or not _child.alive():
        _child = _Child()
    return _child.call(name, *args, **kwargs)


def check_in_place(buffers: list[str]) -> None:
    """Guard 1: llama.cpp used the weights in place (no AMX / repacked buffers)."""
    extra = sorted(set(buffers) - IN_PLACE_BUFFERS)
    if not buffers or extra:
        raise AssertionError(f"llama.cpp's reference must use its weights in place (use_extra_bufts=False); "
                             f"its load log shows model buffers {buffers}")


def llama_logits(path, tokens) -> np.ndarray:
    """llama.cpp's all-position logits: F32 KV cache, flash attention off, weights in place."""
    logits, buffers = call("_ref_logits", str(path), [int(t) for t in tokens])
    check_in_place(buffers)
    return logits


def llama_tokenize_eval(path, text: str) -> tuple[list[int], np.ndarray]:
    """llama.cpp's tokenization of ``text`` and the all-position logits of those tokens."""
    ids, logits, buffers = call("_ref_tokenize_eval", str(path), text)
    check_in_place(buffers)
    return ids, logits


def llama_intermediates(path, tokens, names: set[str]) -> dict[str, np.ndarray]:
    """llama.cpp's named intermediate tensors of one prefill (see ``_ref_intermediates``)."""
    out, buffers = call("_ref_intermediates", str(path), [int(t) for t in tokens], sorted(names))
    check_in_place(buffers)
    return out


def llama_routing(path, tokens, n_threads: int = 2) -> dict[int, np.ndarray]:
    """llama.cpp's router choices per layer (see ``_ref_routing``)."""
    got, buffers = call("_ref_routing", str(path), [int(t) for t in tokens], n_threads)
    check_in_place(buffers)
    return got


def llama_greedy(path, prompt, n_steps: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy tokens after ``prompt`` and the logits each was picked from (see ``_ref_greedy``)."""
    toks, logits, buffers = call("_ref_greedy", str(path), [int(t) for t in prompt], int(n_steps))
    check_in_place(buffers)
    return toks, logits


def llama_mtp(path, prompt, follow, chain=()) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's trunk hidden states (final-normed) of ``prompt`` and its MTP block's logits (see
    ``_ref_mtp``)."""
    trunk, logits, buffers = call("_ref_mtp", str(path), [int(t) for t in prompt], [int(t) for t in follow],
                                  [(int(t), np.asarray(h, np.float32)) for t, h in chain])
    check_in_place(buffers)
    return trunk, logits
