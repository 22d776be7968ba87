# facepipe: `make demo` runs the whole pipeline on the built-in sample data; `make test` runs the tests.
# Both install into .venv on first use (torch 2.14.1 / torchvision 0.29.1 from the local wheel cache).

SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
BIN := $(abspath $(VENV))/bin
STAMP := $(VENV)/.installed-stamp

export PATH := $(BIN):$(PATH)
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export NO_ALBUMENTATIONS_UPDATE := 1
export DVC_NO_ANALYTICS := 1
PYTEST_ARGS ?=

.PHONY: install browser demo test test-fast bench clean-demo mutants

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,export]'
	touch $(STAMP)

demo: install
	test -d data/raw || facepipe sample-data data/raw --params params.yaml
	dvc add --quiet data/raw
	dvc repro
	@echo; facepipe inspect data/prepared
	@echo; dvc metrics show
	@python -c "import json; m = json.load(open('data/eval/metrics.json')); \
	print(f\"\nheld-out verification accuracy {m['accuracy_mean']:.3f} +- {m['accuracy_std']:.3f} \
	({m['num_pairs']} pairs of {m['num_images']} faces of unseen identities), ROC AUC {m['auc']:.3f}\")"

# Headless Chromium for the report's browser test (tests/test_report_html.py): Debian's package,
# installed when missing and this runs as root (apt-get update + install took 1 min 25 s here).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "make: chromium could not be installed (needs root and apt-get): the report's browser tests will skip"

test: install browser
	python -m pytest -q $(PYTEST_ARGS)

test-fast: install
	python -m pytest -q -m "not slow and not multiprocess" $(PYTEST_ARGS)

# Mutation testing of the core modules (tests/README.md): not part of `make test`. One runner process
# at low priority; mutmut works on a copy in ./mutants. MUTANTS narrows the run to a mutant-name glob,
# e.g. make mutants MUTANTS='facepipe.alignment.*'. Ends with the score per module.
MUTANTS ?=
MUTANTS_STAMP := $(VENV)/.mutants-stamp

$(MUTANTS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,export,mutants]'
	touch $(MUTANTS_STAMP)

mutants: $(MUTANTS_STAMP)
	mkdir -p mutants
	nice -n 10 mutmut run --max-children 1 $(MUTANTS) > mutants/run.log 2>&1 || (tail -c 2000 mutants/run.log; exit 1)
	@mutmut results --all true | awk -F': ' '{ m = $$1; sub(/^ +/, "", m); sub(/\.x.*/, "", m); \
	  total[m]++; if ($$2 == "killed" || $$2 == "timeout") killed[m]++; else if ($$2 != "") left[m] = left[m] " " $$2 } \
	  END { for (m in total) printf "%-32s %4d / %4d caught (killed or timed out, %5.1f%%; equivalent ones not taken off)\n", m, killed[m], total[m], 100 * killed[m] / total[m] }' | sort
	@echo "survivors: mutmut results; one mutant's diff: mutmut show NAME"

bench: install
	python benchmarks/prepare_bench.py

clean-demo:
	rm -rf data/raw data/prepared data/split data/model data/eval data/export dvc.lock
