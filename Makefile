# transportd: the README's two commands are `make run` and `bash .ci/run`.
PY ?= python3

.PHONY: install run test bench lint

install:
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'

run: install
	bash scripts/run-local.sh $(ARGS)

test:
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/accept_throughput.py

lint:
	ruff check transportd tests benchmarks

.PHONY: analyze bench-analytics

# Spark analytics over the local cluster's tracking logs (see docs/analytics.md).
analyze:
	$(PY) -m transportd analyze 'data/cluster/node*/msgtrk' --out data/analytics

bench-analytics:
	$(PY) benchmarks/analytics_scale.py
