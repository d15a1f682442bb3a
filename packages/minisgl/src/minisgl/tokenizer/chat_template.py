"""A chat template given by the user (`--chat-template`, `LLM(chat_template=...)`) instead of
the model's own: a file, or the template inline (vLLM's rule: a value that names no file is a
template only if it holds Jinja markup or a newline). It is compiled up front, in the sandbox
transformers renders with, so a malformed one fails before anything loads."""

from __future__ import annotations

from pathlib import Path

JINJA_MARKS = ("{{", "{%", "{#", "\n")


def resolve_chat_template(value: str, name: str = "--chat-template") -> str:
    """The template's text; a one-line ValueError (starting with `name`) for a missing file or
    a malformed template."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a template file or a non-empty template")
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # too long / NUL for a path: an inline template
        is_file = False
    if is_file:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{name} {value}: cannot read it ({e})") from None
        where = f"{name} {value}"
    elif any(mark in value for mark in JINJA_MARKS):
        text, where = value, name
    else:
        raise ValueError(f"{name} {value}: no such file (an inline template holds '{{{{' or '{{%')")
    check_chat_template(text, where)
    return text


def check_chat_template(text: str, where: str) -> None:
    """Compile `text` as transformers does (`ImmutableSandboxedEnvironment`, trim_blocks,
    lstrip_blocks, loop controls): a syntax error is a ValueError naming its line."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    try:
        env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"{where}: malformed template: line {e.lineno}: {' '.join(str(e.message).split())}"
        ) from None
