import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it, never called
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s two workers (`--dist loadfile`) take whole files, so a notebook's cells run in
    order in one kernel and a module's fixtures are made once; the browser runs of the explorers,
    the slowest file, are split into one unit a notebook, so both workers share them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndExplorerRuns(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/ui/test_ui_explorers.py::test_explorers_in_jupyterlab["):
                return nodeid
            return super()._split_scope(nodeid)

    return FilesAndExplorerRuns(config, log)
