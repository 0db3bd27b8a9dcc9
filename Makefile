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

# transportd (3-node, shadow on/off) against Postfix on this machine; table + JSON (docs/performance.md).
.PHONY: bench-compare
bench-compare: install
	$(PY) benchmarks/compare_postfix.py --long 60 --json benchmarks/results/compare_postfix.json

# The accept path alone: CPU and writer jobs per accepted message (docs/performance.md, session 32).
.PHONY: bench-accept
bench-accept: install
	$(PY) benchmarks/accept_path_cpu.py --messages 3000 --concurrency 8

.PHONY: bench-holder
bench-holder: install
	$(PY) benchmarks/shadow_holder_cpu.py --messages 4000 --concurrency 4

# A ShadowStateChange promotion of 20,000 shadows while clients send (docs/reliability.md).
.PHONY: bench-promotion
bench-promotion: install
	$(PY) benchmarks/promotion_under_load.py --shadows 20000 --seconds 60 --rate-messages 6000

# The cluster in containers (scripts/compose.sh): base image if missing, images, up, healthy.
# podman + podman-compose here, `docker compose` where Docker runs. ARGS=-v: compose-down removes volumes.
.PHONY: compose-up compose-down compose-test
compose-up:
	bash scripts/compose.sh up

compose-down:
	bash scripts/compose.sh down $(ARGS)

# The end-to-end container test alone (tests/test_containers.py).
compose-test:
	$(PY) -m pytest -q -m containers tests/test_containers.py

.PHONY: compose-check
compose-check:
	docker-compose config -q && docker-compose --profile analytics --profile metrics config -q
	$(PY) -m pytest -q tests/test_compose.py

# Fault injection (docs/reliability.md): a shadow-redundancy run that must lose nothing, then the
# control run with the same seed and shadow redundancy off, which must lose mail.
CHAOS_MESSAGES ?= 300
CHAOS_FAULTS ?= 6
CHAOS_SEED ?= 4242
.PHONY: chaos
chaos:
	$(PY) -m transportd chaos --messages $(CHAOS_MESSAGES) --faults $(CHAOS_FAULTS) --seed $(CHAOS_SEED) --json chaos-shadow.json
	$(PY) -m transportd chaos --messages $(CHAOS_MESSAGES) --faults $(CHAOS_FAULTS) --seed $(CHAOS_SEED) --ip-base 121 --no-shadow --expect-loss --json chaos-control.json

.PHONY: analyze bench-analytics

# Spark analytics over the local cluster's tracking logs (see docs/analytics.md).
analyze:
	$(PY) -m transportd analyze 'data/cluster/node*/msgtrk' --out data/analytics

bench-analytics:
	$(PY) benchmarks/analytics_scale.py
