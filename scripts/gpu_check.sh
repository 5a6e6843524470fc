#!/usr/bin/env bash
# The GPU tier on a bare, offline CUDA machine that has a CUDA torch, Lightning and pyarrow but nothing else of this
# stack: install the wheels brought along, build Horovod with NCCL, install the project without dependencies, run
# tests/gpu, write a JSON report (device, versions, nccl_built, test outcomes, samples/s per configuration).
#   scripts/gpu_check.sh [REPORT.json]       default: $OUT/gpu_check.json if $OUT is set, else work/gpu_check.json
#   LAKEHOUSE_BUNDLE=gpu_bundle              the folder made by scripts/fetch_gpu_bundle.sh on a networked machine
#   PYTHON=python3                           the interpreter that has the CUDA torch
#   GPU_CHECK_VENV=.venv-gpu                 a venv over that interpreter's packages (--system-site-packages)
#   GPU_CHECK_TESTS=0                        install and build only (tests/gpu not run; nor, unless
#                                            GPU_CHECK_FIGURES=1, the report's plain-loop samples/s on the GPU)
#   GPU_CHECK_FIGURES=0|1                    the report's plain-loop figures and bench figures on the GPU (default:
#                                            1, 0 with GPU_CHECK_TESTS=0: scripts/device_gpu_run.sh measures its own)
#   GPU_CHECK_HOROVOD=0                      install only: no Horovod build, no tier (the photo and loader figures
#                                            need none: without Horovod the bench's photo jobs run in one process)
#   GPU_CHECK_BENCH=0|quick|1                after the tier, `lakehouse bench --gpu` (quick or full) into gpu_bench.json
#   GPU_CHECK_BENCH_OVERRIDES="k=v ..."      config overrides for that bench (e.g. data.image_size=64 data.channels=3)
# Exit status: pytest's (0 when the tier passed); the report is written either way.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
BUNDLE=${LAKEHOUSE_BUNDLE:-gpu_bundle}
VENV=${GPU_CHECK_VENV:-.venv-gpu}
REPORT=${1:-${OUT:+$OUT/gpu_check.json}}
REPORT=${REPORT:-work/gpu_check.json}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
log() { echo "gpu_check: $*" >&2; }
T0=$(date +%s)

"$PYTHON" -c 'import torch, pytorch_lightning, pyarrow' || {
  log "$PYTHON lacks torch, pytorch_lightning or pyarrow: this check expects a CUDA image that has them"; exit 1; }
log "$("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())')"
[ -d "$BUNDLE" ] || { log "no bundle folder $BUNDLE: run scripts/fetch_gpu_bundle.sh on a networked machine, bring it along, set LAKEHOUSE_BUNDLE"; exit 1; }
BUNDLE=$(cd "$BUNDLE" && pwd)

# A venv that sees the image's CUDA torch, so nothing installed here touches the image's own packages (PEP 668).
# (A PYTHON that already is a virtual environment's is used as it is.)
if "$PYTHON" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)'; then
  VPY=$("$PYTHON" -c 'import sys; print(sys.executable)')
  log "$PYTHON is a virtual environment's: installing into it"
else
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV" 2>/dev/null \
      || "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
  fi
  VPY="$ROOT/$VENV/bin/python"
fi
if "$VPY" -m pip --version >/dev/null 2>&1; then PIP=("$VPY" -m pip); else PIP=("$PYTHON" -m pip --python "$VPY"); fi
pip_offline() { PIP_CONFIG_FILE=/dev/null "${PIP[@]}" install -q --no-index --find-links "$BUNDLE" "$@"; }

# What the tier imports beyond torch/Lightning/numpy/pyarrow (see scripts/fetch_gpu_bundle.sh); already-present
# packages are kept as they are.
pip_offline cffi pycparser cloudpickle psutil pyyaml packaging pytest pytest-timeout pillow pandas matplotlib \
  mlflow-skinny sqlalchemy alembic
# simplejpeg: the CPU decode's JPEGs; a bundle fetched before it was added lacks it, and Pillow then decodes them
pip_offline simplejpeg || log "simplejpeg is not in $BUNDLE: the CPU decode workers decode JPEGs with Pillow"
if ! command -v cmake >/dev/null 2>&1 && ls "$BUNDLE"/cmake-*.whl >/dev/null 2>&1; then pip_offline cmake; fi
T_DEPS=$(date +%s)

