# Two entry points, each sets up everything it needs from scratch:
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install, run the test suite
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUFF   := $(VENV)/bin/ruff
MYPY_REPORT := $(VENV)/mypy-report.txt
# pytest-xdist workers, whole files each (a file's module fixtures are built once). Most tests are real
# processes that wait on one another part of the time (1.2-1.4 of 2 cores busy): two lanes keep both cores
# busy. TEST_LANES=0 runs the suite in this process, one test at a time.
TEST_LANES ?= 2

.PHONY: demo test bench setup clean lint ruff

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,bench,hf,lightning]"
	@touch $(STAMP)

# The Debian packages install while pip installs the Python ones (both mostly wait on downloads); a failure of
# the Debian ones is a warning, as the tests that need them then say what is missing.
setup:
	@{ command -v etcd && command -v etcdctl && command -v openssl && command -v ip && command -v unshare && \
	   command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null || { \
	  echo "installing etcd-server, etcd-client, openssl, iproute2, util-linux, slurm-wlm and munge (Debian packages) for the integration tests"; \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server etcd-client openssl iproute2 util-linux slurm-wlm munge) >/dev/null || \
	  echo "warning: could not install them; the etcd, two-host and Slurm tests will fail" >&2; } & debian=$$!; \
	$(MAKE) --no-print-directory $(STAMP); python=$$?; wait $$debian; exit $$python

demo: $(STAMP)
	$(PY) examples/llama_finetune/demo.py

ruff: $(STAMP)
	$(RUFF) check src tests benchmarks examples
	$(RUFF) format --check src tests benchmarks examples

lint: ruff
	$(VENV)/bin/mypy

# ruff first (a second); mypy (a minute of one core on a clean clone) runs beside the suite and fails it as a
# failing test would, its report printed after the suite's.
test: setup ruff
	@$(VENV)/bin/mypy > $(MYPY_REPORT) 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q -n $(TEST_LANES) --dist loadfile --durations=40 tests; tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat $(MYPY_REPORT); \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

bench: $(STAMP)
	for b in step_overhead checkpoint rendezvous_scale throughput scale_events failures hydration framework_events; do $(PY) benchmarks/$$b.py --quick || exit 1; done
	for c in hf snapshot; do $(PY) benchmarks/step_overhead.py --quick --client $$c || exit 1; done
	$(PY) benchmarks/failures.py --quick --train-args=--fsdp --kinds rank_crash,node_loss
	$(PY) benchmarks/soak.py --smoke --paths in-process,process
	$(PY) benchmarks/report.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
