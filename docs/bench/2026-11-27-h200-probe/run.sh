#!/usr/bin/env bash
# device probe: deps from the bundle (no Horovod), then probe.py, then the photo loader's figures
set -u
cd "$(dirname "$0")/../../.."
SECONDS=0
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --no-index --find-links gpu_bundle cffi pycparser cloudpickle psutil \
  pyyaml packaging pandas mlflow-skinny sqlalchemy alembic > "$OUT/install.log" 2>&1
python3 -c "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], 'lakehouse-pipeline.pth').write_text('$PWD\n')"
echo "install: $SECONDS s"
python3 -c "import torch, torchvision, PIL, timm; print(torch.__version__, torchvision.__version__, PIL.__version__, timm.__version__)" 2>&1 | tail -1
timeout 150 python3 docs/bench/2026-11-27-h200-probe/probe.py > "$OUT/probe.log" 2>&1; echo "probe: exit $? at $SECONDS s"
timeout $(( ${PROBE_LIMIT_S:-280} - SECONDS )) python3 -m bench.photos_loader --rows 2048 --batches 8 --workers 1,4,16 \
  --out "$OUT/photos_loader.json" > "$OUT/photos_loader.log" 2>&1; echo "photos_loader: exit $? at $SECONDS s"
python3 -c "
import json; d=json.load(open('$OUT/probe.json')); [print(k, v if not isinstance(v, str) else v[:3000]) for k, v in d.items()]"
cat "$OUT/photos_loader.json"
