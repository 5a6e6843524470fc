# make demo: set up, render the sample, ingest it to Delta, train with Horovod on 2 processes, register.
# make test: the classic profile's full suite, then the modern and dbr-15.4 profiles' data-path tests (`-m datapath`),
# then the vision tier (timm) in .venv-vision.
# make setup PROFILE=modern: the second install profile (no Petastorm, pyarrow 25, numpy 2) in .venv-modern.
# make setup PROFILE=dbr-15.4: Databricks Runtime 15.4 LTS ML's Python, Spark 3.5, Arrow, numpy, pandas and Petastorm
# in .venv-dbr154 (scripts/databricks/constraints-dbr-15.4-ml.txt).
PROFILE ?= classic
VENV_classic := .venv
VENV_modern := .venv-modern
VENV_dbr-15.4 := .venv-dbr154
VENV := $(VENV_$(PROFILE))
ifeq ($(VENV),)
$(error PROFILE=$(PROFILE): the install profiles are classic, modern and dbr-15.4)
endif
PY := $(VENV)/bin/python
SETUP_DEPS := setup.py scripts/setup.sh scripts/build_horovod.sh pipeline/buildinfo.py

.PHONY: setup demo test test-unit test-gpu test-vision bench doctor clean

setup: $(VENV)/.installed

.venv/.installed: $(SETUP_DEPS)
	PROFILE=classic VENV=.venv bash scripts/setup.sh
	touch $@

.venv-modern/.installed: $(SETUP_DEPS)
	PROFILE=modern VENV=.venv-modern bash scripts/setup.sh
	touch $@

.venv-dbr154/.installed: $(SETUP_DEPS) scripts/databricks/constraints-dbr-15.4-ml.txt
	PROFILE=dbr-15.4 VENV=.venv-dbr154 bash scripts/setup.sh
	touch $@

# The vision venv: the whole pipeline (classic profile) on torch 2.14.1 + torchvision 0.29.1 + timm, Horovod built for
# that torch. timm needs a torchvision built for its torch, which no wheel offers beside torch 2.13 CPU.
.venv-vision/.installed: scripts/setup_vision.sh $(SETUP_DEPS)
	bash scripts/setup_vision.sh
	touch $@

demo: setup
	bash scripts/demo.sh

# Every profile runs even when an earlier one fails; the exit status is the worst of them. A tier whose set-up failed
# is said and not run (a half-built venv gives only import errors). The last line sums up every tier. pytest's 5 (no test
# selected) on a data-path run means no test is marked `datapath` yet: said, not failed.
test: .venv/.installed
	@status=0; summary=""; \
	.venv/bin/python -m pytest tests -ra --durations=40 --durations-min=20; rc=$$?; [ $$rc -eq 0 ] || status=1; summary="classic: pytest exit $$rc"; \
	for p in modern:.venv-modern dbr-15.4:.venv-dbr154; do \
	  if $(MAKE) --no-print-directory PROFILE=$${p%%:*} setup; then \
	    echo "== $${p%%:*} profile: data-path tests ($${p#*:})"; \
	    $${p#*:}/bin/python -m pytest tests -m datapath -ra; rc=$$?; \
	    if [ $$rc -eq 5 ]; then echo "$${p%%:*} profile: no test is marked datapath"; elif [ $$rc -ne 0 ]; then status=1; fi; \
	    summary="$$summary; $${p%%:*}: pytest exit $$rc"; \
	  else status=1; summary="$$summary; $${p%%:*}: set-up failed"; echo "== $${p%%:*} profile: set-up failed (above), its tests not run"; fi; \
	done; \
	if $(MAKE) --no-print-directory .venv-vision/.installed; then \
	  echo "== vision tier: timm backbones (.venv-vision)"; \
	  .venv-vision/bin/python -m pytest $(VISION_TESTS) -ra; rc=$$?; [ $$rc -eq 0 ] || status=1; \
	  summary="$$summary; vision: pytest exit $$rc"; \
	else status=1; summary="$$summary; vision: set-up failed"; echo "== vision tier: set-up failed (above), its tests not run"; fi; \
	echo "== make test: $$summary"; \
	exit $$status

# The vision tier alone (the classic run skips these files, naming why): timm backbones, pretrained weights, fine-tuning,
# and data.decode=gpu's code run on torchvision's CPU decoder.
VISION_TESTS := tests/unit/test_timm_backbone.py tests/unit/test_timm_finetune.py tests/integration/test_timm_train.py \
	tests/unit/test_decode_stage.py tests/unit/test_gpu_decode_headers.py
test-vision: .venv-vision/.installed
	.venv-vision/bin/python -m pytest $(VISION_TESTS) -ra

test-unit: setup
	$(PY) -m pytest tests/unit -ra

# The GPU tier (skipped with the reason where CUDA is absent); scripts/gpu_check.sh runs it on a bare CUDA machine.
test-gpu: setup
	$(PY) -m pytest tests/gpu -ra

bench: setup
	$(VENV)/bin/lakehouse bench --conf conf/local.yaml

doctor: setup
	$(VENV)/bin/lakehouse doctor --conf conf/local.yaml

clean:
	rm -rf work .pytest_cache
