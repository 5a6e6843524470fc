#!/usr/bin/env bash
# A three-host cluster on this machine (root): network namespaces as hosts, a private /tmp and home each, one shared
# folder as cluster storage; the driver host runs the Spark master and an MLflow server, two worker hosts one Spark
# worker each. See docs/multi-host.md.
#   scripts/multihost.sh up       make the hosts and start the services (prints the addresses)
#   scripts/multihost.sh status   what runs where
#   scripts/multihost.sh down     stop every process on the hosts, delete namespaces and links (by name)
#   scripts/multihost.sh exec HOST [KEY=VALUE ...] -- CMD...   run CMD on HOST (drv, w1, w2), its environment overridden
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${VENV:-.venv}/bin/python" tests/multihost/harness.py "$@"
