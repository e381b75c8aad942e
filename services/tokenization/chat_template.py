"""Chat templates: choose one, compile it in a sandbox, render messages the way transformers does.

Rendering mirrors transformers' `apply_chat_template`: an `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a pass-through `{% generation %}`
tag, `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, the safe `dict` and
`namespace` helpers, and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as
variables. The rendered text is then encoded with `add_special_tokens=False`, since the template
already wrote BOS and friends.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.errors import Reason

# ChatML (Qwen, many fine-tunes). Assumes <|im_start|>/<|im_end|> exist as added tokens.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Gemma 2/3 turn format, as Gemma 3's official template (google/gemma-3-*-it) writes it: the system
# message is folded into the first user turn, "assistant" is spelt "model", and roles must alternate.
# Text parts only. Also the template `tokenrelay up`'s default model is built with.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "gemma": GEMMA}


class ChatTemplateNotFound(ValueError):
    """The --chat-template override names neither a file, a model template nor a built-in."""


def resolve_template(override: str, model_templates: Mapping[str, str]) -> tuple[str, str] | None:
    """(name, source) of the template to use, or None when the model has none.

    An override is, in order: a file path, one of the model's named templates, a built-in name.
    Without an override the model's "default" template is used (as transformers does when there
    are several and no tools are passed).
    """
    if override:
        path = pathlib.Path(override).expanduser()
        if path.is_file():
            return str(path), path.read_text(encoding="utf-8")
        if override in model_templates:
            return override, model_templates[override]
        if override in BUILTIN_TEMPLATES:
            return override, BUILTIN_TEMPLATES[override]
        raise ChatTemplateNotFound(
            f"chat template {override!r} is not a file, not one of the model's templates "
            f"{sorted(model_templates)} and not a built-in {sorted(BUILTIN_TEMPLATES)}")
    if "default" in model_templates:
        return "default", model_templates["default"]
    return None


class ChatTemplate:
    """A compiled template bound to the tokenizer's special-token variables. Thread-safe."""

    def __init__(self, source: str, name: str = "default", variables: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.source = source
        self._variables = dict(variables or {})
        # Syntax errors surface at startup, not on the first request.
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template {name!r} does not compile: {exc}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        if not messages:
            raise Reason.EMPTY_PROMPT.error("chat has no messages")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._variables)
        except jinja2.TemplateError as exc:
            raise Reason.CHAT_TEMPLATE_ERROR.error(f"chat template {self.name!r}: {exc}") from exc
        except Exception as exc:  # a template is untrusted code; any failure is the input's
            raise Reason.CHAT_TEMPLATE_ERROR.error(
                f"chat template {self.name!r} failed: {type(exc).__name__}: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes, which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # dict() without exposing the type object (and its attributes) to the template.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces that refuse dunder/underscore attributes, as transformers' do.
    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _TemplateNamespace._check_name(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks; render as is."""

    tags = {"generation"}  # noqa: RUF012 - Jinja's API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
