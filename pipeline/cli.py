"""`lakehouse` command line: parse arguments, load the config, call one pipeline function, print its result."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from pipeline import preload
from pipeline.config import ConfigError, load_config
from pipeline.data.cache import clear, list_entries
from pipeline.doctor import run_doctor
from pipeline.errors import Terminated
from pipeline.lakehouse.spark import require_submitted_master, spark_on_demand, spark_session
from pipeline.log import flush_and_exit, get_logger, setup_logging
from pipeline.serving.predict import predict_table
from pipeline.tune.sweep import run_tune, trials_asked
from pipeline.workflow import ingest, promote_version, sync_run, train

log = get_logger("lakehouse")

DEFAULT_CONF = os.environ.get("LAKEHOUSE_CONF", "conf/local.yaml")


def _add_conf(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conf", default=DEFAULT_CONF, help="YAML profile (merged over base.yaml beside it)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.np=-2 data.batch_size=32")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lakehouse", description="Delta Lake -> Petastorm -> Lightning/Horovod -> MLflow")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sample-data", help="write a class-per-folder image tree to ingest: scikit-learn's digits as "
                                           "PNGs, or synthetic ImageNet-shaped JPEG photos")
    p.add_argument("--kind", choices=["digits", "photos"], default="digits",
                   help="digits: the 1,797 8x8 scans enlarged to --size; photos: RGB JPEGs of about 400x350, quality 90")
    p.add_argument("--out", default=None, help="the folder (default: work/sample/<kind>)")
    p.add_argument("--size", type=int, default=32, help="digits: the side in pixels")
    p.add_argument("--limit", "--count", dest="count", type=int, default=None,
                   help="how many images (digits: at most 1,797, default all; photos: default 1000)")
    p.add_argument("--classes", type=int, default=None, help="photos: how many classes (default 5)")
    p.add_argument("--seed", type=int, default=0, help="photos: the same seed writes the same files")

    p = sub.add_parser("ingest", help="image folder -> one Delta commit")
    p.add_argument("--source", required=True, help="folder with one sub-folder per class")
    p.add_argument("--mode", choices=["append", "overwrite"], default="append")
    _add_conf(p)

    p = sub.add_parser("train", help="train on the pinned Delta table; prints one JSON line at the end")
    p.add_argument("--run-name", default=None)
    _add_conf(p)

    p = sub.add_parser("promote", help="move the champion alias to a version if it beats the champion")
    p.add_argument("--version", default=None, help="model version (default: the latest)")
    _add_conf(p)

    p = sub.add_parser("predict", help="score a pinned Delta table with a registered model; one Delta commit")
    p.add_argument("--model", required=True, help="models:/<name>@<alias> or models:/<name>/<version>")
    p.add_argument("--table", required=True, help="input Delta table (path, content columns)")
    p.add_argument("--version", type=int, default=None, help="input table version (default: the latest)")
    p.add_argument("--out", required=True, help="output Delta table of predictions")
    p.add_argument("--mode", choices=["append", "overwrite"], default="append")
    p.add_argument("--run-key", default=None,
                   help="part of the job's identity (with the model version and the input table and version): an "
                        "append whose identity is already in --out writes nothing (a retry); give another key to "
                        "append the same predictions again")
    _add_conf(p)

    p = sub.add_parser("export", help="export a registered model version to ONNX or TorchScript with its contract")
    p.add_argument("--model", required=True, help="models:/<name>@<alias> or models:/<name>/<version>")
    p.add_argument("--format", choices=["onnx", "torchscript"], required=True)
    p.add_argument("--out", default=None, help="folder for the files (default: only logged to the run)")
    _add_conf(p)

    p = sub.add_parser("tune", help="Optuna sweep over a search space; each trial a train in an MLflow child run")
    p.add_argument("--space", default=None, help="search space YAML (conf/search/<name>.yaml)")
    p.add_argument("--trials", type=int, default=None,
                   help="trials in the study, >= 1 (sets tune.n_trials; default: tune.n_trials, or on --resume the "
                        "study's own count unless tune.n_trials=N is given)")
    p.add_argument("--timeout", type=float, default=None,
                   help="start no trial after this many seconds, > 0 (sets tune.timeout_s)")
    p.add_argument("--resume", default=None, metavar="STUDY", help="continue this study: only the missing trials")
    _add_conf(p)

    p = sub.add_parser("cache", help="the converted-data cache (data.cache_dir): list entries or clear them")
    actions = p.add_subparsers(dest="action", required=True)
    _add_conf(actions.add_parser("ls", help="entries, most recently used first, with size and source table"))
    p = actions.add_parser("clear", help="delete entries (all, or those named by --key); an entry a running job "
                                         "holds is kept and named with its holder (job, pid, host)")
    p.add_argument("--key", action="append", default=None, help="clear only this entry (repeatable)")
    p.add_argument("--force", action="store_true", help="delete held entries too (their jobs then fail reading them)")
    _add_conf(p)

    p = sub.add_parser("sync-run", help="upload a run left offline (the tracking server was down) to MLflow")
    p.add_argument("folder", help="the run's folder (<job dir>/offline_run, named by `lakehouse train`)")
    p.add_argument("overrides", nargs="*", help="e.g. mlflow.tracking_uri=http://host:5000 (default: the run's)")

    p = sub.add_parser("doctor", help="check the installed stack")
    _add_conf(p)

    p = sub.add_parser("bench", help="measure loader, conversion, scaling and overhead ratios")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (proves it runs)")
    p.add_argument("--out", default="work/bench/bench.json")
    p.add_argument("--only", default=None, metavar="M[,M...]",
                   help="run only these measurements (loader, input_bound, shard_balance, predict_throughput, "
                        "overheads, tune_overhead, restart_cost, scaling, gpu, job_phases, epoch_parity, cross_host, "
                        "step_overhead, direct_source, photo_decode); the conversion always runs, unless only "
                        "cross_host, step_overhead or photo_decode are asked for. With --gpu: archs, photos")
    p.add_argument("--gpu", action="store_true",
                   help="the GPU figures alone (images/s per GPU per architecture and precision, Lightning / plain "
                        "loop, input-bound fraction) on a data set written with pyarrow, and ImageNet-shaped photos "
                        "(loader alone with decode=cpu|gpu, timm resnet50/resnet18 at 224 px bf16): no Spark or Java "
                        "needed")
    _add_conf(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command; returns its exit status (jobs/*.py call this in a driver's Python that goes on afterwards)."""
    return _exit_past_abandoned_launches(_main(argv))


