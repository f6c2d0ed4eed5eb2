"""Build the course website into _build/site/ (`make site`): offline, deterministic, no execution.

    python tools/site.py [--out DIR]

It stages the sources in a temporary folder and runs Sphinx with site/conf.py on them. It only ever
replaces a folder it built itself (marked with a `.kvlab-site` file): an existing folder without the
marker, the repository or any folder of its sources is refused, and nothing is deleted.
- index: the README, with the navigation (every notebook present in notebooks/, in file order,
  then the docs pages that exist);
- one page per notebook, rendered from its stored outputs, widget outputs turned into static
  snapshots (tools/run_notebooks.py), the Colab launch and download buttons of the theme (the
  Colab set-up cell is left out of the page);
- docs/*.md (instructor guide, glossary, references, architecture, then any other).
Links are made to work on the site: a link to the site itself (colab.site_url) becomes a relative
one, so the build checks it; a relative link to a repository file that is not a page (a module, a
results folder) points to the repository on GitHub (colab.repo_url). The downloadable notebook is
the stored one, unchanged.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import colab  # noqa: E402
from run_notebooks import snapshot_widgets  # noqa: E402
from slides import NOTES_TAG  # noqa: E402

DOCS_ORDER = ["instructor-guide", "glossary", "references", "architecture", "style"]
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "images/open-in-colab.svg"  # site/open-in-colab.svg: the site loads nothing from Colab
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
MERMAID = re.compile(r"^```mermaid\n(.*?)^```[ \t]*$", flags=re.M | re.S)


def fold_mermaid(text: str) -> str:
    """GitHub draws ```mermaid blocks; drawing them here would need mermaid.js from a CDN. The site
    shows their source, folded (the pages that use one also draw the diagram in text)."""
    return MERMAID.sub(lambda m: "<details><summary>Diagram source (Mermaid; GitHub draws it)</summary>\n\n"
                       f"```text\n{m.group(1)}```\n\n</details>", text)


def pages(root: Path = ROOT) -> tuple[list[Path], list[Path]]:
    """The notebooks and docs pages the site holds, in navigation order (paths relative to root)."""
    notebooks = sorted(p.relative_to(root) for p in (root / "notebooks").glob("*.ipynb"))
    rank = {stem: i for i, stem in enumerate(DOCS_ORDER)}
    docs = sorted((root / "docs").glob("*.md"), key=lambda p: (rank.get(p.stem, len(rank)), p.stem))
    return notebooks, [p.relative_to(root) for p in docs]


def rewrite_links(text: str, page: str, site_pages: set[str], root: Path = ROOT) -> str:
    """Rewrite the markdown links of `text`, which lies at `page` (repository path) on the site."""
    here = posixpath.dirname(page)
    site = colab.site_url()

    def target(match: re.Match) -> str:
        url = match.group(2)
        if url.startswith(site):  # the site itself: a relative link to the page's source
            path, _, anchor = url[len(site):].partition("#")
            source = _source_of(path or "index.html", site_pages)
            if source is None:
                return match.group(0)  # left as it is: the link check reports it
            new = posixpath.relpath(source, here or ".") + (f"#{anchor}" if anchor else "")
        elif re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", url):
            return match.group(0)
        else:  # relative: a page of the site stays, another repository file goes to GitHub
            path, _, anchor = url.partition("#")
            repo_path = posixpath.normpath(posixpath.join(here, path))
            if repo_path == "README.md":  # the README is the site's index page
                new = posixpath.relpath("index.md", here or ".")
            elif repo_path in site_pages or not (root / repo_path).exists():
                return match.group(0)
            else:
                new = colab.repo_url(repo_path + ("/" if (root / repo_path).is_dir() else ""))
            new += f"#{anchor}" if anchor else ""
        return match.group(1) + new + match.group(3)

    return LINK.sub(target, text)


def _source_of(path: str, site_pages: set[str]) -> str | None:
    path = "index.html" if path.endswith("/") or not path else path
    stem = path[: -len(".html")] if path.endswith(".html") else path
    if stem == "index":
        return "index.md"
    for suffix in (".ipynb", ".md"):
        if stem + suffix in site_pages:
            return stem + suffix
    return None


def index_page(readme: str, notebooks: list[Path], docs: list[Path]) -> str:
    """The landing page: the README, then the (hidden) navigation trees."""
    def tree(caption: str, paths: list[Path]) -> str:
        entries = "\n".join(p.with_suffix("").as_posix() for p in paths)
        return f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{entries}\n```\n"

    return readme.rstrip() + "\n" + tree("Chapters", notebooks) + (tree("Guides", docs) if docs else "")


