"""The llama.cpp reference cannot crash the suite, nor pass by crashing (tests/helpers/llama_ref.py).

On CPUs that report AMX, llama.cpp's default extra weight buffers fault in ``llama_decode`` (SIGSEGV
at ``ldtilecfg``): that killed the whole pytest run. Every reference computation now loads its model
with the weights in place and runs in a child process; these tests check both guards.
"""
from __future__ import annotations

import signal

import pytest

from helpers import llama_ref

from conftest import HAVE_LLAMA, needs_llama

TOKENS = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 129, 3]


@pytest.mark.slow
def test_a_crashed_reference_fails_the_test_and_the_next_call_works(tiny_f32):
    with pytest.raises(llama_ref.ReferenceCrashed, match="killed by SIGSEGV"):
        llama_ref.call("_ref_crash", signal.SIGSEGV)
    with pytest.raises(llama_ref.ReferenceCrashed, match="killed by SIGABRT"):  # a failed GGML_ASSERT
        llama_ref.call("_ref_crash", signal.SIGABRT)
    if HAVE_LLAMA:
        logits = llama_ref.llama_logits(tiny_f32, TOKENS)  # a fresh child answers
        assert logits.shape[0] == len(TOKENS) and logits.std() > 0


def test_the_in_place_check_refuses_extra_buffers_and_an_unreadable_log():
    llama_ref.check_in_place(["CPU_Mapped"])
    llama_ref.check_in_place(["CPU", "CPU_Mapped"])
    for bad in (["AMX", "CPU_Mapped"], ["CPU_REPACK", "CPU_Mapped"], []):
        with pytest.raises(AssertionError, match="in place"):
            llama_ref.check_in_place(bad)


@needs_llama
@pytest.mark.parametrize("model", ["tiny_q8", "tiny_q4km"])
@pytest.mark.slow
def test_quantised_reference_runs_with_weights_in_place(model, request):
    path = request.getfixturevalue(model)
    logits, buffers = llama_ref.call("_ref_logits", str(path), TOKENS)
    assert buffers and set(buffers) <= llama_ref.IN_PLACE_BUFFERS, buffers
    assert logits.shape[0] == len(TOKENS) and logits.std() > 0.1
    # llama.cpp's default set-up on this CPU, for the record: extra buffer types where the CPU has
    # them (the check above would refuse those), or a crash (the AMX fault), contained in the child.
    try:
        _, default = llama_ref.call("_ref_logits", str(path), TOKENS, extra_bufts=True)
    except llama_ref.ReferenceCrashed as exc:
        print(f"llama.cpp's default buffers crash here: {exc}")
    else:
        print(f"llama.cpp's default model buffers here: {default}")
        if set(default) - llama_ref.IN_PLACE_BUFFERS:
            with pytest.raises(AssertionError):
                llama_ref.check_in_place(default)
