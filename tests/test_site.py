"""The course website (`make site`, tools/site.py): built from the stored notebooks, offline and
deterministic; every page, link and image works; every chapter launches in Colab at REPO and offers
its notebook for download; widgets appear as their last picture and readout, never as an empty box.

The browser tests serve the site on a loopback port and load every page in Debian's chromium. A
request to another host is answered with an empty body and recorded, and fails the test: the site
serves everything itself, MathJax (sphinx-mathjax-offline) and the font of its Chinese characters
(tools/cjk_font.py) included, so every formula and every 中文 character renders offline.
"""

from __future__ import annotations

import filecmp
import functools
import http.server
import importlib.util
import re
import shutil
import tempfile
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import nbformat
import pytest
from needs import CHROMIUM, ROOT, browser_missing, load_tool, require

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
CJK = re.compile(r"[\u2e80-\u2fff\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")
FONT = Path("_static") / "fonts" / "kvlab-cjk.woff"
BUILD_LOG: list[str] = []  # what the build said while it ran (make site prints it)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"




site = load_tool("site")
colab = load_tool("colab")
run_notebooks = load_tool("run_notebooks")
NOTEBOOKS, DOCS = site.pages()


def _sphinx_missing() -> str | None:
    for module in ("sphinx", "myst_nb", "sphinx_book_theme", "sphinx-mathjax-offline"):
        if importlib.util.find_spec(module) is None:
            return f"Python package {module} not installed — pip install -e '.[site]'"
    return None


@pytest.fixture(scope="module")
def built() -> Path:
    require(_sphinx_missing(), "website tests")
    out = Path(tempfile.mkdtemp(prefix="kvlab-site-")) / "site"
    site.build(out, log=BUILD_LOG.append)
    yield out
    shutil.rmtree(out.parent, ignore_errors=True)


