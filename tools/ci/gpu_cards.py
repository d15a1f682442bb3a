"""The cards that need GPU evidence: list them, or gate them (`nox -s gpu` calls `--gate`).

    python tools/ci/gpu_cards.py                 # one card id per line
    python tools/ci/gpu_cards.py --gate [ID ...] # gate the ids given, else every listed card

A card needs GPU evidence when it is not done and either says so in its header
(`Hardware: gpu`) or one of its gate rules targets a GPU (`hardware` other than cpu / any).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from cardgate.board import load_board
from cardgate.thresholds import GateFormatError, load_gates


def gate_files(root: Path, card) -> list[Path]:
    named = [root / p for p in card.gates] or [root / "worklog" / "gates" / f"{card.id}.yaml"]
    return [p for p in named if p.is_file()]


def needs_gpu(root: Path, card) -> bool:
    if card.fields.get("hardware", "").strip().lower() in {"gpu", "cuda"}:
        return True
    try:
        gates = load_gates(*gate_files(root, card))
    except (GateFormatError, OSError):
        return False
    return any(g.hardware.lower() not in {"cpu", "any"} for g in gates.gates)


def cards_needing_gpu(root: Path) -> list[str]:
    board = load_board(root)
    return [
        card.id
        for lane in ("in-progress", "todo")
        for card in board.lanes[lane]
        if needs_gpu(root, card)
    ]


def tree_changes(root: Path) -> list[str]:
    """What the gate would call a dirty tree: changes outside worklog/evidence/."""
    done = subprocess.run(
        ["git", "status", "--porcelain=v1", "--untracked-files=all", "--", ".",
         ":(exclude)worklog/evidence"],
        cwd=root, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return [line[3:] for line in done.stdout.splitlines() if line.strip()]


def gate(root: Path, card_ids: list[str]) -> int:
    """Gate every card (each records its evidence); 1 when any did not pass.

    A passing gate stages its card's move to done/, which leaves the tree dirty for the next
    card: the cards after it are reported as not run (gate them in another run) instead of
    being recorded as holds.
    """
    if not card_ids:
        print("gpu: no card needs GPU evidence")
        return 0
    outcomes = {}
    for index, card_id in enumerate(card_ids):
        changed = tree_changes(root) if index else []
        if changed:
            print(f"gpu: {card_id} not gated: the previous gate changed {', '.join(changed)}")
            outcomes[card_id] = "not run"
            continue
        done = subprocess.run(
            [sys.executable, "-m", "cardgate", "gate", card_id, "--root", str(root)], check=False
        )
        outcomes[card_id] = {0: "pass", 1: "fail", 2: "hold"}.get(done.returncode, "error")
    print("gpu: " + ", ".join(f"{cid} {outcome}" for cid, outcome in outcomes.items()))
    return 0 if all(o == "pass" for o in outcomes.values()) else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."))
    parser.add_argument("--gate", action="store_true", help="gate the cards instead of listing")
    parser.add_argument("cards", nargs="*", help="card ids (default: every card needing a GPU)")
    args = parser.parse_args(argv)
    cards = args.cards or cards_needing_gpu(args.root)
    if args.gate:
        return gate(args.root, cards)
    print("\n".join(cards))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
