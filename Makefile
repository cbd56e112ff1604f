# Every target runs `.tools/bin/tox -e <env>`; .tools/ is bootstrapped from the hashed
# requirements/tools.txt (uv, tox, tox-uv). `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
TOOLS := .tools
TOX := $(TOOLS)/bin/tox
FORCE ?=
SGLANG_SOURCE ?= wheel
ARGS ?=
SGLANG_VERSION ?=
PROMOTE ?=
# doctor: the target and draft checkpoint directories, and the draft's training features.
TARGET ?=
DRAFT ?=
FEATURES ?=
# BASE: which base the patch tooling and suites work on (default: the pin, patches/).
# BASE=0.5.23 is patches/0.5.23/, build/sglang-0.5.23, .tox/test-0.5.23.
BASE ?=
PIN_VERSION := $(shell sed -n 's/^  "version": "\(.*\)",$$/\1/p' patches/pin.json)
# The newest base (highest version among patches/*/pin.json): pr-export's default.
NEWEST_BASE := $(shell ls patches/*/pin.json 2>/dev/null | cut -d/ -f2 | sort -V | tail -n 1)
export SGLANG_SOURCE
export HARNESS_BASE := $(BASE)
export HARNESS_BASE_SUFFIX := $(if $(filter-out $(PIN_VERSION),$(BASE)),-$(BASE),)
# pr-export builds its bundles from the newest base unless BASE says otherwise.
PR_BASE := $(or $(BASE),$(NEWEST_BASE),$(PIN_VERSION))
pr-export: export HARNESS_BASE := $(PR_BASE)
pr-export: export HARNESS_BASE_SUFFIX := $(if $(filter-out $(PIN_VERSION),$(PR_BASE)),-$(PR_BASE),)

APPLY_FLAGS := $(if $(filter 1 yes true,$(FORCE)),--force,) --source $(SGLANG_SOURCE)
# Targets that need build/sglang run this first; ARGS belong to the target's own verb.
APPLY := $(TOX) -q -e apply -- $(APPLY_FLAGS)

.DEFAULT_GOAL := help
.PHONY: help apply-patches export-patches check-patches wheel venv test lock clean \
	e2e ablation bench bench-suite test-gpu docker-base docker-test upstream-status rebase pr-export \
	doctor doctor-demo

$(TOOLS)/.stamp: requirements/tools.txt
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check --require-hashes -r requirements/tools.txt
	touch $@

help: ## list targets and variables
	@echo "targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  \1\t\2/' | expand -t 20
	@echo "variables: BASE=<version> (default: the pin $(PIN_VERSION); other bases: patches/*/pin.json),"
	@echo "           FORCE=1 (apply-patches: discard local changes), SGLANG_SOURCE=wheel|git,"
	@echo "           ARGS='...' (extra args for the verb, e.g. make test ARGS='-k comm')"

apply-patches: $(TOOLS)/.stamp ## fetch + verify the pin, apply patches/ to build/sglang (FORCE=1, SGLANG_SOURCE=git)
	$(APPLY) $(ARGS)

export-patches: $(TOOLS)/.stamp ## regenerate patches/ from the commits in build/sglang
	$(TOX) -q -e export -- $(ARGS)

check-patches: $(TOOLS)/.stamp ## lint series + trailers, zero-fuzz apply, round trip, black/isort/codespell
	$(TOX) -q -e check -- $(ARGS)

wheel: $(TOOLS)/.stamp ## build the patched wheel into build/dist
	$(APPLY)
	$(TOX) -q -e wheel -- $(ARGS)

venv: $(TOOLS)/.stamp ## create/refresh the locked test env (.tox/test) with the patched wheel
	$(APPLY)
	$(TOX) -q -e venv

test: $(TOOLS)/.stamp ## run the CPU suites (pytest-xdist; junit in build/results/)
	$(APPLY)
	$(TOX) -q -e test -- $(ARGS)

lock: $(TOOLS)/.stamp ## re-resolve requirements/tools.txt and requirements/test.lock
	$(TOX) -q -e lock -- $(ARGS)

clean: ## remove build/ and .tox/ (keeps .cache/ downloads and .tools/)
	rm -rf build .tox

e2e: $(TOOLS)/.stamp ## real-engine tier: sglang.Engine on the CPU, EAGLE3/DFlash vs plain (junit in build/results/)
	$(APPLY)
	$(TOX) -q -e e2e -- $(ARGS)

ablation: $(TOOLS)/.stamp ## run each regression test without its patch (must fail) and with it
	$(APPLY)
	$(TOX) -q -e ablation -- $(ARGS)
bench: $(TOOLS)/.stamp ## memory benchmark: list+cat vs packer (BASE=0.5.23 ARGS=--engine: capture cost in the Engine)
	$(APPLY)
	$(TOX) -q -e bench -- $(ARGS)
bench-suite: $(TOOLS)/.stamp ## time make test (ARGS=--ablation: and the ablation); SGLang imports per process
	$(APPLY)
	$(TOX) -q -e bench-suite -- $(ARGS)
test-gpu: $(TOOLS)/.stamp ## run the suites on CUDA/NCCL
	$(APPLY)
	$(TOX) -q -e test-gpu -- $(ARGS)
docker-base: $(TOOLS)/.stamp ## build the Debian base image
	$(TOX) -q -e docker-base -- $(ARGS)
docker-test: $(TOOLS)/.stamp ## build the CPU image and run the suites inside
	$(TOX) -q -e docker-test -- $(ARGS)
upstream-status: $(TOOLS)/.stamp ## which patches later SGLang releases already carry
	$(TOX) -q -e upstream-status -- $(ARGS)
rebase: $(TOOLS)/.stamp ## port the series to SGLANG_VERSION=X as base X (drop landed); PROMOTE=1: make X the pin
	@test -n "$(SGLANG_VERSION)" || { echo "error: make rebase needs SGLANG_VERSION=X (e.g. make rebase SGLANG_VERSION=0.5.17)" >&2; exit 2; }
	$(TOX) -q -e rebase -- --to $(SGLANG_VERSION) $(if $(filter 1 yes true,$(PROMOTE)),--promote,) $(if $(filter 1 yes true,$(FORCE)),--force,) $(ARGS)
pr-export: $(TOOLS)/.stamp ## verified upstream PR bundles from the newest base (BASE=... for another) in build/pr/
	$(APPLY)
	$(TOX) -q -e pr-export -- $(ARGS)
doctor: $(TOOLS)/.stamp ## which features a draft was trained on, and whether this server feeds them (TARGET= DRAFT= [FEATURES=])
	@test -n "$(TARGET)" -a -n "$(DRAFT)" || { echo "error: make doctor needs TARGET=<dir> DRAFT=<dir> [FEATURES=<file or dir>]" >&2; exit 2; }
	$(APPLY)
	$(TOX) -q -e doctor -- --target $(abspath $(TARGET)) --draft $(abspath $(DRAFT)) $(if $(FEATURES),--features $(abspath $(FEATURES)),) $(ARGS)
doctor-demo: $(TOOLS)/.stamp ## the doctor on tiny checkpoints with planted conventions (build/doctor/demo.json)
	$(APPLY)
	$(TOX) -q -e doctor-demo -- $(ARGS)