def console() -> None:
    """The `lakehouse` command (and `python -m pipeline.cli`): `main`, then the process ends as a normal exit does
    (threads that are not daemons joined, exit handlers run: Spark's and Petastorm's clean-ups, MLflow's flushes),
    but without the interpreter's teardown of every module torch, MLflow and py4j loaded: 1.4 s of a training job's
    exit on this machine, measured. An exception out of `main` takes the normal path."""
    end_process(main())


def end_process(rc: int) -> None:
    """Exit with `rc` now, in the interpreter's own order: `threading._shutdown` (the threading exit hooks, which tell
    idle thread pools such as MLflow's artifact uploaders to stop, then the join of the threads that are not daemons:
    joining them without the hooks waits forever), the exit handlers, a flush, then `os._exit`."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    flush_and_exit(rc)


def _main(argv: Optional[List[str]] = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sample-data":
            from pipeline.lakehouse.sample_data import render_sample  # local: numpy, out of the other commands

            out, counts = render_sample(args.kind, args.out, args.count, size=args.size, classes=args.classes,
                                        seed=args.seed)
            print(json.dumps({"out": out, "kind": args.kind, "images": sum(counts.values()), "classes": counts}))
            return 0
        if args.command == "sync-run":
            print(json.dumps(sync_run(args.folder, args.overrides)))
            return 0
        cfg = load_config(args.conf, args.overrides)
        if args.command in ("train", "tune", "ingest", "predict", "bench"):  # the commands that make a session
            require_submitted_master(cfg)  # under spark-submit: its --master and spark.master agree
        if args.command == "doctor":
            return run_doctor(cfg)
        if args.command == "promote":
            print(json.dumps(promote_version(cfg, args.version)))
            return 0
        if args.command == "export":
            from pipeline.serving.export import export_model  # local: torch and mlflow, out of the other commands

            print(json.dumps(export_model(cfg, args.model, args.format, args.out)))
            return 0
        if args.command == "cache":
            if args.action == "ls":
                print(json.dumps({"cache_dir": cfg.data.cache_dir, "entries": list_entries(cfg.data.cache_dir)}))
            else:
                print(json.dumps({"cache_dir": cfg.data.cache_dir,
                                  **clear(cfg.data.cache_dir, args.key, force=args.force)}))
            return 0
        if args.command == "bench":
            missing = _checkout_bench()
            if missing:
                raise ConfigError(missing)
            only = args.only.split(",") if args.only else None
            if args.gpu:
                from bench.gpu import run_gpu_bench  # the checkout's bench/, beside the package: not in the library

                print(json.dumps({"out": run_gpu_bench(cfg, args.out, quick=args.quick, only=only)["out"]}))
                return 0
            from bench import run_bench  # the checkout's bench/, beside the package: not in the library

            print(json.dumps(run_bench(cfg, quick=args.quick, out=args.out, only=only)))
            return 0
        if args.command == "predict":
            # pyspark (pandas with it) loads here first; MLflow and torch, which predict needs after Spark is up, then
            # load on a thread while this one waits for the JVM to start
            import pyspark.sql  # noqa: F401

            preload.start(("mlflow", "torch"))
        if args.command in ("train", "tune"):
            # MLflow loads on a thread while this one pins the table and looks up the converted data; the JVM starts
            # only if Spark has work to do (a conversion, or a launch that needs the session). torch is not needed
            # here before the ranks return (workflow.train_in_run loads it then, for the promotion gate)
            preload.start(("mlflow",))
            with spark_on_demand(cfg) as spark:
                if args.command == "tune":
                    trials = trials_asked(args.trials, args.overrides, cfg)
                    print(json.dumps(run_tune(spark, cfg, args.space, trials, args.timeout, args.resume)), flush=True)
                    return 0
                summary = train(spark, cfg, run_name=args.run_name)
                print(json.dumps(summary), flush=True)
                if summary.get("offline_run"):  # trained, but MLflow never came back: nothing registered yet
                    log.error("MLflow unreachable: run kept in %s; upload it with `lakehouse sync-run %s` (adding "
                              "`mlflow.tracking_uri=<the URI with its credentials>` if the URI holds credentials: "
                              "the folder keeps it redacted)", summary["offline_run"], summary["offline_run"])
                    return 3
                return 0
        with spark_session(cfg) as spark:
            if args.command == "ingest":
                result = ingest(spark, cfg, args.source, args.mode)
                log.info("Delta table %s is now at version %d", result["delta_table"], result["delta_version"])
                print(json.dumps(result))
                return 0
            if args.command == "predict":
                print(json.dumps(predict_table(spark, cfg, args.model, args.table, args.out, args.version, args.mode,
                                               run_key=args.run_key)))
                return 0
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except Exception as exc:
        if isinstance(exc, Terminated):
            log.error("terminated: %s", exc)
            return 143
        log.error("%s: %s", type(exc).__name__, exc)
        if os.environ.get("LAKEHOUSE_DEBUG"):
            raise
        return 1
    return 0


def _checkout_bench() -> Optional[str]:
    """Make the checkout's `bench` package importable here and in the processes it starts (Horovod and torchrun ranks
    unpickle bench functions by reference); None, or what is missing. The bench is not part of the installed library:
    it sits beside `pipeline/` in a checkout, and an editable install maps only `pipeline`, so from another folder
    the checkout (the parent of the package folder) goes first on sys.path and PYTHONPATH for this command."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "bench", "__init__.py")):
        return (f"lakehouse bench needs the checkout's bench/ package beside pipeline/ (looked in {root}); this "
                "install has the library only: run it from a git checkout installed with `pip install -e .`")
    if root not in sys.path:
        sys.path.insert(0, root)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return None


def _exit_past_abandoned_launches(rc: int) -> int:
    """`rc`, or exit the process with it now when a launch given up on left threads waiting on a lost host (the
    interpreter would wait for them at exit, for minutes): the job's outcome is already printed and recorded, an
    elastic relaunch's success too."""
    spark_tasks = sys.modules.get("pipeline.distributed.backends.spark_tasks")  # loaded by a launch in this process
    if spark_tasks is None:  # no launch: nothing to import
        return rc
    left = spark_tasks.abandoned_threads()
    if not left:
        return rc
    log.warning("exiting without %d launcher thread(s) still waiting on a lost host", len(left))
    flush_and_exit(rc)


if __name__ == "__main__":
    console()
