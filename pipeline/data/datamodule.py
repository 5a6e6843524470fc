"""The LightningDataModule: the train and val reader loops of one rank (shard = rank) over converted Delta data or
the table's own files (data.source=direct: a DirectData, read by the same loaders)."""
from __future__ import annotations

from typing import List, Optional

import pytorch_lightning as pl

from pipeline.config import DataConfig
from pipeline.data.gpu_decode import make_decoder
from pipeline.data.loader import ShardLoader
from pipeline.data.readers import load_reader
from pipeline.data.shards import ConvertedData
from pipeline.log import get_logger

log = get_logger(__name__)


class LakehouseDataModule(pl.LightningDataModule):
    """Loaders for shard `rank` of `world_size` over converted Delta data."""

    def __init__(self, data: ConvertedData, rank: int = 0, world_size: int = 1,
                 data_cfg: Optional[DataConfig] = None, normalize_on_device: bool = False,
                 track_ids: bool = False) -> None:
        super().__init__()
        if data.plan.train.world_size != world_size:
            raise ValueError(f"the shard plan was made for {data.plan.train.world_size} rank(s), "
                             f"this job has {world_size}")
        c = data_cfg or DataConfig()
        load_reader(c.reader)
        self.data = data
        self.rank = rank
        self.world_size = world_size
        self.decode_used = decode_in_rank(data, c, rank)
        kw = dict(rank=rank, world_size=world_size, channels=data.channels, image_size=data.image_size,
                  workers=c.reader_workers, seed=c.seed + rank, reader=c.reader, track_ids=track_ids,
                  normalize_on_device=normalize_on_device)

        def decoder(train: bool):
            if self.decode_used == "convert":
                return None
            return make_decoder(self.decode_used, data.image_size, data.channels, train, c.seed + rank, world_size,
                                c.decode_workers, pin=normalize_on_device, channels_last=c.channels_last,
                                cpu_share=c.decode_cpu_share)

        self.train_loader = ShardLoader(data.train, data.plan.train, endless=True, shuffle_buffer=c.shuffle_buffer,
                                        memory_cache_mb=c.memory_cache_mb, decoder=decoder(True), **kw)
        left_mb = c.memory_cache_mb - (self.train_loader.shard_mb() if self.train_loader.keeps_in_memory else 0)
        self.val_loader = ShardLoader(data.val, data.plan.val, endless=False, shuffle_buffer=0,
                                      memory_cache_mb=left_mb, decoder=decoder(False), **kw)  # one budget per rank

    @property
    def class_names(self) -> List[str]:
        return self.data.class_names

    def train_dataloader(self) -> ShardLoader:
        return self.train_loader

    def val_dataloader(self) -> ShardLoader:
        return self.val_loader

    def teardown(self, stage: str) -> None:
        self.train_loader.close()
        self.val_loader.close()


def decode_in_rank(data: ConvertedData, c: DataConfig, rank: int) -> str:
    """Where this rank decodes: convert (the split holds pixels), else data.decode resolved here (auto: gpu on a CUDA
    rank with torchvision, else cpu). The converted layout and the key must agree.

    Raises:
        ValueError: the converted data was made for the other setting of data.decode (naming the key).
    """
    from pipeline.data.gpu_decode import resolve_decode

    encoded = data.layout == "encoded"
    if encoded != (c.decode != "convert"):
        raise ValueError(f"config key 'data.decode' is {c.decode!r} but the converted data holds "
                         f"{'encoded images' if encoded else 'decoded pixels'}; convert with the same data.decode")
    if not encoded:
        return "convert"
    used = resolve_decode(c.decode)
    if rank == 0:
        where = ("on its GPU with nvJPEG (other formats on the CPU" +
                 (f"; {c.decode_cpu_share:g} of each batch in the CPU's decode workers)" if c.decode_cpu_share else ")")
                 if used == "gpu" else "on the CPU (libjpeg-turbo, Pillow for other formats; data.decode_workers > 1: "
                                       "in worker processes)")
        log.info("data.decode=%s: rank 0 decodes %s, the ImageNet recipe at %d px (train: random resized crop and "
                 "flip; val: center crop)", c.decode, where, data.image_size)
    return used


def make_datamodule(data: ConvertedData, rank: int, world_size: int, data_cfg: Optional[DataConfig] = None,
                    normalize_on_device: bool = False, track_ids: bool = False) -> LakehouseDataModule:
    """The data module of rank `rank`; loader settings from `data_cfg` (the data.* config keys).

    `normalize_on_device`: batches are uint8 (pinned where CUDA is present) and the model normalises them on its
    device. `track_ids`: the loaders record the row ids they hand out (tests, accounting).
    """
    return LakehouseDataModule(data, rank, world_size, data_cfg, normalize_on_device, track_ids)
