# make demo: set up, render the sample, ingest it to Delta, train with Horovod on 2 processes, register.
# make test: set up, run every test that can run on this machine.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: setup demo test test-unit bench doctor clean

setup: $(VENV_STAMP)

$(VENV_STAMP): setup.py scripts/setup.sh scripts/build_horovod.sh
	bash scripts/setup.sh
	touch $(VENV_STAMP)

demo: setup
	bash scripts/demo.sh

test: setup
	$(PY) -m pytest tests -ra

test-unit: setup
	$(PY) -m pytest tests/unit -ra

bench: setup
	.venv/bin/lakehouse bench --conf conf/local.yaml

doctor: setup
	.venv/bin/lakehouse doctor --conf conf/local.yaml

clean:
	rm -rf work .pytest_cache
