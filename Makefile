# kvgate — the two commands of the README, and their parts.
#   make test   every test (unit, integration over real sockets, peer-router checks)
#   make setup  what the tests need beyond Cargo (wasm target, Python venv, tokenizer, vLLM code,
#               the real vLLM engine and its model)
SHELL := /bin/bash
CARGO ?= cargo
export KVGATE_ROOT := $(CURDIR)
export KVGATE_VENV ?= $(CURDIR)/.kvgate/venv
export KVGATE_TOKENIZER ?= $(CURDIR)/.kvgate/tokenizers/qwen3/tokenizer.json
export KVGATE_CACHE ?= $(HOME)/.cache/kvgate
# Where cargo builds (CARGO_TARGET_DIR, when set), and its release binaries.
TARGET_DIR := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)
BIN := $(TARGET_DIR)/release

.PHONY: docs profile setup build test lint audit licenses native bench bench-signals bench-goodput bench-cluster bench-replicas bench-live fmt sim bench-scorer wasm demo demo-pd up down bench-overhead fuzz soak chaos picker-failover demo-replicas measure-fresh sim-check demo-engines

setup:
	@bash tests/tools/setup.sh

# cargo-deny: licenses, bans, sources (advisories where a database exists); license list.
audit: setup
	@bash tests/tools/audit.sh

licenses: setup
	@bash tests/tools/audit.sh --write

build:
	$(CARGO) build --workspace --release

# Formatting and clippy (the wasm target too; the workspace includes the fuzz targets, fuzzed
# by `make fuzz` on nightly).
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvgate-filter --target wasm32-wasip1 -- -D warnings

# The generated reference pages (docs/configuration.md, docs/metrics.md), from the code.
docs:
	KVGATE_WRITE_DOCS=1 $(CARGO) test -p kvgate-scorer --test reference_docs

# The Envoy filter module.
wasm:
	$(CARGO) build -p kvgate-filter --target wasm32-wasip1 --release

# The filter as an Envoy dynamic module ($(BIN)/libkvgate_filter_native.so).
native:
	$(CARGO) build -p kvgate-filter-native --release

fmt:
	$(CARGO) fmt --all

# Integration and end-to-end tests start the workspace's binaries (pods, scorer, Envoy with
# the filter module), so build them first; with the tests, in one build that keeps both
# cores busy.
test: setup lint audit wasm native
	$(CARGO) build --workspace --release --bins --tests
	$(CARGO) test --workspace --release

# The main job: 4 simulated pods + scorer + Envoy with the kvgate filter on loopback, a
# realistic mixed workload through it and through plain round robin, and a report.
demo: setup wasm
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-demo

# The main job on real engines: two vLLM engines (vLLM 0.32 on CPU, the tiny model make setup
# makes) instead of the simulated pods, the same workload and report.
demo-engines: setup wasm
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-demo --engines 2

# The P/D variant: 2 prefill + 2 decode pods; conditional vs always vs never disaggregating.
demo-pd: setup wasm
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-demo --pd

# Gateway replicas: one Envoy + scorer, three Envoys on one scorer, three replicas sharing
# their bookings over NATS, three on their own; the mixed workload and a burst through each,
# the client spread over them.
demo-replicas: setup wasm
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-demo --replicas 3

# The same stack left running on the documented defaults (see tests/tools/stack.sh).
up: setup wasm
	$(CARGO) build --workspace --release --bins
	@bash tests/tools/stack.sh up

down:
	@bash tests/tools/stack.sh down

# Added latency of the kvgate path versus the same Envoy round-robin without the filter.
bench-overhead: setup wasm native
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-overhead

# Where a request's CPU goes: per process, Envoy by binary, the scorer by stage, flamegraphs;
# results in target/profile/.
profile: setup wasm native
	$(CARGO) build --workspace --release --bins
	@bash tests/tools/profile.sh

# One simulated pod on the documented defaults, for trying things by hand.
sim: setup
	$(CARGO) run --release -p kvgate-sim -- --listen 127.0.0.1:8001 --pod-id pod-a \
	  --kv-events-endpoint tcp://127.0.0.1:5557 --tokenizer $(KVGATE_TOKENIZER)

