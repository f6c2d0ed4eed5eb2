"""Loaded by every pytest run in this repository, whatever paths it names
(`pytest notebooks/02_kv_cache.ipynb` too): it prepares what the notebooks' stored outputs assume
of the machine."""

from kvlab.course_model import ModelUnavailableError, convert_course_model


def pytest_sessionstart(session):
    """Before the notebooks run (and before pytest-xdist starts its workers), convert the course's real
    model once if this machine has not yet: a first load shows a progress bar that a stored output,
    made with the model cached, does not have. Without the model, its own tests say how to install it."""
    config = session.config
    if hasattr(config, "workerinput") or not (config.getoption("nbval", False)
                                              or config.getoption("nbval_lax", False)):
        return
    try:
        if convert_course_model():
            print("\nconftest: converted the course's real model into its cache (first run only)")
    except ModelUnavailableError:
        pass
