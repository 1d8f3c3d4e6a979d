"""Chat templates: a checkpoint's Jinja template, rendered in a sandbox as HF transformers renders it.

Where a checkpoint keeps its template (transformers' rules, ``PreTrainedTokenizerBase``):
``chat_template.jinja`` (the default template) and ``additional_chat_templates/<name>.jinja``
(named ones); else ``tokenizer_config.json``'s ``chat_template``, a string or a list of
``{"name", "template"}``. With several templates, ``"default"`` is used unless a name is given
(``"tool_use"`` when tools are passed and there is one).

Rendering is transformers' ``render_jinja_template``: jinja2's ``ImmutableSandboxedEnvironment``
(a template is untrusted code from the Hub: no attribute starting with ``_``, no mutation of the
inputs) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a
``{% generation %}`` tag that renders its body, and ``*`` / ``**`` bounded (``MAX_REPEAT_ITEMS``,
``MAX_POWER_EXPONENT``: a request's own template could otherwise render gigabytes); ``raise_exception(msg)``,
``strftime_now(fmt)``, a ``tojson`` filter that does not escape HTML, and ``dict`` / ``namespace`` that refuse
dunder names. The template sees ``messages`` (message dicts, keys with a None value dropped, every value
rebuilt from plain JSON types), ``tools``, ``documents``, ``add_generation_prompt``, the
tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) and any extra keyword. The
rendered text is tokenized without adding special tokens (the template writes them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases for a message's reasoning


class ChatTemplateError(ValueError):
    """A chat template could not be found, compiled or rendered (the template's own
    ``raise_exception`` and sandbox refusals included)."""


def read_chat_templates(folder: str | Path, tokenizer_config: dict) -> dict[str, str]:
    """name -> template source of a checkpoint folder ({} without one); see the module docstring."""
    folder = Path(folder)
    templates: dict[str, str] = {}
    configured = tokenizer_config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        for entry in configured:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                    or not isinstance(entry.get("template"), str):
                raise ChatTemplateError(f"{folder / 'tokenizer_config.json'}: chat_template entries must be "
                                        f"{{'name': str, 'template': str}}, got {entry!r}")
            templates[entry["name"]] = entry["template"]
    elif configured is not None:
        raise ChatTemplateError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                                f"named templates, got {type(configured).__name__}")
    files = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = folder / CHAT_TEMPLATE_FILE
    if (folder / CHAT_TEMPLATE_DIR).is_dir():
        files.update({file.stem: file for file in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja"))})
    if files:  # the template files replace what tokenizer_config.json says (as in transformers)
        templates = {name: file.read_text(encoding="utf-8") for name, file in files.items()}
    return templates


def special_tokens_of(tokenizer_config: dict) -> dict[str, str]:
    """The named special tokens a template sees (``bos_token``: "<s>", ...), from tokenizer_config.json."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def choose_template(templates: dict[str, str], chat_template: str | None, tools) -> str:
    """The template source to render: ``chat_template`` (a name among ``templates`` or a template
    itself), else the default (``tool_use`` with tools where there is one)."""
    if chat_template is not None:
        return templates.get(chat_template, chat_template)
    if not templates:
        raise ChatTemplateError("this tokenizer has no chat template (no chat_template in tokenizer_config.json and "
                                "no chat_template.jinja): pass chat_template=")
    if len(templates) == 1:
        return next(iter(templates.values()))
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ChatTemplateError(f"this tokenizer has several chat templates and no default: pass chat_template= one "
                            f"of {sorted(templates)}")


@functools.cache
def template_call_arguments() -> frozenset[str]:
    """The names a template's extra variables (``chat_template_kwargs``) cannot take as variables: the parameters
    of ``Tokenizer.apply_chat_template`` and :func:`render` (each would reach its function twice) and
    ``messages`` (what the template reads)."""
    from atom_core.engine.tokenizer import Tokenizer

    names = {"messages"}
    for function in (Tokenizer.apply_chat_template, render):
        names.update(name for name, p in inspect.signature(function).parameters.items()
                     if p.kind is not inspect.Parameter.VAR_KEYWORD)
    return frozenset(names)


