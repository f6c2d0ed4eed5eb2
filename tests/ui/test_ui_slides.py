"""Every chapter presented as slides, the way an instructor shows it: JupyterLab RISE in Chromium at 1280×800.

For each chapter, open its deck (the notebook with the instructor guide's speaker notes, as `make slides`
writes it into slides/) at `/rise/slides/<notebook>` (stored outputs, no cell is run), walk every slide
and sub-slide through reveal.js's own API, and measure each slide's content (the section's scrollHeight)
against the slide height: reveal's computed slide height (720 px here: RISE sizes slides to the window),
at most reveal's 700-px design height. A slide taller than that shows content nobody in the room sees.
The test fails listing every such slide (with its cells' heights), on a chapter that presents as fewer
than two slides, and when the deck has no speaker notes or its notes cells do not reach the slides'
speaker view.

Chapter 03's deck is also presented live: after "Run All" in JupyterLab (how the instructor guide says to
prepare), its memory explorer's cell is re-run from the slide view with Shift+Enter. The explorer must
then render as a widget, answer a slider drag with a new plot, and still fit its slide. (That needs the
`lab` extra's jupyterlab_widgets 3.0.10: jupyterlab_rise 0.43 cannot load newer widget managers,
jupyterlab-contrib/rise#119, and the explorer then shows as text.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from needs import load_tool
from uihelpers import NOTEBOOKS, cells, error_report, open_notebook, run_all

pytestmark = pytest.mark.ui

VIEWPORT = {"width": 1280, "height": 800}  # a common projector resolution
DESIGN_HEIGHT_PX = 700  # reveal.js's design height; RISE scales slides to the window instead
OPEN_TIMEOUT_MS = 120_000
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")) if NOTEBOOKS.is_dir() else []
CHAPTER_PARAMS = [pytest.param(p, id=p.stem) for p in CHAPTERS] or [pytest.param(
    None, id="none", marks=pytest.mark.skip(reason=f"no chapter notebook in {NOTEBOOKS}"))]
LIVE_CHAPTER = "03_cache_memory.ipynb"
DECKS = "slides"  # where `make slides` writes the decks, here inside the test server's root

# RISE does not expose reveal.js as a global: find its module among the page's loaded webpack modules
# (the object with reveal's API), and keep it as window.__kvlabReveal.
_FIND_REVEAL = """() => {
  if (window.__kvlabReveal) return true;
  for (const key of Object.keys(window).filter(k => /^(webpack|rspack)Chunk/.test(k))) {
    let require = null;
    try { window[key].push([[Symbol('kvlab')], {}, r => { require = r; }]); } catch (e) { continue; }
    for (const mod of Object.values((require && require.c) || {})) {
      try {
        for (const api of [mod.exports, mod.exports && mod.exports.default]) {
          if (api && typeof api.getTotalSlides === 'function' && api.isReady && api.isReady()) {
            window.__kvlabReveal = api;
            return true;
          }
        }
      } catch (e) { /* a module still initialising */ }
    }
  }
  return false;
}"""

# Walk every slide (h, v) and measure it once it is shown and its images have loaded.
_MEASURE = """async () => {
  const R = window.__kvlabReveal;
  const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const slides = [];
  const cells = [...document.querySelectorAll('.jp-Cell')];
  R.getHorizontalSlides().forEach((stack, h) => {
    const verticals = stack.querySelectorAll(':scope > section');
    (verticals.length ? [...verticals] : [stack]).forEach((_, v) => slides.push([h, v]));
  });
  const out = [];
  for (const [h, v] of slides) {
    R.slide(h, v);
    await frame();
    const section = R.getCurrentSlide();
    await Promise.all([...section.querySelectorAll('img')].map(img => img.complete ? null :
      new Promise(r => { img.onload = img.onerror = r; setTimeout(r, 5000); })));
    await frame();
    const visible = [...section.querySelectorAll('.jp-Cell')].filter(c => !c.closest('aside.notes')
                                                                         && c.offsetParent !== null);
    out.push({h, v, height: section.scrollHeight,
              title: (section.innerText || '').replace(/\\[\\s*\\d*\\s*\\]:/g, '').trim()
                     .split('\\n')[0].slice(0, 70),
              cells: visible.map(c => ({index: cells.indexOf(c), height: c.offsetHeight}))});
  }
  const notes = [...document.querySelectorAll('.reveal section > aside.notes')]
    .filter(a => /Speaker notes/.test(a.textContent)).length;
  return {slides: out, total: R.getTotalSlides(), size: R.getComputedSlideSize(),
          design: R.getConfig().height, notes};
}"""


def slide_limit(report: dict) -> int:
    """The height a slide's content may take: reveal's computed slide height, at most 700 px."""
    return min(int(report["size"]["height"]), DESIGN_HEIGHT_PX)


def open_slides(page, url: str, name: str) -> None:
    page.goto(f"{url}/rise/{name}")
    page.wait_for_selector(".reveal.ready section.present", timeout=OPEN_TIMEOUT_MS)
    page.wait_for_function(_FIND_REVEAL, timeout=OPEN_TIMEOUT_MS, polling=250)
    # no slide transitions: a slide is in place (to measure, to click) as soon as it is shown
    page.evaluate("() => window.__kvlabReveal.configure({transition: 'none', backgroundTransition: 'none'})")


def measure(page) -> dict:
    return page.evaluate(_MEASURE)


@pytest.fixture(scope="module")
def decks(lab_server) -> Path:
    """The decks of every chapter, written by tools/slides.py into the server's root."""
    out = lab_server.root / DECKS
    load_tool("slides").write_decks(CHAPTERS, out, log=lambda _msg: None)
    return out


