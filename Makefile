# The commands the README shows. `make setup` once, then `make up` or `make test`; `make docs` builds
# the manual (docs/) into site/.
VENV ?= .venv

.PHONY: setup up test bench schema docs

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

docs: setup
	$(VENV)/bin/python scripts/docs_reference.py
	$(VENV)/bin/mkdocs build --strict
