"""Build-time page generator for the worklog site (`mkdocs.yml` hooks: tools/site/hooks.py).

Everything the site shows about cards, evidence and benchmarks is read from `kanban/` and
`worklog/` when the site is built, so the site cannot drift from the repository. The package
depends on cardgate (the board model) and matplotlib (charts), never the other way round.
"""

from sitegen.pages import generate_site

__all__ = ["generate_site"]
