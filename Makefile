# Two commands for a fresh machine with Python 3.11, pip and make:
#   make demo   creates .venv, installs jaxdit, runs the main job
#   make test   creates .venv, installs jaxdit with its test extra, runs lint and the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo demo-attention test lint format clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 (in the test extra) is the CPU build; a looser pin would pull a CUDA build.
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# The main job: the bundled tiny-digits model draws 0-9 with cfg2 x ring2 x ulysses2 on 8 emulated CPU
# devices, compares with one device, writes outputs/digits.png.
demo: $(VENV)/.installed
	$(VENV)/bin/jaxdit generate --emulate_devices 8 --use_cfg_parallel --ring_degree 2 --ulysses_degree 2 \
		--prompt 0123456789 --compare_single_device --output outputs/digits.png

# USP attention per strategy: max error against unsharded attention, bytes each device sends.
demo-attention: $(VENV)/.installed
	$(PY) scripts/demo_attention.py

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	# Two workers (CI has 2 cores); a test file stays on one worker (its module-level fixtures are shared).
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.installed
	$(PY) -m ruff check .

format: $(VENV)/.installed
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
