# ddptrain — every target installs what it needs first (a venv in .venv, torch/torchaudio pinned).
PY      ?= python3
VENV    ?= .venv
PYBIN   := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)
NPROC   ?= 2

.PHONY: help install test test-fast demo minimal bench-data clean

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): setup.py
	test -x $(PYBIN) || $(PY) -m venv $(VENV)
	$(PYBIN) -m pip install -q --upgrade pip
	$(PYBIN) -m pip install -q torch==2.11.0 torchaudio==2.11.0
	$(PYBIN) -m pip install -q -e '.[dev]'
	$(PYBIN) -m pip install -q --no-deps voxcpm==2.0.3  # the TTS recipe's model code only (its deps: the dev extra)
	touch $(STAMP)

install: $(STAMP)  ## create .venv with torch==2.11.0, torchaudio==2.11.0 and ddptrain (editable)

# each test as it runs with the suite's progress, the 15 slowest tests at the end; a hung run ends
# (pytest.ini: a timeout per test and one for the session)
test: $(STAMP)  ## install, then run the whole test suite (CPU, gloo), slowest tests listed at the end
	$(PYBIN) -m pytest -v --durations=15 tests

# a previous demo run is not deleted: checkpoint.start_over moves its files to runs/asr_demo/*/archive/ and says so
demo: $(STAMP)  ## install, then run the main job: the two-stage ASR demo on the shipped data (CPU)
	$(PYBIN) examples/finetune_asr.py --config configs/asr_demo.yaml checkpoint.start_over=true $(ARGS)
	$(PYBIN) examples/finetune_asr.py --config configs/asr_demo_accent.yaml checkpoint.start_over=true $(ARGS)

minimal: $(STAMP)  ## install, then run the dozen-line example under torchrun with 2 CPU processes
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) examples/minimal.py

bench-data: $(STAMP)  ## padding / data-loading benchmarks (CPU), numbers go to BENCHMARKS.md
	$(PYBIN) bench/bench_padding.py
	$(PYBIN) bench/bench_dataloading.py

clean:  ## remove run folders and caches (keeps .venv)
	rm -rf runs .pytest_cache $$(find . -name __pycache__ -not -path './$(VENV)/*')
