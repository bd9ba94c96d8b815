"""Prompts: the chat template of instruct models, and prompt text from a file or stdin.

    ids = encode_prompt(tokenizer, "Summarise this: ...", chat=uses_chat(tokenizer))

An instruct model (one whose tokenizer has a chat template, e.g. smollm2) is asked as a user
message with the assistant's turn opened; other models get the text as is.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvstrata.core.errors import ConfigError


def read_prompt_file(value: str) -> str:
    """The text of --prompt-file: a file, or standard input for '-' (UTF-8).

    Args:
        value: The flag's value.

    Returns:
        The text (ConfigError when unreadable, not UTF-8, or empty).
    """
    try:
        data = sys.stdin.buffer.read() if value == "-" else Path(value).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError.field("prompt_file", value, f"cannot read it ({exc.strerror})") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError.field(
            "prompt_file", value, f"not UTF-8 text (byte {data[exc.start]:#04x} at {exc.start})"
        ) from exc
    if not text.strip():
        raise ConfigError.field("prompt_file", value, "a file with some text in it")
    return text


def uses_chat(tokenizer: Any, raw: bool = False) -> bool:
    """Whether a prompt goes through the tokenizer's chat template (instruct models)."""
    return not raw and bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> Any:
    """Token ids [1, n] of a prompt: a user message in the chat template (with the
    assistant's turn opened), or the plain text.

    Args:
        tokenizer: The model's tokenizer.
        text: The prompt.
        chat: Apply the chat template (see :func:`uses_chat`).

    Returns:
        A LongTensor [1, n].
    """
    if chat:
        messages = [{"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        return encoded["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids
