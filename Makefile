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

# The tiers and their summary line: scripts/test_tiers.sh. It sets up the four venvs at once (the classic one too, so
# no prerequisite here), then runs the tiers; a tier whose set-up failed is said and not run. The recipe names no
# $(MAKE) (nor a `+`): a line that does runs even under `make -n`, and `make -n test` would run the whole suite. The
# script runs `make` itself (MAKE=... for another), with MAKEFLAGS (-k, -s, ...) inherited from the environment.
test:
	VISION_TESTS="$(VISION_TESTS)" bash scripts/test_tiers.sh

# The vision tier alone (the classic run skips these files, naming why): timm backbones, pretrained weights, fine-tuning,
# and data.decode=gpu's code run on torchvision's CPU decoder.
VISION_TESTS := tests/unit/test_timm_backbone.py tests/unit/test_timm_finetune.py tests/integration/test_timm_train.py \
	tests/unit/test_decode_stage.py tests/unit/test_gpu_decode_headers.py tests/unit/test_batched_resize.py
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
