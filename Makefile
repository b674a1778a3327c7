# The commands the README shows. `make setup` once, then `make up` or `make test`.
VENV ?= .venv

.PHONY: setup up test bench schema

setup:
	@bash scripts/setup.sh

up: setup
	$(VENV)/bin/berth up

test: setup
	$(VENV)/bin/python -m pytest

bench: setup
	$(VENV)/bin/python bench/bus.py

schema: setup
	$(VENV)/bin/berth schema -o schema.json