# The scorer's core benchmarks: decision latency, event ingestion, memory, tokenization.
bench-scorer: setup
	$(CARGO) bench -p kvgate-routing --bench routing

# libFuzzer on every input parser (FUZZ_SECONDS per target, default 60); nightly + cargo-fuzz.
fuzz:
	@bash tests/tools/fuzz.sh

# A bounded soak (SOAK_SECONDS, default 120) at a fixed rate: memory, descriptors, bookings.
soak: setup wasm
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-soak --seconds $${SOAK_SECONDS:-120}

# Faults one after the other under a steady streaming load, through the real stack on both
# entry paths; one line per phase; fails when a fault cost a client error it should not.
chaos: setup wasm
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-chaos $(CHAOS_ARGS)

# Two pickers sharing their bookings over NATS behind a real Envoy in Istio's shape and in
# llm-d's, under load: a rolling restart, then a kill -9; requests failed by when they
# started (FAILOVER_ARGS, e.g. --with-gateway-defaults); report in target/picker-failover/.
picker-failover: setup
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-picker-failover $(FAILOVER_ARGS)

# The simulator checked against the real engine: one trace of SIM_CHECK_ARGS (default 500
# requests) on a real vLLM engine and on kvgate-sim configured alike; results in
# target/sim-check/.
sim-check: setup
	$(CARGO) build --workspace --release --bins
	$(BIN)/kvgate-sim-check $(SIM_CHECK_ARGS)

# Routing quality in virtual time: every workload x every policy (and SGLang's cache_aware
# rule) on simulated engines; results in target/bench/cluster/.
bench-cluster:
	$(CARGO) run --release -p kvgate-bench --bin kvgate-cluster-sim -- $(CLUSTER_ARGS)

# Goodput at an SLO in virtual time: every workload's offered load swept from 1/4 to 16 times
# its rate for every router on 8 pods (seeds 1-2); the highest load whose p90 TTFT stays
# within 3x the unloaded p90, and the p90-vs-load plots. Results in target/bench/goodput/.
SWEEP ?= 0.25,0.35,0.5,0.7,1,1.4,2,2.8,4,5.6,8,11,16
# kvgate's autoscaling signals beside the p90 TTFT along a load sweep (docs/autoscaling.md).
bench-signals:
	$(CARGO) run --release -p kvgate-bench --bin kvgate-cluster-sim -- --workloads chat,capacity,documents \
	  --routers kv --sweep $(SWEEP) --seeds 2 --out target/bench/signals

bench-goodput:
	$(CARGO) run --release -p kvgate-bench --bin kvgate-cluster-sim -- --sweep $(SWEEP) --seeds 2 \
	  --out target/bench/goodput $(GOODPUT_ARGS)

# Live side by side on simulated pods: Envoy + kvgate (wasm filter, native module, Endpoint
# Picker), vllm-router, sglang-router, Envoy round robin; then each router's overhead.
# Results in target/bench/live/.
bench-live: setup wasm native
	$(CARGO) build --workspace --release --bins
	$(CARGO) run --release -p kvgate-bench --bin kvgate-live-bench -- $(LIVE_ARGS)

# Gateway replicas in virtual time: one kvgate, three sharing their bookings after 0, 1, 5
# or 50 ms, three unsynced; burst (at once, and over 100 ms), chat and capacity workloads. Results in
# target/bench/replicas/.
bench-replicas:
	$(CARGO) run --release -p kvgate-bench --bin kvgate-cluster-sim -- --workloads burst,burst-100ms,chat,capacity --seeds 6 \
	  --routers kv kv/3-replicas kv/3-replicas-sync-1ms kv/3-replicas-sync-5ms kv/3-replicas-sync-50ms kv/3-replicas-unsynced \
	  --out target/bench/replicas

# Every benchmark part.
bench: bench-goodput bench-cluster bench-live

# What `make demo` and `make test` take and download on a fresh machine: a fresh clone with
# empty caches, timed (tests/tools/fresh_machine.sh; run it on an idle machine).
measure-fresh:
	tests/tools/fresh_machine.sh
