# Two entry points do all the set-up on a fresh machine:
#   make demo   install, then run `edgefl demo`
#   make test   install (with the test and docs extras and the Debian packages the tests use),
#               lint, test (the tests build the documentation site with --strict)
# `make docs` serves the documentation site at http://127.0.0.1:8000 while you edit it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test docs lint system-packages clean mutation check-demo-figures

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	touch $(STAMP)

install: $(STAMP)

# mosquitto (MQTT tests), chromium (report.html test), Fashion-MNIST (real-data tests) and
# rabbitmq-server (the SDK against RabbitMQ's MQTT plugin).
# Installed only when missing and when we are root; otherwise the tests that need them skip with the reason.
system-packages:
	@missing=""; \
	command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing="$$missing mosquitto"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || missing="$$missing dataset-fashion-mnist"; \
	[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing="$$missing rabbitmq-server"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "not root: skipping apt-get install of$$missing (tests that need them will skip)"; \
	  fi; \
	fi

demo: $(STAMP)
	$(BIN)/edgefl demo

# The demo, then its figures that the docs quote checked against it (not part of `make test`).
check-demo-figures: demo
	$(BIN)/python tools/check_demo_figures.py

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two workers: the tests that run federations of processes one at a time on one, the in-process
# tests on the other (see tests/conftest.py). `.venv/bin/python -m pytest tests/...` runs a part.
test: $(STAMP) system-packages lint
	$(BIN)/python -m pytest -n 2

# Mutation testing of the algorithms, losses, strategies and metrics (not part of `make test`;
# about an hour on 2 cores). Settings in pyproject's [tool.mutmut]; equivalent survivors
# in mutation-equivalent.txt; fails when a survivor is neither killed nor listed there.
# MUTANTS='edge_sdk.algorithms.guard.* edge_sdk.algorithms.deployment.*' (mutmut's name
# patterns) runs and scores those alone: the check of a change to a few files.
MUTANTS ?=
mutation: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,docs,mutation]'
	rm -rf mutants
	$(BIN)/mutmut run --max-children 2 $(foreach m,$(MUTANTS),'$(m)')
	$(BIN)/python tools/mutation_score.py $(foreach m,$(MUTANTS),'$(m)')

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build site *.egg-info mutants