@pytest.fixture(scope="module")
def slide_page(browser, lab_server, decks):
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    yield page
    context.close()


def overflowing(name: str, report: dict) -> list[str]:
    """Slides of several cells taller than the screen: the tool should have split them. A slide of a
    single taller cell cannot be split at a cell boundary; the deck scrolls it (checked below)."""
    limit = slide_limit(report)
    def cells(slide: dict) -> str:
        return ", ".join(f"cell {c['index']}: {c['height']} px" for c in slide["cells"])
    return [f"{name} slide {s['h']}.{s['v']}: {s['height']} px > {limit} px ({cells(s)}; {s['title']!r})"
            for s in report["slides"] if s["height"] > limit and len(s["cells"]) > 1]


def scrolled(report: dict) -> list[dict]:
    limit = slide_limit(report)
    return [s for s in report["slides"] if s["height"] > limit and len(s["cells"]) == 1]


@pytest.mark.parametrize("path", CHAPTER_PARAMS)
def test_every_slide_fits_the_screen(path: Path, slide_page, lab_server, decks):
    open_slides(slide_page, lab_server.url, f"{DECKS}/{path.name}")
    try:
        report = measure(slide_page)
    finally:
        lab_server.shut_down_kernels()
    heights = [s["height"] for s in report["slides"]]
    print(f"\n{path.name}: {len(heights)} slides, limit {slide_limit(report)} px, "
          f"{len(overflowing(path.name, report))} overflow, tallest {max(heights, default=0)} px")
    assert report["total"] >= 2, f"{path.name} presents as {report['total']} slide(s): no slide structure"
    assert report["total"] == len(report["slides"])
    notes_cells = sum("speaker-notes" in c.get("metadata", {}).get("tags", [])
                      for c in json.loads((decks / path.name).read_text(encoding="utf-8"))["cells"])
    assert notes_cells, f"the deck of {path.name} has no speaker notes"
    assert report["notes"] == notes_cells, (f"{notes_cells} speaker-notes cells in the deck of {path.name}, "
                                            f"but {report['notes']} reach the slides' speaker view")
    too_tall = overflowing(path.name, report)
    if scrolled(report):  # one tall cell on its own slide: the deck must scroll it
        deck_meta = json.loads((decks / path.name).read_text(encoding="utf-8"))["metadata"]
        assert deck_meta.get("rise", {}).get("scroll") is True, f"{path.name}: tall slides, no scroll"
        print(f"{path.name}: {len(scrolled(report))} slide(s) of one tall cell, scrolled")
    assert not too_tall, "slides taller than the screen:\n" + "\n".join(too_tall)


