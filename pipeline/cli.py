"""`lakehouse` command line: parse arguments, load the config, call one pipeline function, print its result."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

from pipeline import preload
from pipeline.config import ConfigError, load_config
from pipeline.data.cache import clear, list_entries
from pipeline.doctor import run_doctor
from pipeline.errors import Terminated
from pipeline.lakehouse.source import IngestError
from pipeline.lakehouse.spark import require_submitted_master, spark_on_demand, spark_session
from pipeline.log import flush_and_exit, get_logger, setup_logging
from pipeline.serving.predict import predict_table
from pipeline.tune.sweep import run_tune, trials_asked
from pipeline.workflow import ingest, promote_version, sync_run, train

log = get_logger("lakehouse")

DEFAULT_CONF = os.environ.get("LAKEHOUSE_CONF", "conf/local.yaml")


def _add_conf(p: argparse.ArgumentParser, default: Optional[str] = DEFAULT_CONF) -> None:
    """`--conf` and the overrides. `default` SUPPRESS: a `--conf` given before a sub-action (`cache --conf F ls`)
    is kept, where this parser's default would otherwise overwrite it (argparse copies a sub-parser's defaults over
    its parent's values)."""
    p.add_argument("--conf", default=default, help="YAML profile (merged over base.yaml beside it)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.np=-2 data.batch_size=32; "
                                                "anywhere after the command, between options too")


def _command(sub, name: str, **kwargs) -> argparse.ArgumentParser:
    """A sub-command's parser that records itself in the arguments it parses (`command_parser`), so errors found
    after parsing are reported as argparse reports its own: the command's usage, then exit status 2."""
    p = sub.add_parser(name, **kwargs)
    p.set_defaults(command_parser=p)
    return p


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count or a size of 0 would write nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _bench_names() -> Optional[Dict[str, Sequence[str]]]:
    """The names `bench --only` accepts, from the lists the bench checks them against (its one source), or None
    where this install has no bench/. Read only when `bench --help` is printed: the bench lives beside the package,
    in a checkout, and no other command needs it."""
    root = _checkout_root()
    if not _has_bench(root):
        return None
    if root not in sys.path:  # this process's alone (`_checkout_bench` also sets PYTHONPATH, for the ranks)
        sys.path.insert(0, root)
    from bench import MEASUREMENTS, STANDALONE  # local: the checkout's bench/, beside the package (not the library)
    from bench.gpu import GPU_PARTS  # local: as above

    return {"measurements": MEASUREMENTS, "standalone": STANDALONE, "gpu": GPU_PARTS}