def _html_pages(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*.html") if "_static" not in p.relative_to(out).parts)


class _Refs(HTMLParser):
    """Links (a, link), sources (img, script) and element ids of one page."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str]] = []
        self.ids: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        for attr in ("href", "src"):
            if a.get(attr) and tag in ("a", "link", "img", "script", "source"):
                self.refs.append((tag, a[attr]))

    def handle_data(self, data):
        self.text.append(data)


@functools.cache
def _parse(path: Path) -> _Refs:
    parser = _Refs()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _page(out: Path, source: Path) -> Path:
    return out / source.with_suffix(".html")


# --- widget outputs become static snapshots (tools/run_notebooks.py) --------------------------------

def _model(name, **state):
    return {"model_name": name, "model_module": "@jupyter-widgets/controls", "model_module_version": "2.0.0",
            "state": state}


def _widget_notebook() -> nbformat.NotebookNode:
    image = {"output_type": "display_data", "metadata": {},
             "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}}
    state = {
        "box": _model("VBoxModel", children=["IPY_MODEL_row", "IPY_MODEL_slider", "IPY_MODEL_plot",
                                             "IPY_MODEL_readout"]),
        "row": _model("HBoxModel", children=["IPY_MODEL_drop", "IPY_MODEL_hidden"]),
        "drop": _model("DropdownModel", description="model", _options_labels=["a-7b", "b-70b"], index=1),
        "hidden": _model("BoundedIntTextModel", description="layers", value=32, layout="IPY_MODEL_gone"),
        "gone": _model("LayoutModel", display="none"),
        "slider": _model("SelectionSliderModel", description="seq len", _options_labels=["1,024", "4,096"],
                         index=0),
        "plot": _model("OutputModel", outputs=[image]),
        "readout": _model("HTMLModel", value="<pre>cache: 2.00 GiB &amp; fits</pre>"),
        "bar": _model("HBoxModel", children=["IPY_MODEL_drop"], layout="IPY_MODEL_invisible"),
        "invisible": _model("LayoutModel", visibility="hidden"),
    }
    view = lambda mid: nbformat.v4.new_output(  # noqa: E731
        "display_data", data={WIDGET_VIEW: {"model_id": mid, "version_major": 2, "version_minor": 0},
                              "text/plain": "VBox(children=(…))"})
    cells = [nbformat.v4.new_code_cell("explorer()", outputs=[view("box")]),
             nbformat.v4.new_code_cell("progress()", outputs=[view("bar")]),
             nbformat.v4.new_code_cell("lost()", outputs=[view("nowhere")]),
             nbformat.v4.new_code_cell("1 + 1", outputs=[nbformat.v4.new_output(
                 "execute_result", data={"text/plain": "2"}, execution_count=1)])]
    saved = {"state": state, "version_major": 2, "version_minor": 0}
    return nbformat.v4.new_notebook(cells=cells, metadata={"widgets": {run_notebooks.WIDGET_STATE: saved}})


def test_a_widget_becomes_its_controls_picture_and_readout_and_the_state_goes():
    nb = _widget_notebook()
    assert run_notebooks.snapshot_widgets(nb) == 3
    assert "widgets" not in nb.metadata
    explorer = nb.cells[0].outputs
    assert [list(o.data) for o in explorer] == [["text/plain", "text/html"], ["image/png", "text/plain"],
                                                ["text/plain", "text/html"]]
    assert explorer[0].data["text/plain"] == f"{run_notebooks.SNAPSHOT_NOTE}\nmodel: b-70b · seq len: 1,024"
    assert "layers" not in explorer[0].data["text/html"]  # a hidden control is not shown
    assert explorer[1].data["image/png"] == "iVBORw0KGgo="
    assert explorer[2].data["text/html"] == "<pre>cache: 2.00 GiB &amp; fits</pre>"
    assert explorer[2].data["text/plain"] == "cache: 2.00 GiB & fits"
    assert nb.cells[1].outputs == []  # a hidden widget (a finished progress bar) shows nothing, as live
    assert "run the notebook" in nb.cells[2].outputs[0].data["text/plain"]  # no state: say so, no empty box
    assert nb.cells[3].outputs[0].data == {"text/plain": "2"}
    nbformat.validate(nb)


def test_snapshots_are_idempotent_and_the_stored_notebooks_convert_fully():
    nb = _widget_notebook()
    run_notebooks.snapshot_widgets(nb)
    again = nbformat.writes(nb)
    assert run_notebooks.snapshot_widgets(nb) == 0 and nbformat.writes(nb) == again
    for path in NOTEBOOKS:
        stored = nbformat.read(ROOT / path, as_version=4)
        run_notebooks.snapshot_widgets(stored)
        left = [o for c in stored.cells if c.cell_type == "code" for o in c.outputs
                if WIDGET_VIEW in o.get("data", {})]
        assert not left and "widgets" not in stored.metadata, path.name


# --- the build ------------------------------------------------------------------------------------

def test_the_site_has_the_readme_as_landing_page_one_page_per_chapter_and_the_guides(built):
    assert NOTEBOOKS, "notebooks/ holds no notebook"
    missing = [p for p in [*NOTEBOOKS, *DOCS] if not _page(built, p).is_file()]
    assert not missing, f"no page for {missing}"
    for name in ("index.html", "search.html", "searchindex.js", ".nojekyll"):
        assert (built / name).is_file(), name
    title = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
    index = _parse(built / "index.html")
    assert title in "".join(index.text)
    linked = {urlparse(href).path for tag, href in index.refs if tag == "a"}
    pages = {p.with_suffix(".html").as_posix() for p in [*NOTEBOOKS, *DOCS]}
    assert pages <= linked, f"the navigation misses {sorted(pages - linked)}"
    assert {"docs/glossary.md", "docs/instructor-guide.md"} <= {p.as_posix() for p in DOCS}


def test_chapter_pages_carry_no_speaker_notes(built):
    """The notes live in the instructor guide and reach only the presenter's decks (make slides)."""
    for path in NOTEBOOKS:
        nb = nbformat.read(ROOT / path, as_version=4)
        assert not any("speaker-notes" in c.metadata.get("tags", []) for c in nb.cells), path
        assert "Speaker notes" not in "".join(_parse(_page(built, path)).text), path


def test_the_build_says_what_it_is_doing(built):
    """Sphinx takes minutes: its progress is passed on, a line a page read and a page written."""
    assert BUILD_LOG[0].startswith("site: staging") and BUILD_LOG[-1].startswith("site: wrote")
    for phase in ("reading sources", "writing output"):
        pages = [ln for ln in BUILD_LOG if ln.startswith(f"site: sphinx: {phase}")]
        assert len(pages) >= len(NOTEBOOKS), f"{phase}: {pages[:3]}"


def test_chapters_come_in_file_order_and_follow_each_other(built):
    for before, after in zip(NOTEBOOKS, NOTEBOOKS[1:], strict=False):
        refs = _parse(_page(built, before)).refs
        assert ("a", after.with_suffix(".html").name) in refs, f"{before.name} has no link to {after.name}"


def test_every_internal_link_and_image_resolves(built):
    broken = []
    for page in _html_pages(built):
        for tag, ref in _parse(page).refs:
            url = urlparse(ref)
            if url.scheme or ref.startswith("//"):
                continue
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(built)}: <{tag}> {ref}"
            if built.resolve() not in target.parents or not target.is_file():
                broken.append(f"{where} (no file)")
            elif url.fragment and target.suffix == ".html" and url.fragment not in _parse(target).ids:
                broken.append(f"{where} (no id {url.fragment!r})")
    assert not broken, "\n".join(broken)


