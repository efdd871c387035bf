# lmcache-vllm: `make demo` and `make test` work on a fresh machine (they install what they need).
VENV ?= .venv
PY := $(VENV)/bin/python
# The stamp is keyed on everything that decides what gets installed or compiled (cuda_ops/: the host ops are
# built by the editable install), so a second `make install`
# with nothing changed takes seconds.
STAMP := $(VENV)/.install-$(shell cat requirements/*.txt setup.py scripts/install.sh cuda_ops/* 2>/dev/null | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: install test demo bench bench-serving check-cuda clean

install: $(STAMP)

$(STAMP):
	bash scripts/install.sh
	rm -f $(VENV)/.install-*
	touch $@

test: install
	bash scripts/run_tests.sh $(PYTEST_ARGS)

demo: install
	$(PY) examples/demo.py

bench: install
	$(PY) benchmarks/bench_memory_tier.py --quick

# vLLM's load generator against lmcache-vllm serve (about 25 minutes on 2 cores; BENCH_ARGS=--quick: about 5)
bench-serving: install
	bash scripts/system_packages.sh
	$(PY) benchmarks/bench_serving.py $(BENCH_ARGS)

# nvcc compile + the kernel source run on the host against the torch path (needs torch and vLLM: installs)
check-cuda: install
	bash scripts/check_cuda.sh

clean:
	rm -rf build *.egg-info lmcache_vllm/*.so .pytest_cache
