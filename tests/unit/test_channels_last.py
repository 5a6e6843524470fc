"""data.channels_last: the model's network is NHWC like its batches, from before training to the end of it, and
trains to the same numbers as the default layout."""
from __future__ import annotations

import pytorch_lightning as pl
import torch

from pipeline.config import ModelConfig
from pipeline.model.module import ImageClassifier


def _convs(model):
    return [m.weight for m in model.network.modules() if isinstance(m, torch.nn.Conv2d)]


def _fit(channels_last: bool):
    torch.manual_seed(0)
    model = ImageClassifier.from_config(ModelConfig(arch="resnet", width=4, optimizer="sgd", lr=0.1), 3, 4, 0.1,
                                        steps_per_epoch=4, max_epochs=1, channels_last=channels_last)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 4, (32,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    return model


def test_channels_last_network_stays_nhwc_through_fit_and_trains_like_the_default():
    nhwc, nchw = _fit(True), _fit(False)
    assert _convs(nhwc) and all(w.dim() == 4 and w.is_contiguous(memory_format=torch.channels_last)
                                and not w.is_contiguous() for w in _convs(nhwc) if w.shape[-1] > 1)
    assert all(w.is_contiguous() for w in _convs(nchw))
    for a, b in zip(nhwc.network.state_dict().values(), nchw.network.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-4), "the layout changed what was learned"