# Horovod from the bundle's sdist: NCCL from the nvidia-nccl-* package the CUDA torch installed (or $NCCL_HOME).
HVD_RC=0
if [ "${GPU_CHECK_HOROVOD:-1}" = 0 ]; then
  log "GPU_CHECK_HOROVOD=0: Horovod not built"; : > "$WORK/horovod.err"
else
  PIP_CONFIG_FILE=/dev/null LAKEHOUSE_BUNDLE="$BUNDLE" PY="$VPY" bash scripts/build_horovod.sh 2> "$WORK/horovod.err" \
    || HVD_RC=$?
  cat "$WORK/horovod.err" >&2
fi
T_HVD=$(date +%s)

# The project by a .pth file in the venv's site-packages (what an editable install amounts to): pip 24 with
# setuptools >= 80 turns `pip install -e .` of a setup.py project into a `setup.py develop` that itself runs pip with
# build isolation, which needs an index this offline machine does not have.
"$VPY" -c "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], 'lakehouse-pipeline.pth').write_text('$ROOT\n')"
"$VPY" -c "import pipeline, os; assert os.path.dirname(os.path.dirname(pipeline.__file__)) == '$ROOT', pipeline.__file__"
PYTEST_RC=0
if [ "$HVD_RC" -eq 0 ] && { [ "${GPU_CHECK_TESTS:-1}" = 0 ] || [ "${GPU_CHECK_HOROVOD:-1}" = 0 ]; }; then
  log "GPU_CHECK_TESTS=0: installed and built, tests/gpu not run"
elif [ "$HVD_RC" -eq 0 ]; then
  "$VPY" -m pytest tests/gpu -ra -p no:cacheprovider --junitxml="$WORK/junit.xml" || PYTEST_RC=$?
else
  log "horovod build failed (status $HVD_RC): the tier is not run"
  PYTEST_RC=$HVD_RC
fi
T_TESTS=$(date +%s)
# The GPU figures (`lakehouse bench --gpu`, no Spark needed): GPU_CHECK_BENCH=1 full sizes, =quick, =0 none.
BENCH=${GPU_CHECK_BENCH:-0}
if [ "$BENCH" != 0 ] && [ "$HVD_RC" -eq 0 ]; then
  BENCH_OUT="$(dirname "$REPORT")/gpu_bench.json"
  mkdir -p "$(dirname "$REPORT")"
  QUICK_FLAG=(); [ "$BENCH" = quick ] && QUICK_FLAG=(--quick)
  # shellcheck disable=SC2086  # the overrides are words
  "$VPY" -m pipeline.cli bench --gpu "${QUICK_FLAG[@]}" --conf conf/local.yaml \
    --out "$BENCH_OUT" ${GPU_CHECK_BENCH_OVERRIDES:-} || log "bench --gpu failed (status $?)"
fi
T_BENCH=$(date +%s)

mkdir -p "$(dirname "$REPORT")"
REPORT_ARGS=(--out "$REPORT" --junit "$WORK/junit.xml" --horovod-log "$WORK/horovod.err" --pytest-rc "$PYTEST_RC"
  --seconds "deps=$((T_DEPS - T0)),horovod=$((T_HVD - T_DEPS)),tests=$((T_TESTS - T_HVD)),bench=$((T_BENCH - T_TESTS))")
if [ "${GPU_CHECK_FIGURES:-${GPU_CHECK_TESTS:-1}}" = 0 ]; then
  # the report without its GPU loops (plain_loop, bench_figures), which counted in the device run's install bound;
  # the device, versions and Horovod's build as always
  "$VPY" - "${REPORT_ARGS[@]}" <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gpu_report", "scripts/gpu_report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
skipped = "GPU_CHECK_FIGURES=0 (GPU_CHECK_TESTS=0): not measured"
report.plain_loop = lambda: {"skipped": skipped}
report.bench_figures = lambda: {"skipped": skipped}
sys.argv[0] = "scripts/gpu_report.py"
sys.exit(report.main())
EOF
else
  "$VPY" scripts/gpu_report.py "${REPORT_ARGS[@]}"
fi
log "report: $REPORT"
exit "$PYTEST_RC"
