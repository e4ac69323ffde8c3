"""Chat rendering against llama.cpp's own (llama-cpp-python's Jinja2ChatFormatter), stop strings
across token boundaries, and the sampler's penalties: the pieces /v1/chat/completions is made of."""
from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import needs_llama
from p2pswarm.backbone.api.chat import ChatError, ChatTemplate, read_chat_template
from p2pswarm.backbone.api.completion import PenalizedSampler
from p2pswarm.backbone.api.stops import StopMatcher, parse_stop
from p2pswarm.engine.text.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a swarm?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "How are you?"}],
    [{"role": "user", "content": "Write <|im_end|> literally"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": [{"type": "text", "text": "multi "}, {"type": "text", "text": "part ü 日本"}]}],
    [{"role": "user", "content": "line one\nline two\n\n  indented"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "é🙂 emoji and \t tabs"}],
]


@pytest.mark.slow
@needs_llama
def test_chat_prompt_ids_equal_llama_cpp(qwen35_path):
    """Same GGUF template, same messages: our token ids == llama-cpp-python's chat handler's
    (Jinja2ChatFormatter render, then tokenize with special=True and no BOS, as it does)."""
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    llm = llama_cpp.Llama(model_path=str(qwen35_path), vocab_only=True, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    assert read_chat_template(qwen35_path) == template
    ref = Jinja2ChatFormatter(template=template, eos_token=llm._model.token_get_text(llm.token_eos()),
                              bos_token=llm._model.token_get_text(llm.token_bos()))
    ours = ChatTemplate(template, Tokenizer.from_gguf(qwen35_path))
    for messages in CONVERSATIONS:
        flat = [{**m, "content": m["content"] if isinstance(m["content"], str)
                 else "".join(p["text"] for p in m["content"])} for m in messages]
        r = ref(messages=flat)
        assert ours.render(messages) == r.prompt
        want = llm.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)
        got = ours.encode(messages)
        assert got == want, messages
        im_start = llm.tokenize(b"<|im_start|>", add_bos=False, special=True)
        assert got[:1] == im_start and got.count(im_start[0]) == len(messages) + 1 + (messages[0]["role"] != "system")
    # The literal "<|im_end|>" inside a user's text is parsed as the control token, as llama.cpp does.
    assert ours.encode(CONVERSATIONS[3]).count(llm.tokenize(b"<|im_end|>", add_bos=False, special=True)[0]) == 5  # default system + 3 turns + 1 literal


def test_templates_refuse_clearly(tiny_f32):
    tok = Tokenizer.from_gguf(tiny_f32)
    chat = ChatTemplate(read_chat_template(tiny_f32), tok)
    assert chat.render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    for bad, needle in (([], "non-empty list"), ([{"content": "x"}], "role"), ([{"role": "user", "content": 3}], "content"),
                        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts")):
        with pytest.raises(ChatError, match=needle):
            chat.encode(bad)
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                          "{% endif %}{{ messages[0]['content'] }}", tok)
    with pytest.raises(ChatError, match="first must be user"):
        strict.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatError, match="does not compile"):
        ChatTemplate("{% for %}", tok)


def test_stop_strings_across_token_boundaries():
    rng = random.Random(7)
    text = "The swarm answers. STOP here. More ST text after"
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        for stops, want in ((["STOP"], "The swarm answers. "), (["xyz", ". M"], "The swarm answers. STOP here"),
                            (["nowhere"], text), (["swarm", "The"], "")):
            m = StopMatcher(stops)
            out = "".join(m.push(p) for p in pieces) + m.flush()
            assert out == want, (pieces, stops)
            assert m.stopped == (want != text)
    assert parse_stop("x") == ["x"] and parse_stop(None) == []
    for bad in (["a"] * 5, [""], 3, ["ok", 1]):
        with pytest.raises(ValueError):
            parse_stop(bad)


def test_penalties_and_logit_bias():
    logits = np.array([5.0, 4.9, 0.0, -1.0], dtype=np.float32)
    assert [PenalizedSampler(0.0, 1.0, 0)(logits) for _ in range(3)] == [0, 0, 0]
    s = PenalizedSampler(0.0, 1.0, 0, frequency_penalty=1.0)
    assert [s(logits) for _ in range(4)] == [0, 1, 0, 1]  # a repeated token loses to its runner-up
    s = PenalizedSampler(0.0, 1.0, 0, presence_penalty=2.0)
    assert [s(logits) for _ in range(4)] == [0, 1, 0, 0]  # a flat cost, paid once per token
    assert PenalizedSampler(0.0, 1.0, 0, logit_bias={3: 100.0})(logits) == 3
    seeded = [[PenalizedSampler(0.8, 1.0, seed)(np.zeros(50, np.float32)) for _ in range(1)][0] for seed in (1, 1, 2, 3)]
    assert seeded[0] == seeded[1] and len(set(seeded)) > 1
