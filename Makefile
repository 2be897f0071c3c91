# ironserve: `make demo` runs the main job against the local lab, `make test` runs every test.
CACHE ?= $(or $(IRONSERVE_CACHE),$(HOME)/.cache/ironserve)
VENV ?= $(CACHE)/venv
export PATH := $(VENV)/bin:$(PATH)
export IRONSERVE_CACHE := $(CACHE)

.PHONY: setup demo test lint unit lab-test service-test lab-down coverage bench docs kubernetes-build

setup:
	@bash scripts/setup.sh

# Bring up a lab host, deploy to it, run the acceptance gate, print the result, take the lab down
# (KEEP_LAB=1 keeps it running for `ironserve lab ssh lab-c1`).
demo: setup
	@bash scripts/demo.sh

lint: setup
	ruff check ironserve lab/src roles tests deploy.py setup.py inventory benchmarks scripts
	ruff format --check ironserve lab/src roles tests deploy.py setup.py inventory benchmarks scripts
	mypy ironserve lab/src roles deploy.py setup.py
	cd service && ruff check src tests scripts && ruff format --check src tests scripts && mypy

unit: setup
	python -m pytest -q tests/unit

# The lab's real Kubernetes 1.20.2 node binaries, built once from Debian's source package into the cache
# (about 10 minutes on 2 cores; nothing when cached). The lab node test runs the same script if needed.
kubernetes-build: setup
	@bash scripts/build-kubernetes.sh

lab-test: setup kubernetes-build
	python -m pytest -q tests/lab

service-test: setup
	cd service && python -m pytest -q

# The tiers in two lanes (scripts/test.sh): the unit and service tests beside the lab's VM modules, then the
# container modules; the slowest tests are listed at the end of each, so a CI log shows where its time went.
test: lint kubernetes-build
	@bash scripts/test.sh

coverage: setup
	ironserve coverage --missing

lab-down: setup
	ironserve lab down

bench: setup
	python benchmarks/converge.py

# Regenerate the inventory-key tables of the READMEs from the settings models.
docs: setup
	python -m ironserve.docs
