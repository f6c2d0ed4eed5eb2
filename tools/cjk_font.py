"""The website's Chinese font: the characters the course uses, cut from Noto Sans CJK SC.

    python tools/cjk_font.py [--source PATH/NotoSansCJK-Regular.ttc]

The site (`make site`) shows every Chinese character (中文) with this font, which it serves itself
(site/_static/fonts/kvlab-cjk.woff, about 60 KB): a reader needs no CJK font of their own and the
site loads nothing from another host. The file holds only the CJK characters found in README.md,
docs/*.md and the notebooks (their text and stored outputs). Run this tool again after adding
Chinese text with a new character: tests/test_site.py names every character on the site the font
lacks. The source is the Debian package fonts-noto-cjk (`apt-get install fonts-noto-cjk`; Noto is
under the SIL Open Font License 1.1, site/_static/fonts/OFL.txt), read with fontTools (a matplotlib
dependency).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")  # Debian: fonts-noto-cjk
FACE = "Noto Sans CJK SC"  # the Simplified Chinese face of the collection
OUT = ROOT / "site" / "_static" / "fonts" / "kvlab-cjk.woff"
FAMILY = "kvlab CJK"  # the name kvlab.css gives it; the file's own name says what it is cut from
# CJK radicals and punctuation, ideographs (and extension A), compatibility ideographs, full-width
# forms: the characters kvlab.css's @font-face takes from this font (its unicode-range).
CJK = re.compile(r"[\u2e80-\u2fff\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")


def characters(root: Path = ROOT) -> set[str]:
    """Every CJK character of the site's sources (notebook JSON keeps them unescaped)."""
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted((root / "notebooks").glob("*.ipynb"))]
    return {ch for p in paths for ch in CJK.findall(p.read_text(encoding="utf-8"))}


def build(source: Path = SOURCE, out: Path = OUT, chars: set[str] | None = None) -> int:
    """Write the subset of source's FACE that covers chars into out (WOFF); return its glyph count."""
    from fontTools import subset
    from fontTools.ttLib import TTCollection

    if not source.is_file():
        raise SystemExit(f"{source} not found: install Debian's fonts-noto-cjk "
                         "(apt-get install fonts-noto-cjk) or pass --source")
    chars = characters() if chars is None else chars
    fonts = TTCollection(str(source)).fonts
    font = next((f for f in fonts if f["name"].getDebugName(1) == FACE), None)
    if font is None:
        raise SystemExit(f"{source} has no face {FACE!r}")
    options = subset.Options()
    options.flavor = "woff"       # zlib-compressed: every browser reads it, no brotli needed
    options.hinting = False
    options.name_IDs = ["*"]
    subsetter = subset.Subsetter(options)
    subsetter.populate(unicodes=sorted(map(ord, chars)))
    subsetter.subset(font)
    for record in font["name"].names:
        if record.nameID in (1, 4, 16):  # family, full name, typographic family
            record.string = f"{FAMILY} (subset of {FACE})"
    font.recalcTimestamp = False  # the same characters give the same file
    out.parent.mkdir(parents=True, exist_ok=True)
    font.flavor = "woff"
    font.save(str(out))
    return len(font.getGlyphOrder())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help=f"default: {SOURCE}")
    args = parser.parse_args(argv)
    chars = characters()
    glyphs = build(args.source, OUT, chars)
    print(f"cjk_font: wrote {OUT.relative_to(ROOT)}: {len(chars)} characters, {glyphs} glyphs, "
          f"{OUT.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
