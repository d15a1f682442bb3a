"""mkdocs hooks: generate the board, card, evidence, benchmark and research pages at build time.

Registered in mkdocs.yml (`hooks: [tools/site/hooks.py]`). The pages exist only in the build
(`File.generated`), so they always show the `kanban/` and `worklog/` of the checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sitegen.pages import Generated, generate_site

_generated: Generated | None = None


def _expand(nav: Any, sections: dict[str, list[tuple[str, str]]]) -> Any:
    """Replace `Title: <index page of a generated section>` by the index plus its pages."""
    if isinstance(nav, list):
        return [_expand(entry, sections) for entry in nav]
    if isinstance(nav, dict):
        out = {}
        for title, value in nav.items():
            if isinstance(value, str) and value in sections:
                out[title] = [value, *({t: p} for t, p in sections[value])]
            else:
                out[title] = _expand(value, sections)
        return out
    return nav


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    global _generated
    root = Path(config.config_file_path).resolve().parent
    _generated = generate_site(root)
    if config.nav is not None:
        config.nav = _expand(config.nav, _generated.sections)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    if _generated is None:
        raise PluginError("sitegen: on_config did not run")
    for path, content in _generated.files.items():
        if files.get_file_from_path(path) is not None:
            raise PluginError(f"sitegen: docs/{path} exists and would hide the generated page")
        files.append(File.generated(config, path, content=content))
    return files
