"""How the 2026-11-28 CPU step-overhead notes in docs/PERFORMANCE.md were taken (run from the checkout's root with
the classic venv, LAKEHOUSE_PROGRESS=0):

    python docs/bench/2026-11-28-step-overhead-cpu/manual_vs_auto.py hvd|single auto|manual [prof]

One process, one Horovod rank of one (hvd) or Lightning's single-device strategy (single), the tiny cnn of
`lakehouse bench --only step_overhead` on the same in-memory batches: three times a 400-step window of the plain loop
then of train() (ms per step, wall); with `prof`, one more train() under cProfile, the CPU ms per step by bucket and
the largest functions. `manual`: the ImageClassifier patched to Lightning's manual optimization (zero_grad,
manual_backward, step and the scheduler's step in training_step), an experiment, not the product."""
import cProfile
import pstats
import sys
import tempfile

sys.path.insert(0, ".")
from pipeline.log import setup_logging  # noqa: E402

setup_logging()
import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

from bench.datasets import converted_without_spark  # noqa: E402
from bench.lightning_path import timed_train  # noqa: E402
from bench.reference import memory_batch_list  # noqa: E402
from bench.step_overhead import BATCH, CHANNELS, CLASSES, IMAGE_SIZE, plain_loop, tiny  # noqa: E402
from bench.step_profile import per_step  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.distributed.horovod_strategy import HorovodStrategy  # noqa: E402
from pipeline.model import module  # noqa: E402

if "manual" in sys.argv:
    module.ImageClassifier.automatic_optimization = property(lambda self: False)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        self._accumulate("train", loss, logits, y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return loss

    module.ImageClassifier.training_step = training_step

hvd.init()
torch.set_num_threads(1)
cfg = tiny(load_config("conf/local.yaml", []))
data = converted_without_spark(tempfile.mkdtemp(), BATCH * 2 * 256, IMAGE_SIZE, CHANNELS, CLASSES, batch_size=BATCH)
batches = list(memory_batch_list(data, batch_size=BATCH))
make = HorovodStrategy if sys.argv[1] == "hvd" else (lambda: None)


def run(steps):
    return timed_train(cfg, data, 0, 1, make, 50, steps, 1, batches=batches, precision="32-true",
                       train_kwargs={"local_rank": 0, "local_world_size": 1})


run(200)
res = {}
for _ in range(3):
    for name, fn in (("plain", lambda: plain_loop(cfg, data, batches, "32-true", 50, 400, 1, backend="horovod")),
                     ("train", lambda: run(400))):
        res.setdefault(name, []).append(round(1000 * fn()["window_s"][0] / 400, 3))
print(sys.argv[1:], res)
if "prof" in sys.argv:
    prof = cProfile.Profile()
    prof.enable()
    run(400)
    prof.disable()
    p = per_step(pstats.Stats(prof), 450)
    print(p["buckets"])
    for k, v in sorted(p["functions"].items(), key=lambda kv: -kv[1][1])[:45]:
        print(round(v[1], 4), round(v[0], 2), k[-100:])
