"""A timm backbone through the main job on CPU: `lakehouse sample-data`, `ingest`, then `lakehouse train
model.arch=timm/resnet18 model.pretrained=<local file>` on 2 DDP ranks, to a registered model version (the vision venv
of `make test` has no Horovod build; Horovod is tested with every other network, and on the GPU with timm).
The vision tier (.venv-vision: the whole pipeline beside timm and a torchvision built for its torch)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT

try:
    import timm  # imports torchvision, which must be built for this torch
except Exception as exc:  # ImportError, or torchvision's RuntimeError beside a torch it was not built for
    timm = None
    WHY = f"timm/torchvision not importable beside torch {torch.__version__} ({type(exc).__name__}); " \
          f"run in .venv-vision (scripts/setup_vision.sh)"

pytestmark = [pytest.mark.vision, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(timm is None, reason=WHY if timm is None else "")]

# the lakehouse script of the venv running the tests (as conftest's cli() now gives too)
LAKEHOUSE = str(Path(sys.executable).parent / "lakehouse")
CONTRACT_KEYS = {"run_id", "model_name", "model_version", "delta_table", "delta_version", "rows_train", "rows_val",
                 "world_size", "backend", "val_loss", "val_acc", "epochs", "stopped_early"}


def _run(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run([LAKEHOUSE, *args], capture_output=True, text=True, timeout=timeout, cwd=tmp)
    (tmp / f"{args[0]}.log").write_text(out.stderr)
    assert out.returncode == 0, f"lakehouse {args[0]} exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


def _imagenet_resnet18_file(path: Path) -> dict:
    """timm's resnet18 as its ImageNet weights are laid out (3 channels, 1000 classes), random but seeded, written
    offline as a safetensors file; returns its tensors."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {k: v.detach().clone().contiguous()
             for k, v in timm.create_model("resnet18", pretrained=False).state_dict().items()}
    save_file(state, str(path))
    return state


def test_timm_resnet18_pretrained_trains_on_two_ddp_ranks_and_registers(tmp_path):
    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    weights = tmp_path / "resnet18.safetensors"
    pretrained = _imagenet_resnet18_file(weights)
    table = tmp_path / "delta" / "digits"
    paths = [f"delta.table={table}", f"data.cache_dir={tmp_path}/cache", f"train.checkpoint_dir={tmp_path}/ckpt",
             f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db", f"mlflow.artifact_location={tmp_path}/artifacts",
             "mlflow.experiment=timm", "mlflow.registered_model=digits-timm"]
    conf = ["--conf", str(ROOT / "conf/local.yaml")]
    _run(tmp_path, "sample-data", "--out", str(tmp_path / "images"), "--limit", "300")
    _run(tmp_path, "ingest", "--source", str(tmp_path / "images"), "--mode", "overwrite", *conf, *paths)
    # 32x32 greyscale digits: the file's 3-channel stem is adapted, its 1000-class head re-initialised for 10 classes,
    # and the backbone is kept at 32x32 (its pretrained config asks for 224). The frozen backbone must come out of
    # training exactly as the file has it, which shows every rank loaded the file.
    out = _run(tmp_path, "train", *conf, *paths, "model.arch=timm/resnet18", f"model.pretrained={weights}",
               "model.input_size=32", "model.freeze_backbone=true", "model.lr=0.05", "train.np=-2", "train.backend=ddp",
               "train.max_epochs=2", "train.warmup_epochs=0", "data.batch_size=16")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert CONTRACT_KEYS <= set(summary)
    assert summary["world_size"] == 2 and summary["backend"] == "ddp" and summary["epochs"] == 2
    assert summary["rows_train"] + summary["rows_val"] == 300 and summary["delta_version"] == 0
    log = (tmp_path / "train.log").read_text()
    assert "re-initialised (1000 classes in" in log and "adapted to 1 input channel" in log

    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.arch"] == "timm/resnet18" and params["model.pretrained"] == str(weights)
    assert params["train.np"] == "-2" and run.data.tags["world_size"] == "2"
    for metric in ("train_loss", "val_loss", "val_acc"):
        history = client.get_metric_history(run.info.run_id, metric)
        assert len(history) == 2 and all(m.value == m.value for m in history), metric  # one per epoch, not NaN
    ranks = json.load(open(client.download_artifacts(run.info.run_id, "ranks.json", str(tmp_path))))
    # DDP's launcher hands back rank 0's result, as TorchDistributor does; DDP keeps the ranks' weights equal itself
    assert [r["rank"] for r in ranks] == [0] and ranks[0]["weights_digest"]

    versions = client.search_model_versions("name='digits-timm'")
    assert len(versions) == 1 and str(versions[0].version) == str(summary["model_version"])
    assert versions[0].run_id == run.info.run_id and versions[0].tags["run_id"] == run.info.run_id

    # the registered version rebuilds the timm network offline (no weights file) and predicts label names
    mlflow.set_tracking_uri(summary["tracking_uri"])
    model = mlflow.pyfunc.load_model(f"models:/digits-timm/{versions[0].version}")
    net = model.unwrap_python_model().network
    assert type(net).__name__ == "TimmClassifier" and net.timm_name == "resnet18"
    state = net.model.state_dict()
    assert state["fc.weight"].shape == (10, 512) and not torch.equal(state["fc.weight"], pretrained["fc.weight"][:10])
    assert torch.equal(state["conv1.weight"], pretrained["conv1.weight"].sum(dim=1, keepdim=True))
    for key, tensor in pretrained.items():  # the frozen backbone, BatchNorm statistics included
        if not key.startswith(("fc.", "conv1.")):
            assert torch.equal(state[key], tensor), key
    images = sorted((tmp_path / "images").rglob("*.png"))[:8]
    pred = model.predict(pd.DataFrame({"content": [p.read_bytes() for p in images]}))
    assert len(pred) == 8 and pred["label"].notna().all()
