"""`python -m minisgl.shell --base-url http://127.0.0.1:1919`: terminal chat with a server.

Keeps the conversation history; `/reset` clears it, `/exit` (or end of input) quits. Replies
stream as they are generated. Reads stdin line by line, so it can be driven by a pipe.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.shell")
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--model", default=None, help="default: the server's model")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--system", default=None, help="system prompt")
    args = p.parse_args(argv)

    import openai

    base = args.base_url.rstrip("/")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120)
    try:
        model = args.model or client.models.list().data[0].id
    except openai.APIError as e:
        print(f"cannot reach the server at {base}: {e}", file=sys.stderr)
        return 1
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    print(f"minisgl shell: {model} at {base}. /reset clears the history, /exit quits.")
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(system)
            print("(history cleared)")
            continue
        history.append({"role": "user", "content": text})
        print("assistant> ", end="", flush=True)
        reply = _stream_reply(client, model, history, args)
        if reply is None:
            history.pop()
            continue
        print()
        history.append({"role": "assistant", "content": reply})
    print("bye")
    return 0


def _stream_reply(
    client: openai.OpenAI, model: str, history: list[dict], args: argparse.Namespace
) -> str | None:
    """The assistant's reply to `history`, printed as it streams; None (the error printed)
    when the server refuses or fails it."""
    import openai

    reply = []
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                piece = chunk.choices[0].delta.content
                reply.append(piece)
                print(piece, end="", flush=True)
    except openai.APIError as e:
        print(f"\n(error: {e})")
        return None
    return "".join(reply)


if __name__ == "__main__":
    sys.exit(main())