class _BenchHelp(argparse.HelpFormatter):
    """`bench --help`: `--only`'s help names what `--only` accepts, filled in from the bench's own lists when the help
    is printed (a copy written into the help went stale: it lacked split_digest)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = super()._get_help_string(action)
        if action.dest != "only" or text is None:
            return text
        names = _bench_names()
        if names is None:
            return text.format(measurements="the names of the checkout's bench/, which this install lacks",
                               standalone="the standalone ones", gpu="the GPU parts")
        return text.format(measurements=", ".join(names["measurements"]),
                           standalone=_either(names["standalone"]), gpu=", ".join(names["gpu"]))


def _either(names: Sequence[str]) -> str:
    """`a, b or c`."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lakehouse",
                                     description="Delta Lake -> Petastorm -> Lightning/Horovod -> MLflow")
    sub = parser.add_subparsers(dest="command", required=True)

    # --size, --classes and --seed default to None: an option given with the kind it does not apply to is refused
    # (pipeline.lakehouse.sample_data.render_sample), not ignored
    p = _command(sub, "sample-data", help="write a class-per-folder image tree to ingest: scikit-learn's digits as "
                                          "PNGs, or synthetic ImageNet-shaped JPEG photos")
    p.add_argument("--kind", choices=["digits", "photos"], default="digits",
                   help="digits: the 1,797 8x8 scans enlarged to --size; photos: RGB JPEGs of about 400x350, "
                        "quality 90")
    p.add_argument("--out", default=None, help="the folder (default: work/sample/<kind>)")
    p.add_argument("--size", type=_positive, default=None, help="digits only: the side in pixels (default 32)")
    p.add_argument("--limit", "--count", dest="count", type=_positive, default=None,
                   help="how many images (digits: at most 1,797, default all; photos: default 1000)")
    p.add_argument("--classes", type=_positive, default=None, help="photos only: how many classes (default: all 5)")
    p.add_argument("--seed", type=int, default=None, help="photos only: the same seed writes the same files "
                                                          "(default 0)")

    p = _command(sub, "ingest", help="image folder -> one Delta commit")
    p.add_argument("--source", required=True, help="folder with one sub-folder per class")
    p.add_argument("--mode", choices=["append", "overwrite"], default="append")
    _add_conf(p)

    p = _command(sub, "train", help="train on the pinned Delta table; prints one JSON line at the end")
    p.add_argument("--run-name", default=None)
    _add_conf(p)

    p = _command(sub, "promote", help="move the champion alias to a version if it beats the champion")
    p.add_argument("--version", type=int, default=None,
                   help="model version (default: the latest); one the model does not have is refused, naming its "
                        "versions")
    _add_conf(p)

    p = _command(sub, "predict", help="score a pinned Delta table with a registered model; one Delta commit")
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

    p = _command(sub, "export", help="export a registered model version to ONNX or TorchScript with its contract")
    p.add_argument("--model", required=True, help="models:/<name>@<alias> or models:/<name>/<version>")
    p.add_argument("--format", choices=["onnx", "torchscript"], required=True)
    p.add_argument("--out", default=None, help="folder for the files (default: only logged to the run)")
    _add_conf(p)

    p = _command(sub, "tune", help="Optuna sweep over a search space; each trial a train in an MLflow child run")
    p.add_argument("--space", default=None, help="search space YAML (conf/search/<name>.yaml)")
    p.add_argument("--trials", type=int, default=None,
                   help="trials in the study, >= 1 (sets tune.n_trials; default: tune.n_trials, or on --resume the "
                        "study's own count unless tune.n_trials=N is given)")
    p.add_argument("--timeout", type=float, default=None,
                   help="start no trial after this many seconds, > 0 (sets tune.timeout_s)")
    p.add_argument("--resume", default=None, metavar="STUDY", help="continue this study: only the missing trials")
    _add_conf(p)

    p = _command(sub, "cache", help="the converted-data cache (data.cache_dir): list entries or clear them",
                 epilog="--conf goes before the action or after it; key=value overrides after the action. `lakehouse "
                        "cache clear --help` for clear's options (--key K, repeatable; --force)")
    p.add_argument("--conf", default=DEFAULT_CONF, help="YAML profile (merged over base.yaml beside it)")
    actions = p.add_subparsers(dest="action", required=True)
    _add_conf(_command(actions, "ls", help="entries, most recently used first, with size and source table"),
              default=argparse.SUPPRESS)
    p = _command(actions, "clear", help="delete entries: all, or those named by --key K (repeatable); an entry a "
                                        "running job holds is kept and named with its holder (job, pid, host), "
                                        "unless --force")
    p.add_argument("--key", action="append", default=None, help="clear only this entry (repeatable)")
    p.add_argument("--force", action="store_true", help="delete held entries too (their jobs then fail reading them)")
    _add_conf(p, default=argparse.SUPPRESS)

    p = _command(sub, "sync-run", help="upload a run left offline (the tracking server was down) to MLflow")
    p.add_argument("folder", help="the run's folder (<job dir>/offline_run, named by `lakehouse train`)")
    p.add_argument("overrides", nargs="*", help="e.g. mlflow.tracking_uri=http://host:5000 (default: the run's)")

    p = _command(sub, "doctor", help="check the installed stack")
    _add_conf(p)

    p = _command(sub, "bench", help="measure loader, conversion, scaling and overhead ratios",
                 formatter_class=_BenchHelp)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (proves it runs)")
    p.add_argument("--out", default="work/bench/bench.json")
    p.add_argument("--only", default=None, metavar="M[,M...]",
                   help="run only these measurements ({measurements}); the conversion always runs, unless only "
                        "{standalone} are asked for. With --gpu: {gpu}")
    p.add_argument("--gpu", action="store_true",
                   help="the GPU figures alone (images/s per GPU per architecture and precision, Lightning / plain "
                        "loop, input-bound fraction) on a data set written with pyarrow, and ImageNet-shaped photos "
                        "(loader alone with decode=cpu|gpu, timm resnet50/resnet18 at 224 px bf16): no Spark or Java "
                        "needed")
    _add_conf(p)
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line, with a command's `key=value` overrides taken anywhere after the command, between its options
    too (`doctor train.np=1 --conf F train.max_epochs=2`).

    argparse gives a positional `nargs="*"` one block of tokens, and refuses the ones typed after an option that
    follows it; `parse_intermixed_args`, which would take them, refuses a parser with sub-commands (TypeError on
    Python 3.11). So the tokens the command's parser leaves over are read here: those that are not options are more
    overrides, kept in the order typed (the last of a key wins, as in one block; the config's loader refuses one not
    of the form key=value, naming it); an option no parser knows is refused with the command's usage (exit 2), and so
    is any leftover of a command that takes no overrides."""
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        options = [t for t in extra if t.startswith("-")]
        if options or not hasattr(args, "overrides"):
            args.command_parser.error(f"unrecognized arguments: {' '.join(options or extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


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
    args = parse_args(argv)
    try:
        if args.command == "sample-data":
            from pipeline.lakehouse.sample_data import SampleOptionError, render_sample  # local: numpy, its alone

            try:
                out, counts = render_sample(args.kind, args.out, args.count, size=args.size, classes=args.classes,
                                            seed=args.seed)
            except SampleOptionError as exc:  # an option the kind does not take, or out of range: a usage error
                args.command_parser.error(str(exc))
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
        if args.command == "ingest" and not os.path.isdir(args.source):  # said before a JVM starts (~15 s here)
            raise IngestError(f"ingest source {args.source} is not a folder")
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


def _checkout_root() -> str:
    """The folder holding the package folder: in a checkout, the one the bench sits in beside `pipeline/`."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_bench(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "bench", "__init__.py"))


def _checkout_bench() -> Optional[str]:
    """Make the checkout's `bench` package importable here and in the processes it starts (Horovod and torchrun ranks
    unpickle bench functions by reference); None, or what is missing. The bench is not part of the installed library:
    it sits beside `pipeline/` in a checkout, and an editable install maps only `pipeline`, so from another folder
    the checkout (the parent of the package folder) goes first on sys.path and PYTHONPATH for this command."""
    root = _checkout_root()
    if not _has_bench(root):
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
