# The README's quick start: `make demo` runs the main job, `make test` runs the whole test suite.
# Both create .venv with PyTorch pinned to 2.13.0 and install pipetrain into it in editable mode.
# Where torch comes from: on the project's machines and in its CI, pip's configuration points at a
# local copy of the CPU wheel, which `pip install torch==2.13.0` takes. Elsewhere PyPI's Linux wheel
# of that version is a CUDA build of several GB; for the CPU build from PyTorch's own index, run
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (a bare `pip install torch`, or a range that admits a newer release, would pull the CUDA build).

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.pipetrain-installed
TORCH   = torch==2.13.0
TORCH_INDEX ?=

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The main job: train an MLP on scikit-learn's digits with 2 local worker processes on the
# asynchronous PipeDream schedule, report test accuracy and samples/s, and draw the measured
# timeline next to the simulated one; then draw the schedules side by side.
demo: $(STAMP)
	$(VENV)/bin/pipetrain train --schedule pipedream --stages 2 --model mlp:depth=2,width=128 --data digits \
		--epochs 10 --batch-size 32 --optimizer sgd:lr=0.02,momentum=0.9 --eval-every 90 \
		--calibrate --costs-file demo-out/calibration.json --plot demo-out/timeline.png --report-json demo-out/report.json
	$(VENV)/bin/pipetrain schedule --compare gpipe,1f1b,zb-h1,pipedream --stages 4 --microbatches 8 --steps 2 \
		--costs F=1,B=1,W=1 --plot demo-out/compare.png

# ruff with the rule set of pyproject.toml; CI runs it before the tests
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) demo-out
