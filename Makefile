# Every target creates .venv and installs meshlab into it when missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test lint notebooks clean-venv

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(VPY) scripts/train.py --config default --rules fsdp_tp --cpu-devices 8 $(ARGS)

# Two workers: the suite is compile-bound and single-threaded per test; --durations names the slow ones.
test: $(STAMP)
	$(VPY) -m pytest -n 2 --dist loadgroup --durations=15 $(ARGS)

# ruff, configured in pyproject.toml (pyflakes + pycodestyle, line length 140).
lint: $(STAMP)
	$(VPY) -m ruff check .

# The notebooks' extra (Jupyter, nbclient) on top of the dev install, installed once.
NB_STAMP := $(VENV)/.notebooks-installed
$(NB_STAMP): $(STAMP)
	$(VPY) -m pip install -q -e '.[dev,notebooks]'
	touch $(NB_STAMP)

# Executes every notebook top to bottom (ARGS: names, e.g. ARGS=03_flash); outputs are not written back.
notebooks: $(NB_STAMP)
	$(VPY) notebooks/run.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
