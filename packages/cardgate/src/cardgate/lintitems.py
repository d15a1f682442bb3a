"""Card files under `<root>/kanban/<lane>/*.md` collected as pytest lint items."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cardgate.board import KANBAN_DIR, rel
from cardgate.state import STATE
from cardgate.verify import verify_card


def collect_card(file_path: Path, parent: pytest.Collector, root: Path) -> pytest.Collector | None:
    if file_path.suffix != ".md" or not parent.config.getini("cardgate_lint"):
        return None
    if file_path.parent.parent != root / KANBAN_DIR:
        return None
    return CardFile.from_parent(parent, path=file_path)


class CardLintError(Exception):
    pass


class CardFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        yield CardLintItem.from_parent(self, name="lint")


class CardLintItem(pytest.Item):
    """Fails with `file:line: message` lines when the card (or the board around it) is broken."""

    def runtest(self) -> None:
        state = self.config.stash[STATE]
        board = state.get_board()
        where = rel(self.path, state.root)
        problems = [str(e) for e in board.errors_for(where)]
        card = next((c for c in board.cards.values() if c.path == where), None)
        if card is not None:
            problems += [f"{where}:1: {flag}" for flag in verify_card(state.root, card).flags]
        if problems:
            raise CardLintError("\n".join(problems))

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> str:
        if isinstance(excinfo.value, CardLintError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"card lint: {self.path.name}"
