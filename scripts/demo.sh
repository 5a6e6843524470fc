#!/usr/bin/env bash
# The main job on the embedded default (conf/local.yaml): sample images -> Delta -> Horovod x2 -> MLflow registry.
set -euo pipefail
cd "$(dirname "$0")/.."
LH=.venv/bin/lakehouse
CONF=${CONF:-conf/local.yaml}
export LAKEHOUSE_PROGRESS=${LAKEHOUSE_PROGRESS:-0}
$LH sample-data --out work/sample/digits
$LH ingest --conf "$CONF" --source work/sample/digits --mode overwrite "$@"
$LH train --conf "$CONF" "$@" | tee work/last_train.json
# the options first, then the file and the overrides: one block of positionals, however the summary's parser reads them
.venv/bin/python -m pipeline.summary --conf "$CONF" work/last_train.json "$@"
