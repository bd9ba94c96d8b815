"""Chat messages -> prompt token ids: the tokenizer's chat template (`add_generation_prompt`,
default true; `chat_template_kwargs`, vLLM's field: template variables only), its text
tokenized without adding special tokens; or, for a tokenizer without one (the embedded
byte-level model), the plain template of docs/serving.md, tokenized like a completion prompt:

    system: You are terse.
    user: Write a haiku.
    assistant:

one `<role>: <content>` line per message ("developer" is "system"), then `assistant:` with
nothing after it (left out with `add_generation_prompt: false`; it has no variables).

Only the template writes special tokens: one's text (`<|im_start|>`, `<eos>`) in a
message's content is plain text, so a user cannot write another role's turn, unless the
server trusts its callers (`kvstrata serve --trust-special-tokens`).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvstrata.server.errors import APIError, invalid


def _render_controls(tokenizer: Any) -> frozenset[str]:
    """What controls the rendering rather than feeding the template: "messages", and the
    named parameters of transformers' apply_chat_template and of the tokenizer's own."""
    names = {"messages"}
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for owner in (PreTrainedTokenizerBase, type(tokenizer)):
        method = getattr(owner, "apply_chat_template", None)
        try:
            params = inspect.signature(method).parameters.values() if method else []
        except (TypeError, ValueError):  # no signature to read (a builtin)
            params = []
        names.update(p.name for p in params if p.kind not in variadic and p.name != "self")
    return frozenset(names)


def template_options(body: Any, tokenizer: Any = None) -> tuple[bool, dict[str, Any]]:
    """The request's `add_generation_prompt` (default true) and `chat_template_kwargs`
    (default {}; a ChatRequest or a mapping of the two): a key that controls the
    rendering (_render_controls, return_*) rather than a template variable is a 400."""
    get = body.get if isinstance(body, dict) else lambda name: getattr(body, name)
    add = get("add_generation_prompt")
    kwargs = get("chat_template_kwargs") or {}
    reserved = _render_controls(tokenizer)
    for key, value in kwargs.items():
        if key in reserved or key.startswith("return_"):
            raise invalid(
                f"chat_template_kwargs.{key}",
                value,
                "not a template variable: a parameter of the chat template call, set by the "
                "server (use the request's own field where there is one)",
            )
    return add is not False, kwargs


def chat_messages(messages: list[Any]) -> list[dict[str, str]]:
    """Parsed messages (`protocol.Message`) as the template takes them: role ("developer"
    is "system"), content as text, name when given."""
    out = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        item = {"role": role, "content": message.content}
        if message.name is not None:
            item["name"] = message.name
        out.append(item)
    return out


def plain_chat_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The plain template (module docstring) for tokenizers without a chat template."""
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    return "".join(lines) + ("assistant:" if add_generation_prompt else "")


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    trust_special_tokens: bool = False,
) -> list[int]:
    """The prompt token ids of `messages` (from chat_messages; module docstring):
    `trust_special_tokens`, a special token's text in a content is that token (a caller
    may write turns); else it is plain text and only the template writes them."""
    specials = () if trust_special_tokens else special_strings(tokenizer)
    hidden: dict[int, str] = {}  # a stand-in character -> the special token's text
    if any(s in m["content"] for m in messages for s in specials):
        messages, hidden = _hide(messages, specials)
    if not getattr(tokenizer, "chat_template", None):
        text = plain_chat_prompt(messages, add_generation_prompt).translate(hidden)
        return encode_text(tokenizer, text, bool(specials))
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
    if not hidden:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    # the template's own special tokens (the contents' are hidden) split the text, as the
    # tokenizer splits it; each piece between them is tokenized on its own, the contents'
    # special tokens as plain text
    ids: list[int] = []
    for i, piece in enumerate(re.split(f"({'|'.join(map(re.escape, specials))})", text)):
        if i % 2:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            ids += encode_text(tokenizer, piece.translate(hidden), True, add_special_tokens=False)
    return ids


def special_strings(tokenizer: Any) -> tuple[str, ...]:
    """The texts the tokenizer reads as special tokens (every added token marked
    special), longest first."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        added = backend.get_added_tokens_decoder().values()
        names = {t.content for t in added if t.special}
    else:
        names = set(getattr(tokenizer, "all_special_tokens", None) or ())
    return tuple(sorted((n for n in names if n), key=lambda n: (-len(n), n)))


def encode_text(
    tokenizer: Any, text: str, split_special: bool, add_special_tokens: bool = True
) -> list[int]:
    """`text`'s token ids; `split_special`: a special token's text in it is plain text."""
    kwargs = {"split_special_tokens": True} if split_special else {}
    return list(tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)["input_ids"])


def _hide(
    messages: list[dict[str, str]], specials: tuple[str, ...]
) -> tuple[list[dict[str, str]], dict[int, str]]:
    """The messages with each special token's text in their contents replaced by a
    private-use character none of them holds, and the table (str.translate) back."""
    contents = "".join(m["content"] for m in messages)
    base = 0xF0000  # plane 15, private use
    while any(chr(c) in contents for c in range(base, base + len(specials))):
        base += len(specials)
    hidden = {chr(base + i): s for i, s in enumerate(specials)}
    pattern = re.compile("|".join(map(re.escape, specials)))
    stand_in = {s: c for c, s in hidden.items()}
    out = [
        {**m, "content": pattern.sub(lambda hit: stand_in[hit.group()], m["content"])}
        for m in messages
    ]
    return out, str.maketrans(hidden)
