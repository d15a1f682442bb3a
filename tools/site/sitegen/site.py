"""The site as the repository holds it now: the cards with their evidence runs, the baselines and
their history over the commits, the research notes (`data` reads each, `history` the points)."""

from __future__ import annotations

from pathlib import Path

from sitegen.data import Site, load_baselines, load_cards, load_research
from sitegen.history import collect_history


def load_site(root: Path | str) -> Site:
    root = Path(root).resolve()
    cards, errors = load_cards(root)
    baselines = load_baselines(root)
    site = Site(
        root=root,
        cards=cards,
        errors=errors,
        baselines=baselines,
        history=[],
        research=load_research(root),
    )
    site.history = collect_history(site)
    return site
