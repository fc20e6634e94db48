# The README's quick start: `make demo` runs the main job, `make test` runs the whole test suite.
# Both create .venv with the pinned CPU build of PyTorch (a bare `pip install torch` would pull a
# multi-GB CUDA build) and install pipetrain into it in editable mode.

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.pipetrain-installed
TORCH   = torch==2.13.0

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pipetrain schedule --compare gpipe,1f1b,zb-h1,pipedream --stages 4 --microbatches 8 \
		--costs F=1,B=1,W=1 --plot demo-out/compare.png

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) demo-out
