"""Chat messages -> prompt token ids, with the model's own ``tokenizer.chat_template`` from the GGUF.

A chat model is trained on one exact layout of turns (role markers, special tokens, the header
that opens the assistant's reply); anything else degrades its answers. So the backbone never
invents a format: it renders the Jinja template the GGUF carries, the way Hugging Face
transformers and llama.cpp (llama-cpp-python's ``Jinja2ChatFormatter``) render it:

* a sandboxed, immutable Jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension and a pass-through ``{% generation %}`` tag;
* ``tojson`` that keeps non-ASCII text (``ensure_ascii=False``), ``raise_exception`` and
  ``strftime_now`` as globals, ``bos_token`` / ``eos_token`` as the vocab's texts of those ids;
* ``add_generation_prompt=True``, so the prompt ends where the assistant's reply begins;
* the rendered text tokenized with special-token parsing on and no BOS/EOS added (the template
  places its own special tokens), as llama-cpp-python's chat handler does.

A model without a template cannot be chatted with: :class:`ChatError` says so (a 400 upstream).
"""
from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.sandbox

from p2pswarm.errors import UserError

MAX_MESSAGES = 1024


class ChatError(UserError):
    """A conversation that cannot be rendered (no template, bad messages, a template's own error)."""


class _GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; a
    renderer just emits the body."""

    tags = {"generation"}

    def parse(self, parser):
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise ChatError(f"the model's chat template refused the conversation: {message}")


def read_chat_template(model_path: str | os.PathLike) -> str | None:
    """The GGUF's ``tokenizer.chat_template`` (None when it has none)."""
    from p2pswarm.model.gguf_read import open_gguf, scalar

    return scalar(open_gguf(model_path), "tokenizer.chat_template", (str,)) or None


def normalize_messages(messages) -> list[dict]:
    """OpenAI ``messages`` -> the list of dicts a template iterates over.

    ``content`` may be a string, null (an assistant turn that only calls tools) or a list of
    ``{"type": "text", "text": ...}`` parts, which are joined: this backbone serves text models.
    Other keys (``name``, ``tool_calls``, ``tool_call_id``) pass through for templates that use them.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise ChatError(f"'messages' has {len(messages)} entries; at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatError(f"messages[{i}].content[{j}]: only text parts are supported by a text model")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ChatError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "role": role, "content": content})
    return out


class ChatTemplate:
    """One model's compiled chat template and the tokenizer that turns its output into ids."""

    def __init__(self, template: str, tokenizer):
        self.source = template
        self.tokenizer = tokenizer
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as exc:
            raise ChatError(f"the model's chat template does not compile: {exc}") from None
        self.bos_token = tokenizer.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        self.eos_token = tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else ""

    def render(self, messages, *, add_generation_prompt: bool = True, **extra) -> str:
        msgs = normalize_messages(messages)
        try:
            return self._template.render(
                messages=msgs, bos_token=self.bos_token, eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt, raise_exception=_raise,
                strftime_now=lambda f: datetime.now().strftime(f), **extra)
        except ChatError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise ChatError(f"the model's chat template failed on this conversation: {exc}") from None

    def encode(self, messages, **extra) -> list[int]:
        """Prompt token ids: render, then tokenize with special tokens parsed and none added."""
        return self.tokenizer.encode(self.render(messages, **extra), special=True, add_special=False)
