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

.PHONY: setup assets lab lab-headless test test-fast lint format release check bench mutation clean

setup: $(STAMP) assets

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed, found " + sys.version.split()[0]'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The embedded checkpoint is committed; this rebuilds it only if it is missing (about 17 minutes on 2 CPU cores).
assets: $(MODEL)
$(MODEL): | $(STAMP)
	$(BIN)/python -m course_tools.build_assets

# Jupyter refuses to run as root (containers) without --allow-root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

# The course's JupyterLab settings, jupyter/ (no "Jupyter news" pop-up, no nbgrader Assignment List for
# self-paced learners), ahead of other JUPYTER_CONFIG_PATH folders; ~/.jupyter still has the last word.
LAB_CONFIG := JUPYTER_CONFIG_PATH="$(CURDIR)/jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}"
# The embedded model and dataset need no network: the Hugging Face libraries stay offline unless
# COURSE_MODEL or COURSE_DATASET names something other than "embedded" (course_lib/config.py).
LAB_OFFLINE = $(if $(filter-out embedded,$(strip $(COURSE_MODEL) $(COURSE_DATASET))),,$(OFFLINE))

lab: setup
	$(RUN) $(LAB_CONFIG) $(LAB_OFFLINE) jupyter lab --notebook-dir=. $(ROOT_FLAG) $(LAB_FLAGS)

# Headless (a server, a container, a remote machine): prints the URL with its token.
lab-headless: LAB_FLAGS = --no-browser --ip=127.0.0.1 --port=$(PORT)
lab-headless: lab

test: setup
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) $(OFFLINE) python -m pytest $(PYTEST_ARGS)

# The fast tier while developing (about 1½ minutes on 2 cores): unit tests and quick notebook checks, without the slow
# tier (@pytest.mark.slow and conftest.py's SLOW_PATHS). `make test` remains the full suite.
test-fast: setup
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) $(OFFLINE) python -m pytest -m "not slow" $(PYTEST_ARGS)

lint:
	$(RUN) ruff check . && $(RUN) ruff format --check .

format:
	$(RUN) ruff check --fix . && $(RUN) ruff format .

# Regenerate the student release exercises/ from solutions/ (committed; CI checks it for drift).
release: setup
	$(RUN) python -m course_tools.release

# A learner checks an exercise without changing it: make check NB=exercises/01_device_placement/01_device_placement.ipynb
check: setup
	@test -n "$(NB)" || (echo "Usage: make check NB=exercises/<assignment>/<notebook>.ipynb" && exit 2)
	$(RUN) $(OFFLINE) python -m course_lib.cli.check "$(NB)"

bench: setup
	$(RUN) python -m course_lib.cli.bench $(BENCH_ARGS)

# The course as a static site, built offline into build/site/html/ from the committed lessons (not executed),
# the student release exercises/ and docs/*.md (course_tools/site.py, mkdocs.yml; about 10 s). Its search needs
# a web server, not file://: python3 -m http.server -d build/site/html
.PHONY: site screenshot
SITE_STAMP := $(VENV)/.site-stamp
$(SITE_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,site]'
	touch $@

site: $(SITE_STAMP)
	$(RUN) $(OFFLINE) python -m course_tools.site build

# The README's picture, docs/img/$(SCREENSHOT_NAME): a lesson with its committed plots in JupyterLab, opened (not run)
# in the system Chromium by the browser tier (tests/browser/test_screenshot.py). Needs chromium and fonts-noto-cjk.
SCREENSHOT_NAME ?= lesson-in-jupyterlab.png
BROWSER_STAMP := $(VENV)/.browser-stamp
$(BROWSER_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,browser]'
	touch $@

screenshot: $(BROWSER_STAMP)
	$(RUN) $(OFFLINE) COURSE_BROWSER_TESTS=require COURSE_SCREENSHOT="$(CURDIR)/docs/img/$(SCREENSHOT_NAME)" \
		python -m pytest -q -p no:cacheprovider tests/browser/test_screenshot.py

# Mutation testing of the training core (docs/mutation.md): every core module, or those named, e.g.
# make mutation MODULES="course_lib/training/accum.py"; writes docs/results/mutation.json and docs/mutation.md.
mutation: setup
	$(RUN) $(OFFLINE) python -m course_tools.mutation run $(MODULES)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
