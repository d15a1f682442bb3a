"""The built site in headless Chromium (Debian's binary, driven by Playwright).

Run by `nox -s docs` after `mkdocs build --strict` (it installs chromium and sets
MINISGL_SITE_DIR / MINISGL_CHROMIUM). Standalone, it builds the site itself; without a
Chromium it fails with a message instead of skipping. Screenshots go to
$MINISGL_SCREENSHOT_DIR (default: <site>/../site-screenshots).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "site"))

from sitegen.site import load_site  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory) -> Path:
    given = os.environ.get("MINISGL_SITE_DIR")
    if given:
        path = Path(given)
        assert (path / "board.html").is_file(), f"{path} holds no built site (run nox -s docs)"
        return path
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def base_url(site_dir: Path):
    """The site over HTTP, as GitHub Pages serves it (search does not load from file://)."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(site_dir))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def chromium() -> str:
    found = os.environ.get("MINISGL_CHROMIUM") or next(
        filter(None, map(shutil.which, BROWSERS)), None
    )
    assert found, "no Chromium: `apt-get install chromium` (nox -s docs installs it)"
    return found


@pytest.fixture(scope="module")
def shots(site_dir: Path) -> Path:
    out = Path(os.environ.get("MINISGL_SCREENSHOT_DIR") or site_dir.parent / "site-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser(chromium: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def site():
    return load_site(ROOT)


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url, wait_until="load")
    return page, errors


def images_loaded(page) -> list[tuple[str, int]]:
    return page.evaluate(
        "Array.from(document.querySelectorAll('article img')).map(i => [i.src, i.naturalWidth])"
    )


def test_board_renders_every_card_in_its_lane(browser, base_url, site, shots):
    page, errors = open_page(browser, base_url + "board.html")
    page.screenshot(path=str(shots / "board.png"), full_page=True)
    lanes = page.evaluate(
        "Object.fromEntries(Array.from(document.querySelectorAll('.kb-column')).map(c =>"
        " [c.dataset.lane, Array.from(c.querySelectorAll('.kb-card')).map(k => k.dataset.card)]))"
    )
    expected = {lane: [c.id for c in site.cards if c.lane == lane] for lane in lanes}
    assert lanes == expected
    assert sorted(c for ids in lanes.values() for c in ids) == sorted(c.id for c in site.cards)
    assert set(lanes) == {"backlog", "todo", "in-progress", "done"}
    # every tile is visible and links to its card page
    for card in site.cards:
        tile = page.locator(f'.kb-card[data-card="{card.id}"]')
        assert tile.is_visible()
        assert tile.locator(f'a[href="cards/{card.id}.html"]').count() == 1
        assert card.card.title in tile.inner_text()
    # the lanes sit side by side (columns), not stacked
    boxes = [page.locator(f'.kb-column[data-lane="{lane}"]').bounding_box() for lane in lanes]
    assert len({round(b["y"]) for b in boxes}) == 1
    assert [b["x"] for b in boxes] == sorted(b["x"] for b in boxes)
    # a tile's link leads to its card page
    first = site.cards[0]
    page.locator(f'.kb-card[data-card="{first.id}"] a[href="cards/{first.id}.html"]').click()
    page.wait_for_url(f"**/cards/{first.id}.html")
    assert page.locator("article h1").inner_text().startswith(f"{first.id}: ")
    assert errors == []
    page.close()


def test_card_page_renders_items_timeline_and_charts(browser, base_url, site, shots):
    card = max(site.cards, key=lambda c: (len(c.runs), sum(len(r.gates) for r in c.runs)))
    assert card.runs, "no card with evidence to look at"
    page, errors = open_page(browser, f"{base_url}cards/{card.id}.html")
    page.screenshot(path=str(shots / f"card-{card.id}.png"), full_page=True)
    text = page.inner_text("article")
    for item in card.card.items.values():
        assert item.text.split("`")[0].strip()[:30] in text
    assert page.locator(".gate-run").count() == len(card.runs)
    for run in card.runs:
        assert page.locator(f'a[href$="{run.name}/summary.json"]').count() == 1
    loaded = images_loaded(page)
    if any(r.gates for r in card.runs):
        assert loaded, "the card's gated-metric charts are missing"
    assert all(width > 100 for _, width in loaded), loaded
    assert errors == []
    page.close()


@pytest.mark.parametrize("name", ["worklog/baselines.html", "worklog/history.html"])
def test_chart_pages_draw_their_images(browser, base_url, shots, name):
    page, errors = open_page(browser, base_url + name)
    page.screenshot(path=str(shots / (Path(name).stem + ".png")), full_page=False)
    loaded = images_loaded(page)
    assert len(loaded) >= 3
    broken = [src for src, width in loaded if width == 0]
    assert broken == []
    assert errors == []
    page.close()


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        for key in ("href", "src"):
            if values.get(key) and tag in {"a", "img", "link", "script"}:
                self.links.append(values[key])


def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser


def test_no_internal_link_is_broken(site_dir):
    pages = sorted(site_dir.rglob("*.html"))
    parsed = {p: _parse(p) for p in pages}
    broken = []
    checked = 0
    for page, links in parsed.items():
        for link in links.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith(("//", "mailto:", "data:")):
                continue
            base = site_dir if parts.path.startswith("/") else page.parent
            target = (base / unquote(parts.path).lstrip("/")).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.is_file():
                broken.append(f"{page.relative_to(site_dir)}: {link}")
            elif parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.relative_to(site_dir)}: {link} (no such anchor)")
    assert checked > 100
    assert broken == []
