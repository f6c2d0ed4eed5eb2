"""Sphinx configuration of the course website (`make site`; tools/site.py stages the sources).

Sphinx + myst-nb + sphinx-book-theme (what Jupyter Book 1 is built on, used directly): they build
offline from the notebooks as stored (no execution) and give navigation, search, a Colab launch
button and a notebook download button on every chapter page. The repository comes from REPO in
tools/colab.py, like the notebooks' Colab badges.
"""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "kvlab_tools_colab", Path(__file__).resolve().parents[1] / "tools" / "colab.py")
colab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(colab)

project = "kvlab"
author = "the kvlab authors"
copyright = "the kvlab authors"  # no year: the build must not depend on the date
html_title = "kvlab: the KV cache course"
root_doc = "index"
language = "en"

# sphinx-mathjax-offline ships MathJax 3 and serves it from _static/mathjax: formulas render offline and
# the site loads nothing from another host (a CDN's MathJax would leave raw TeX on an offline reader).
extensions = ["myst_nb", "sphinx-mathjax-offline"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = ["myst.header"]  # chapters may step from # to ### on purpose

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3  # links to #a-section work as in JupyterLab and on GitHub

nb_execution_mode = "off"  # render the stored outputs; never run a notebook here
nb_ipywidgets_js = {}  # widgets are stored as static snapshots (tools/run_notebooks.py): no widget JS
nb_merge_streams = True

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["kvlab.css"]
html_sourcelink_suffix = ""  # _sources/notebooks/NN.ipynb is the notebook itself (tools/site.py)
html_last_updated_fmt = None
html_theme_options = {
    "repository_url": colab.repo_url(),
    "repository_branch": colab.BRANCH,
    "path_to_docs": "",
    "use_repository_button": True,
    "use_download_button": True,
    "launch_buttons": {"colab_url": "https://colab.research.google.com"},
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_context = {"default_mode": "auto"}  # the theme's default ("") logs a console error on first load
