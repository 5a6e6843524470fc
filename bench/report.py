"""The bench report: the table in the log and the MLflow run (metrics, pass tags, bench.json)."""
from __future__ import annotations

import time
from typing import Any, Dict

from pipeline.log import get_logger

log = get_logger(__name__)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    return str(v)


def log_table(report: Dict[str, Any]) -> None:
    head = f"{'ratio':<28} {'data set':<20} {'measured':>9} {'target':>8} {'result':>6} {'repeats':>7} {'spread':>17}"
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        spread = f"{r['spread'].get('min', float('nan')):.3g}..{r['spread'].get('max', float('nan')):.3g}"
        dataset = r["dataset"] + (f"/{r['variant']}" if r.get("variant") else "")
        lines.append(f"{r['name']:<28} {dataset:<20} {r['ratio']:>9.3f} {r['op'] + format(r['target'], 'g'):>8} "
                     f"{'pass' if r['passed'] else 'FAIL':>6} {r['repeats']:>7} {spread:>17}")
        lines.append("    " + ", ".join(f"{k}={fmt(v)}" for k, v in r["parts"].items() if k != "tracking_uri"))
        if r.get("note") and not r["passed"]:
            lines.append("    note: " + r["note"])
    m = report["machine"]
    lines.append(f"machine: {m['cpus']} CPU(s), device {m['device']}; load before {report['load']['before']}, "
                 f"after {report['load']['after']}; {report['repeats']} repeat(s){' (--quick)' if report['quick'] else ''}")
    for key in ("skipped", "failed"):
        lines += [f"{key}: {name}: {why}" for name, why in (report.get(key) or {}).items()]
    if "all_passed" in report:
        lines.append(f"all_passed {report['all_passed']}, complete {report.get('complete')}")
    for line in lines:
        log.info("%s", line)


def log_to_mlflow(run, report: Dict[str, Any]) -> None:
    from mlflow.entities import Metric, Param

    ts = int(time.time() * 1000)
    metrics = [Metric(k.replace("/", "."), float(v), ts, 0) for k, v in report["ratios"].items()]
    params = [Param("quick", str(report["quick"])), Param("repeats", str(report["repeats"])),
              Param("load_before", str(report["load"]["before"])), Param("device", report["machine"]["device"])]
    run.client.log_batch(run.run_id, metrics=metrics, params=params, synchronous=True)
    run.client.log_dict(run.run_id, report, "bench.json")
    for k, ok in report["passed"].items():
        run.client.set_tag(run.run_id, f"pass.{k.replace('/', '.')}", str(ok))