def test_every_chapter_page_launches_colab_at_repo_and_offers_the_notebook(built):
    for nb in NOTEBOOKS:
        refs = {href for tag, href in _parse(_page(built, nb)).refs if tag == "a"}
        url = f"https://colab.research.google.com/github/{colab.REPO}/blob/{colab.BRANCH}/{nb.as_posix()}"
        assert url in refs, f"{nb.name}: no link to {url}"
        download = f"../_sources/{nb.as_posix()}"
        assert download in refs, f"{nb.name}: no download link {download}"
        assert (built / "_sources" / nb).read_bytes() == (ROOT / nb).read_bytes(), "not the stored notebook"
        assert "google.colab" not in _page(built, nb).read_text(encoding="utf-8"), "the set-up cell shows"


def test_links_to_the_site_or_repository_files_stay_inside_the_site_or_go_to_github():
    pages = {"README.md", "docs/glossary.md", "notebooks/06_gpu_decoder.ipynb"}
    text = (f"[g]({colab.site_url('docs/glossary.html#kv-cache')}) [b](../benchmarks/) "
            "[m](../kvlab/cache/base.py) [n](06_gpu_decoder.ipynb) [w](https://example.org/x) [a](#here) "
            f"[r](../README.md#set-up) [i]({colab.site_url()})")
    assert site.rewrite_links(text, "notebooks/06_gpu_decoder.ipynb", pages) == (
        f"[g](../docs/glossary.md#kv-cache) [b]({colab.repo_url('benchmarks/')}) "
        f"[m]({colab.repo_url('kvlab/cache/base.py')}) [n](06_gpu_decoder.ipynb) "
        "[w](https://example.org/x) [a](#here) [r](../index.md#set-up) [i](../index.md)")


def test_mermaid_diagrams_are_folded_source_not_a_script_from_a_cdn(built):
    text = "before\n```mermaid\nflowchart TD\n  A --> B\n```\nafter"
    folded = site.fold_mermaid(text)
    assert "```text\nflowchart TD\n  A --> B\n```" in folded and "```mermaid" not in folded
    assert folded.startswith("before\n<details>") and folded.endswith("</details>\nafter")
    raw = [p.name for p in _html_pages(built) if "highlight-mermaid" in p.read_text(encoding="utf-8")]
    assert not raw, f"mermaid blocks left unfolded in {raw}"


def test_widgets_show_their_last_picture_and_readout_never_an_empty_box(built):
    """Stored widget outputs (or the snapshots tools/run_notebooks.py already made of them) appear as
    the snapshot: the note with the controls' values, the picture, the readout."""
    snapshots, explorers = set(), set()
    for nb_path in NOTEBOOKS:
        html = _page(built, nb_path).read_text(encoding="utf-8")
        assert "Loading widget" not in html and WIDGET_VIEW not in html and "widget-state" not in html
        nb = nbformat.read(ROOT / nb_path, as_version=4)
        if any("_explorer(" in c.source for c in nb.cells if c.cell_type == "code"):
            explorers.add(nb_path.name)
        run_notebooks.snapshot_widgets(nb)
        text = re.sub(r"\s+", " ", "".join(_parse(_page(built, nb_path)).text))
        for cell in (c for c in nb.cells if c.cell_type == "code"):
            data = [o.get("data", {}) for o in cell.get("outputs", [])]
            if not any("kvlab-widget-snapshot" in d.get("text/html", "") for d in data):
                continue
            snapshots.add(nb_path.name)
            for d in data:
                if "text/html" in d:
                    first = re.sub(r"\s+", " ", d["text/plain"].strip().splitlines()[0])
                    assert first in text, f"{nb_path.name}: {first[:60]!r} is not on the page"
            assert html.count("<img") >= sum("image/png" in d for d in data)
    assert explorers <= snapshots, f"explorers stored without their output: {sorted(explorers - snapshots)}"