@pytest.fixture(scope="module")
def live_slides(browser, lab_server, decks):
    """Chapter 03's deck prepared as the instructor guide says (Run All in JupyterLab), then opened as
    slides in the same browser: the slide view shares the notebook's kernel."""
    path = decks / LIVE_CHAPTER
    if not path.is_file():
        pytest.fail(f"{path} is missing: the live slide tests use chapter 03")
    context = browser.new_context(viewport=VIEWPORT)
    try:
        lab = context.new_page()
        open_notebook(lab, f"{lab_server.url}/lab/tree/{DECKS}/{LIVE_CHAPTER}")
        run_all(lab)
        problems = error_report(cells(lab))
        if problems:
            pytest.fail(f"Run All of {LIVE_CHAPTER} failed before presenting:\n" + "\n".join(problems))
        page = context.new_page()
        open_slides(page, lab_server.url, f"{DECKS}/{LIVE_CHAPTER}")
        yield page
    finally:
        context.close()
        lab_server.shut_down_kernels()


_SHOW_SLIDE_OF = """(node) => {
  const R = window.__kvlabReveal, i = R.getIndices(node.closest('section'));
  R.slide(i.h, i.v);
}"""


def _run_explorer_cell(page):
    """Show the slide with the memory explorer's cell, run it with Shift+Enter as a presenter does,
    and wait until its new output arrived. Returns the cell's locator."""
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text="memory_explorer(")).first
    cell.evaluate(_SHOW_SLIDE_OF)
    prompt = cell.locator(".jp-InputArea-prompt")
    before = prompt.inner_text()
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Escape")  # command mode: there Shift+Enter is RISE's "run and advance"
    page.keyboard.press("Shift+Enter")
    page.wait_for_function("""([node, before]) => {
      const p = node.querySelector('.jp-InputArea-prompt').textContent;
      return /\\d/.test(p) && p !== before && node.querySelector('.jp-OutputArea-output');
    }""", arg=[cell.element_handle(), before], timeout=120_000, polling=250)
    cell.evaluate(_SHOW_SLIDE_OF)  # "run and advance" moved on: come back to the cell's slide
    return cell


def test_a_cell_runs_again_from_the_slide_view(live_slides):
    """Shift+Enter on a slide re-runs the cell in the notebook's kernel (no error, a new count)."""
    cell = _run_explorer_cell(live_slides)
    errors = cell.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    assert errors.count() == 0, errors.first.inner_text()[-1500:]


def test_the_explorer_answers_in_the_slide_view(live_slides, screenshot_dir):
    """The explorer re-run on its slide renders as a widget, a slider drag redraws its plot, and the
    slide with the live explorer still fits the screen."""
    page = live_slides
    cell = _run_explorer_cell(page)
    slider = cell.locator(".widget-slider").first
    try:
        slider.wait_for(timeout=15_000)
    except Exception as err:  # e.g. a newer jupyterlab_widgets than the `lab` extra pins
        shown = cell.locator(".jp-OutputArea").inner_text()[:300]
        pytest.fail(f"the explorer shows no slider on its slide; the output shows: {shown!r}\n{err}")
    cell.locator(".widget-output img").first.wait_for(timeout=60_000)
    image = cell.evaluate("n => n.querySelector('.widget-output img').src")
    page.screenshot(path=screenshot_dir / "slides-03-explorer-before.png")
    box, track = slider.locator(".noUi-handle").bounding_box(), slider.locator(".noUi-base").bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(track["x"] + 0.9 * track["width"], box["y"] + box["height"] / 2, steps=10)
    page.mouse.up()
    page.wait_for_function("""([node, before]) => {
      const img = node.querySelector('.widget-output img');
      return img && img.src !== before;
    }""", arg=[cell.element_handle(), image], timeout=120_000, polling=250)
    page.screenshot(path=screenshot_dir / "slides-03-explorer-after.png")
    height = cell.evaluate("n => n.closest('section').scrollHeight")
    limit = min(page.evaluate("() => window.__kvlabReveal.getComputedSlideSize().height"), DESIGN_HEIGHT_PX)
    assert height <= limit, f"the slide with the live explorer is {height} px tall, more than {limit} px"