def render(template: str, conversation: list, *, add_generation_prompt: bool, continue_final_message: bool = False,
           tools=None, documents=None, special_tokens: dict[str, str] | None = None, **kwargs) -> str:
    """One conversation (a list of message dicts) rendered by ``template``; keyword arguments
    are passed to the template (they override the special tokens of the same name).

    ``continue_final_message``: the text ends with the final message's content, its turn left open for
    the model to go on writing it (what the template writes after that content is cut, as transformers
    does); not with ``add_generation_prompt``."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ChatTemplateError("a conversation is a non-empty list of messages")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message (go on writing the final message) and add_generation_prompt "
                                "(start a new assistant turn) exclude each other: pass add_generation_prompt=False")
    messages = []
    for message in conversation:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages are dicts, got {type(message).__name__}: {message!r}")
        messages.append({key: value for key, value in message.items() if value is not None})
    messages = _alias_reasoning(_plain(messages))  # (fresh copies: the caller's messages are never changed)
    if not iterates_content(template):
        messages = [_join_text_parts(message) for message in messages]
    final_text = _mark_final_message(messages[-1]) if continue_final_message else ""
    variables = _plain({**(special_tokens or {}), **kwargs})
    try:
        text = compile_template(template).render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                                                 add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:  # SecurityError and raise_exception's TemplateError included
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from e
    except (TypeError, ValueError, LookupError, ArithmeticError) as e:  # the template's own code failed on its inputs
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from e
    return _cut_at_mark(text, final_text) if continue_final_message else text


@functools.lru_cache(maxsize=64)
def iterates_content(template: str) -> bool:
    """Whether ``template`` loops over a message's content (``{% for part in message['content'] %}``): vLLM's
    "openai" content format, where a list of content parts reaches the template as a list. Any other template
    (vLLM's "string" format) gets a list of text parts joined by newlines, as vLLM joins them. A template that
    does not compile counts as not looping (``render`` raises its error)."""
    try:
        tree = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        source = loop.iter
        while isinstance(source, jinja2.nodes.Filter):  # message['content'] | selectattr(...)
            source = source.node
        if isinstance(source, jinja2.nodes.Getitem) and isinstance(source.arg, jinja2.nodes.Const) \
                and source.arg.value == "content":
            return True
        if isinstance(source, jinja2.nodes.Getattr) and source.attr == "content":
            return True
    return False


def _join_text_parts(message: dict) -> dict:
    """``message`` with a content of text parts (``[{"type": "text", "text": ...}, ...]``) as their texts joined by
    newlines; other parts are refused (only text is supported)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
               for part in content):
        raise ChatTemplateError("content parts must be {'type': 'text', 'text': str} (only text is supported)")
    return message | {"content": "\n".join(part["text"] for part in content)}


# continue_final_message: the final message's text gets this mark, and the rendered text ends where the mark is.
_OPEN_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


def _mark_final_message(final: dict) -> str:
    """Append ``_OPEN_MARK`` to ``final``'s content (a string, or its last text part); returns that text."""
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _OPEN_MARK
        return content
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text, part["text"] = part["text"], part["text"] + _OPEN_MARK
                return text
    raise ChatTemplateError("continue_final_message needs a final message with text content")


def _cut_at_mark(text: str, final_text: str) -> str:
    """``text`` up to the mark: where the template kept the space after it, the final message's own trailing
    spaces stay; where it trimmed them, they go too (transformers' rule)."""
    mark = _OPEN_MARK.strip()
    at = text.rfind(mark)
    if at < 0 or final_text.strip() not in text:
        raise ChatTemplateError("continue_final_message: the chat template does not write the final message's "
                                "content as given (it changes or drops part of it), so there is no place to go on from")
    return text[:at] if text.startswith(_OPEN_MARK, at) else text[:at].rstrip()


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' sandboxed environment (cached per source)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------- the environment (transformers')

class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks the assistant's
    spans with it; here only the text matters)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` without the dict type itself (no attribute access to its internals)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` refusing names that start with an underscore."""

    def __init__(*args, **kwargs):  # jinja2's signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attributes on a "
                                                  f"namespace, got {name!r}")


# The longest string or list a template's ``*`` may make, and the largest power its ``**`` may take.
MAX_REPEAT_ITEMS = 1 << 20
MAX_POWER_EXPONENT = 4096


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with ``*`` and ``**`` bounded: ``{{ 'a' * 100000000 }}`` (a template a request may bring,
    with the server's ``--trust-request-chat-template``) would render 100 MB and take gigabytes to tokenize.
    jinja2's own sandbox bounds ``range`` only."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > MAX_REPEAT_ITEMS:
                    raise jinja2.exceptions.SecurityError(f"a repetition of {len(seq) * count} items "
                                                          f"(at most {MAX_REPEAT_ITEMS})")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_POWER_EXPONENT:
            raise jinja2.exceptions.SecurityError(f"a power of exponent {right} (at most "
                                                  f"{MAX_POWER_EXPONENT})")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (what a sandboxed template may see); anything else
    becomes a placeholder naming its type (transformers' ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():  # numpy scalars
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (the OpenAI client's messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read (transformers' ``_alias_reasoning_fields``)."""
    aliased = []
    for message in messages:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased
