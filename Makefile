# Two commands for learners (`make lab`, `make test`); the rest are for instructors and maintainers.
# Everything runs inside .venv, created here from python3 (3.11+). No model or dataset is downloaded.

PYTHON ?= python3
VENV   := .venv
BIN    := $(abspath $(VENV))/bin
STAMP  := $(VENV)/.installed-stamp
MODEL  := course_lib/assets/tiny-distilbert/model.safetensors
PORT   ?= 8888
# The venv's bin/ first on PATH: nbgrader shells out to `alembic`, notebooks to `jupyter`.
RUN    := PATH="$(BIN):$$PATH"
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ASSIGNMENTS := $(notdir $(wildcard solutions/*))

.PHONY: setup assets lab lab-headless test lint format release check bench clean

setup: $(STAMP) assets

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed, found " + sys.version.split()[0]'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The embedded checkpoint is committed; this rebuilds it only if it is missing (about 17 minutes on 2 CPU cores).
assets: $(MODEL)
$(MODEL): | $(STAMP)
	$(BIN)/python -m course_lib.build_assets

# Jupyter refuses to run as root (containers) without --allow-root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup
	$(RUN) jupyter lab --notebook-dir=. $(ROOT_FLAG) $(LAB_FLAGS)

# Headless (a server, a container, a remote machine): prints the URL with its token.
lab-headless: LAB_FLAGS = --no-browser --ip=127.0.0.1 --port=$(PORT)
lab-headless: lab

test: setup
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) $(OFFLINE) python -m pytest $(PYTEST_ARGS)

lint:
	$(RUN) ruff check . && $(RUN) ruff format --check .

format:
	$(RUN) ruff check --fix . && $(RUN) ruff format .

# Regenerate the student release exercises/ from solutions/ (committed; CI checks it for drift).
release: setup
	$(RUN) python -m course_lib.release

# A learner checks an exercise without changing it: make check NB=exercises/01_device_placement/01_device_placement.ipynb
check: setup
	@test -n "$(NB)" || (echo "Usage: make check NB=exercises/<assignment>/<notebook>.ipynb" && exit 2)
	$(RUN) $(OFFLINE) python -m course_lib.check "$(NB)"

bench: setup
	$(RUN) python -m course_lib.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
