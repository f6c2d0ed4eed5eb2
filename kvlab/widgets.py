"""Interactive explorers: core ipywidgets + `interactive_output` + inline matplotlib.

Each explorer is a thin shell around an ordinary drawing function (in this module) that the
notebooks also call directly, so nbval tests what the widget shows.
"""

from __future__ import annotations