def stage(src: Path, root: Path = ROOT) -> None:
    """Write the site's sources into src, a folder that must not exist yet (nothing is replaced)."""
    notebooks, docs = pages(root)
    site_pages = {"README.md", *(p.as_posix() for p in notebooks + docs)}
    src.mkdir(parents=True)
    (src / "notebooks").mkdir()
    (src / "docs").mkdir()
    (src / LOCAL_BADGE).parent.mkdir()
    shutil.copyfile(root / "site" / "open-in-colab.svg", src / LOCAL_BADGE)
    readme = rewrite_links((root / "README.md").read_text(encoding="utf-8"), "README.md", site_pages, root)
    readme = fold_mermaid(readme.replace(BADGE_IMAGE, LOCAL_BADGE))
    (src / "index.md").write_text(index_page(readme, notebooks, docs), encoding="utf-8")
    for path in docs:
        text = (root / path).read_text(encoding="utf-8")
        text = fold_mermaid(rewrite_links(text, path.as_posix(), site_pages, root))
        (src / path).write_text(text, encoding="utf-8")
    for path in notebooks:
        nb = nbformat.read(root / path, as_version=4)
        snapshot_widgets(nb)
        for cell in nb.cells:
            tags = cell.metadata.get("tags", [])
            if colab.SETUP_TAG in tags or NOTES_TAG in tags:  # Colab installs, speaker notes: not for a page
                cell.metadata["tags"] = [*tags, "remove-cell"]
            if cell.cell_type == "markdown":
                cell.source = fold_mermaid(rewrite_links(cell.source, path.as_posix(), site_pages, root)
                                           .replace(BADGE_IMAGE, posixpath.relpath(LOCAL_BADGE, "notebooks")))
        nbformat.write(nb, src / path)


MARKER = ".kvlab-site"  # written into every folder this tool builds: only such a folder is replaced


class UnsafeOutputError(ValueError):
    """The output folder holds something this tool did not build: it is never deleted."""


def check_output(out: Path, root: Path = ROOT) -> None:
    """Refuse an output folder that is, holds or lies inside something this tool must not replace:
    the repository (or a folder above it), a folder of the repository's own sources, or any existing
    non-empty folder without the marker of an earlier site build."""
    out, root = out.resolve(), root.resolve()
    if out == root or root.is_relative_to(out):
        raise UnsafeOutputError(f"--out {out} is or contains the repository {root}; the site is "
                                "built into a folder of its own (default: _build/site)")
    if out.is_relative_to(root) and out.relative_to(root).parts[0] not in ("_build", "build"):
        raise UnsafeOutputError(f"--out {out} lies among the repository's own files; build into "
                                f"{root / '_build' / 'site'} (the default) or outside the repository")
    if out.exists() and not out.is_dir():
        raise UnsafeOutputError(f"--out {out} is a file, not a folder; nothing was changed")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise UnsafeOutputError(f"--out {out} already holds files that no earlier `make site` wrote "
                                f"(it has no {MARKER} marker); nothing was deleted: choose an empty or "
                                "new folder")


def build(out: Path, root: Path = ROOT, log=None) -> Path:
    """Stage the sources and build the HTML site into out; return out/index.html.

    out must be new, empty, or an earlier build of this tool (`check_output`): only then is it
    replaced. The staged sources and Sphinx's caches go to a temporary folder, removed afterwards."""
    out = Path(out).resolve()
    check_output(out, root)
    say = log or (lambda _msg: None)
    with tempfile.TemporaryDirectory(prefix="kvlab-site-") as tmp:
        work, doctrees, fresh = Path(tmp) / "src", Path(tmp) / "doctrees", Path(tmp) / "html"
        say(f"site: staging {len(pages(root)[0])} notebooks and the docs pages")
        stage(work, root)
        cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-W", "--keep-going",
               "-c", str(root / "site"), "-d", str(doctrees), str(work), str(fresh)]
        env = {**os.environ, "PYTHONHASHSEED": "0", "SOURCE_DATE_EPOCH": "0", "NO_COLOR": "1"}
        say("site: running Sphinx (a few minutes on two cores); its progress follows")
        lines = []
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, bufsize=1) as sphinx:
            for line in sphinx.stdout:  # one line a page read or written: the build says where it is
                lines.append(line)
                if line.strip():
                    say(f"site: sphinx: {line.rstrip()}")
        if sphinx.returncode != 0:
            raise RuntimeError(f"sphinx-build failed ({sphinx.returncode}):\n{''.join(lines)}")
        notebooks, _ = pages(root)
        for path in notebooks:  # the download button gives the notebook as stored in the repository
            shutil.copyfile(root / path, fresh / "_sources" / path)
        (fresh / ".nojekyll").write_text("")
        (fresh / MARKER).write_text("built by tools/site.py; `make site` replaces this folder\n")
        if out.exists():  # an earlier build (checked above): replaced only once the new one is whole
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(fresh, out)
    say(f"site: wrote {out} ({sum(1 for _ in out.rglob('*.html'))} HTML pages)")
    return out / "index.html"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "_build" / "site"), help="output folder")
    args = parser.parse_args(argv)
    try:
        index = build(Path(args.out), log=lambda msg: print(msg, flush=True))
    except UnsafeOutputError as err:
        raise SystemExit(f"site: refused: {err}") from None
    print(f"site: open {index}")


if __name__ == "__main__":
    main()
