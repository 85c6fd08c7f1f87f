# Both targets create .venv and install meshlab into it when missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test clean-venv

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(VPY) scripts/train.py --config default --rules fsdp_tp --cpu-devices 8 $(ARGS)

# Two workers: the suite is compile-bound and single-threaded per test (about 11 min on 2 cores).
test: $(STAMP)
	$(VPY) -m pytest -n 2 $(ARGS)

clean-venv:
	rm -rf $(VENV)
