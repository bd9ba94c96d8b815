"""Chat messages -> prompt token ids: the tokenizer's chat template, or a plain one.

A tokenizer with a `chat_template` renders the messages with it
(`add_generation_prompt`: the request's, default true; `chat_template_kwargs`: more
variables for the template, vLLM's field — only variables: what would control the
rendering itself is refused); the text is then tokenized without adding special tokens
(the template writes its own). The server renders it off the event loop (a template
may be slow). A tokenizer without one (the embedded
byte-level model) gets the plain template below, documented in the README, tokenized
like a completion prompt:

    system: You are terse.
    user: Write a haiku.
    assistant:

one `<role>: <content>` line per message (a "developer" message is a "system" one),
then `assistant:` with no trailing space or newline, so the model writes the reply
(left out with `add_generation_prompt: false`; the plain template has no variables, so
it ignores `chat_template_kwargs`).
"""

from __future__ import annotations

import inspect
from typing import Any

from kvstrata.server.errors import APIError, invalid

ROLES = ("system", "developer", "user", "assistant")
_MESSAGE_KEYS = ("role", "content", "name")
# What controls the rendering rather than feeding the template (besides every named
# parameter of the tokenizer's apply_chat_template, and any return_* one).
_RENDER_CONTROLS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


def _render_controls(tokenizer: Any) -> frozenset[str]:
    """_RENDER_CONTROLS and the named parameters of `tokenizer.apply_chat_template`."""
    names = set(_RENDER_CONTROLS)
    method = getattr(type(tokenizer), "apply_chat_template", None)
    if method is not None:
        try:
            params = inspect.signature(method).parameters.values()
        except (TypeError, ValueError):  # no signature to read (a builtin): the list above
            params = []
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        names.update(p.name for p in params if p.kind not in variadic and p.name != "self")
    return frozenset(names)


def template_options(body: dict[str, Any], tokenizer: Any = None) -> tuple[bool, dict[str, Any]]:
    """The request's `add_generation_prompt` (default true) and `chat_template_kwargs`
    (default {}), checked: only template variables — a key that names a parameter of
    `tokenizer.apply_chat_template` or otherwise controls the rendering (the template
    itself, tokenize, tools, documents, return_*, ...) is a 400 naming it."""
    add = body.get("add_generation_prompt")
    if add is None:
        add = True
    if not isinstance(add, bool):
        raise invalid("add_generation_prompt", add, "true or false")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise invalid(
            "chat_template_kwargs", kwargs, "an object of template variables, e.g. {'x': 1}"
        )
    reserved = _render_controls(tokenizer)
    for key, value in kwargs.items():
        if key in reserved or key.startswith("return_"):
            raise invalid(
                f"chat_template_kwargs.{key}",
                value,
                "not a template variable: a parameter of the chat template call, set by the "
                "server (use the request's own field where there is one)",
            )
    return add, kwargs


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The `messages` of a chat request as [{"role", "content"(, "name")}] with text
    content; text parts ({"type": "text", "text": ...}) are joined with newlines.

    Args:
        messages: The request's `messages` field.

    Returns:
        The messages, roles and contents checked (400 naming the message otherwise).
    """
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", messages, "a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, message, "an object with role and content")
        for key, value in message.items():
            if key not in _MESSAGE_KEYS and value not in (None, [], ""):
                raise invalid(
                    f"{where}.{key}",
                    value,
                    "not supported (tool calls and audio are not implemented); "
                    f"known: {', '.join(_MESSAGE_KEYS)}",
                    code="unsupported_value",
                )
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", role, f"one of {', '.join(ROLES)}")
        content = _text(message.get("content"), f"{where}.content")
        item = {"role": "system" if role == "developer" else role, "content": content}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid(f"{where}.name", name, "a string")
            item["name"] = name
        out.append(item)
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, content, "a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else part
            raise invalid(
                f"{where}[{j}].type",
                kind,
                "'text' (only text content is supported)",
                code="unsupported_value",
            )
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{j}].text", part.get("text"), "a string")
        texts.append(part["text"])
    return "\n".join(texts)


def plain_chat_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The plain template (module docstring) for tokenizers without a chat template."""
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    return "".join(lines) + ("assistant:" if add_generation_prompt else "")


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render checked messages to prompt token ids (module docstring).

    Args:
        tokenizer: A Hugging Face tokenizer.
        messages: From check_messages.
        add_generation_prompt: end with the assistant's turn opening.
        template_kwargs: more variables for the tokenizer's chat template.

    Returns:
        The prompt's token ids.
    """
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja)
            raise APIError(
                400,
                f"messages could not be rendered by the model's chat template: {exc}",
                param="messages",
                code="invalid_value",
            ) from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(plain_chat_prompt(messages, add_generation_prompt))["input_ids"])