def test_the_build_is_deterministic(built, tmp_path):
    again = tmp_path / "site"
    site.build(again)
    cmp = filecmp.dircmp(built, again)
    differ: list[str] = []

    def walk(c: filecmp.dircmp, prefix: str) -> None:
        differ.extend(prefix + n for n in c.left_only + c.right_only + c.funny_files)
        _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
        differ.extend(prefix + n for n in mismatch + errors)
        for name, sub in c.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(cmp, "")
    assert not differ, f"two builds differ in {differ[:20]}"


# --- in the browser -------------------------------------------------------------------------------



class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(built):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=built))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser_page(served):
    require(browser_missing(), "website browser tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        log: dict[str, list[str]] = {"errors": [], "external": []}
        page.on("console", lambda m: m.type == "error" and log["errors"].append(m.text))
        page.on("pageerror", lambda e: log["errors"].append(str(e)))

        def route(r):
            if r.request.url.startswith(served):
                r.continue_()
            else:
                log["external"].append(r.request.url)
                r.fulfill(status=200, body="")

        page.route("**/*", route)
        yield page, log
        browser.close()


def test_every_page_loads_without_console_errors_and_shows_its_images(built, served, browser_page):
    page, log = browser_page
    problems = []
    for path in _html_pages(built):
        rel = path.relative_to(built).as_posix()
        log["errors"].clear()
        page.goto(served + rel, wait_until="load")
        broken = page.eval_on_selector_all(
            "img", "els => els.filter(e => !e.complete || e.naturalWidth === 0).map(e => e.src)")
        text = page.inner_text("main") if page.locator("main").count() else ""
        problems += [f"{rel}: console error: {e}" for e in log["errors"]]
        problems += [f"{rel}: image not shown: {src}" for src in broken]
        if rel not in ("genindex.html", "search.html") and len(text) < 200:
            problems.append(f"{rel}: the page shows almost nothing ({len(text)} characters)")
    assert not problems, "\n".join(problems)
    assert not log["external"], f"pages request other hosts: {sorted(set(log['external']))}"


def test_search_finds_the_chapter_on_quantization(served, browser_page):
    page, _ = browser_page
    page.goto(served + "search.html?q=quantization", wait_until="load")
    page.wait_for_selector("#search-results ul.search li", timeout=30_000)
    hits = page.eval_on_selector_all("#search-results ul.search li a", "els => els.map(e => e.href)")
    assert any("05_int8_kv_cache.html" in h for h in hits), hits


# --- formulas and 中文, offline ---------------------------------------------------------------------

_TYPESET = """async () => {
  if (!window.MathJax || !MathJax.startup) return {loaded: false};
  await MathJax.startup.promise;
  const math = [...document.querySelectorAll('main .math')];
  const backslash = String.fromCharCode(92);  // TeX source left on the page: not typeset
  const raw = math.filter(m => !m.querySelector('mjx-container') || m.innerText.includes(backslash));
  return {loaded: true, math: math.length, raw: raw.map(m => m.innerText.slice(0, 60))};
}"""


def test_every_formula_is_typeset_by_the_sites_own_mathjax(built, served, browser_page):
    page, log = browser_page
    with_math = [p for p in _html_pages(built) if 'class="math' in p.read_text(encoding="utf-8")]
    assert any(p.name == "02_kv_cache.html" for p in with_math), "chapter 02's formulas are gone?"
    for path in with_math:
        rel = path.relative_to(built).as_posix()
        scripts = [src for tag, src in _parse(path).refs if tag == "script" and "mathjax" in src.lower()]
        assert scripts and all(not urlparse(s).scheme for s in scripts), f"{rel}: MathJax from {scripts}"
        page.goto(served + rel, wait_until="load")
        state = page.evaluate(_TYPESET)
        assert state["loaded"], f"{rel}: MathJax did not load"
        assert state["math"] and not state["raw"], f"{rel}: formulas left as TeX: {state}"
    assert not log["external"], f"requests to other hosts: {sorted(set(log['external']))}"


def test_the_site_font_has_every_chinese_character_the_site_shows(built):
    from fontTools.ttLib import TTFont

    cmap = TTFont(built / FONT).getBestCmap()
    shown = {ch for page in _html_pages(built) for ch in CJK.findall("".join(_parse(page).text))}
    missing = "".join(sorted(ch for ch in shown if ord(ch) not in cmap))
    assert shown, "no Chinese on the site: the glossary lost its 中文?"
    assert not missing, f"{FONT.name} lacks {missing}: run `python tools/cjk_font.py`"


# Mark the elements on screen whose own text holds CJK characters; count those characters.
_MARK_CJK = r"""() => {
  const cjk = /[\u2e80-\u2fff\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]/g;
  let n = 0;
  for (const el of document.querySelectorAll('main *')) {
    const own = [...el.childNodes].filter(c => c.nodeType === 3).map(c => c.data).join('');
    const count = (own.match(cjk) || []).length;
    if (count && el.getClientRects().length) { el.setAttribute('data-kvlab-cjk', count); n += 1; }
  }
  return n;
}"""

# Draw characters one by one in the site's CJK font and fingerprint each picture: real glyphs differ
# from character to character, tofu (a missing glyph's box) looks the same for all of them.
_PICTURES = """async (chars) => {
  await document.fonts.load('40px "kvlab CJK"', chars.join(''));
  const canvas = document.createElement('canvas');
  canvas.width = canvas.height = 48;
  const ctx = canvas.getContext('2d', {willReadFrequently: true});
  return chars.map(ch => {
    ctx.clearRect(0, 0, 48, 48);
    ctx.font = '40px "kvlab CJK"';
    ctx.fillText(ch, 4, 40);
    const px = ctx.getImageData(0, 0, 48, 48).data;
    let h = 0, ink = 0;
    for (let i = 3; i < px.length; i += 4) { h = (h * 31 + px[i]) | 0; ink += px[i] > 0; }
    return [h, ink];
  });
}"""


def test_chinese_renders_in_the_sites_own_font_as_glyphs_not_tofu(built, served, browser_page):
    """Every CJK character of the glossary is drawn with the site's font (Chrome's own report of the
    fonts that rendered each element), and as glyphs: 30 characters give 30 different pictures,
    where 10 private-use characters (no glyph in any font: tofu) give one."""
    page, log = browser_page
    page.goto(served + "docs/glossary.html", wait_until="load")
    page.evaluate("() => document.fonts.ready.then(() => true)")
    assert page.evaluate(_MARK_CJK) > 10, "the glossary shows too little Chinese to check"
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
    wrong = []
    for node in cdp.send("DOM.querySelectorAll", {"nodeId": root, "selector": "[data-kvlab-cjk]"})["nodeIds"]:
        attrs = cdp.send("DOM.getAttributes", {"nodeId": node})["attributes"]
        count = int(dict(zip(attrs[::2], attrs[1::2], strict=True))["data-kvlab-cjk"])
        fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
        ours = sum(f["glyphCount"] for f in fonts if f["isCustomFont"] and "kvlab CJK" in f["familyName"])
        if ours < count:
            wrong.append(f"{count} CJK characters, {ours} drawn by the site's font: {fonts}")
    cdp.detach()
    assert not wrong, "\n".join(wrong[:5])
    text = page.inner_text("main")
    chars = list(dict.fromkeys(CJK.findall(text)))[:30]
    pictures = page.evaluate(_PICTURES, chars)
    tofu = page.evaluate(_PICTURES, [chr(0xE000 + i) for i in range(10)])
    assert len({tuple(p) for p in tofu}) == 1, "the tofu control should draw one picture for all"
    assert len({tuple(p) for p in pictures}) == len(chars), "some Chinese characters draw the same picture"
    assert all(ink > 40 for _, ink in pictures), "a Chinese character drew (almost) nothing"
    shots = Path(tempfile.mkdtemp(prefix="kvlab-site-screenshots-"))
    page.locator("[data-kvlab-cjk]").first.screenshot(path=shots / "glossary-chinese.png")
    print(f"\nscreenshot of the glossary's Chinese: {shots / 'glossary-chinese.png'}")
    assert not log["external"]


def test_screenshots_of_a_chapter_and_the_chinese_glossary(built, served, browser_page):
    """Screenshots to look at (the path is printed)."""
    page, _ = browser_page
    shots = Path(tempfile.mkdtemp(prefix="kvlab-site-screenshots-"))
    print(f"\nsite screenshots: {shots}")
    chapter = next((p for p in NOTEBOOKS if "03_" in p.name), NOTEBOOKS[0])
    page.goto(urljoin(served, chapter.with_suffix(".html").as_posix()), wait_until="load")
    page.screenshot(path=shots / "chapter.png")
    snapshot = page.locator(".kvlab-widget-snapshot")
    if snapshot.count():
        snapshot.first.scroll_into_view_if_needed()
        page.screenshot(path=shots / "chapter-widget.png")
    page.goto(served + "docs/glossary.html", wait_until="load")
    page.screenshot(path=shots / "glossary.png")
    for shot in ("chapter.png", "glossary.png"):
        assert (shots / shot).stat().st_size > 10_000, f"{shot} is (nearly) blank"
