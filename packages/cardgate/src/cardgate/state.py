"""The plugin's per-session state (options, the board, what the card selected), in the stash."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from cardgate.board import Board, load_board


@dataclass
class CardgateState:
    root: Path
    card: str | None
    items: set[str] | None
    report_path: Path | None
    board: Board | None = None
    selected: int = 0
    timeout: float | None = None
    gate_only: bool = False
    bound: dict[str, list[str]] | None = None

    def get_board(self) -> Board:
        if self.board is None:
            self.board = load_board(self.root)
        return self.board


STATE = pytest.StashKey[CardgateState]()
