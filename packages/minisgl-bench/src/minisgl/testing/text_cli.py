"""`minisgl-cpu-service text --model DIR`: the Rust service's text layer, one JSON line per
request and per reply (parity tests against transformers, the encode benchmark)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any


class TextCli:
    def __init__(self, binary: Path, model: Path | str) -> None:
        self.proc = subprocess.Popen(
            [str(binary), "text", "--model", str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )

    def ask(self, **req: Any) -> dict[str, Any]:
        return self.ask_raw(json.dumps(req))

    def ask_raw(self, line: str) -> dict[str, Any]:
        """The reply to one line (an `{"error": ...}` reply included); raises if the CLI died."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise AssertionError(f"the CLI exited (rc={self.proc.wait()})") from None
        reply = self.proc.stdout.readline()
        assert reply, f"the CLI exited (rc={self.proc.wait()})"
        return json.loads(reply)

    def close(self) -> None:
        if self.proc.stdin:
            with contextlib.suppress(BrokenPipeError):  # it exited: a failing request said so
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
