"""The LightningDataModule: the train and val reader loops of one rank (shard = rank) over converted Delta data."""
from __future__ import annotations

from typing import List, Optional

import pytorch_lightning as pl

from pipeline.config import DataConfig
from pipeline.data.loader import ShardLoader
from pipeline.data.readers import load_reader
from pipeline.data.shards import ConvertedData


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
        kw = dict(rank=rank, world_size=world_size, channels=data.channels, image_size=data.image_size,
                  workers=c.reader_workers, seed=c.seed + rank, reader=c.reader, track_ids=track_ids,
                  normalize_on_device=normalize_on_device)
        self.train_loader = ShardLoader(data.train, data.plan.train, endless=True, shuffle_buffer=c.shuffle_buffer,
                                        memory_cache_mb=c.memory_cache_mb, **kw)
        left_mb = c.memory_cache_mb - (self.train_loader.shard_mb() if self.train_loader.keeps_in_memory else 0)
        self.val_loader = ShardLoader(data.val, data.plan.val, endless=False, shuffle_buffer=0,
                                      memory_cache_mb=left_mb, **kw)  # one budget per rank: train first, then val

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


def make_datamodule(data: ConvertedData, rank: int, world_size: int, data_cfg: Optional[DataConfig] = None,
                    normalize_on_device: bool = False, track_ids: bool = False) -> LakehouseDataModule:
    """The data module of rank `rank`; loader settings from `data_cfg` (the data.* config keys).

    `normalize_on_device`: batches are uint8 (pinned where CUDA is present) and the model normalises them on its
    device. `track_ids`: the loaders record the row ids they hand out (tests, accounting).
    """
    return LakehouseDataModule(data, rank, world_size, data_cfg, normalize_on_device, track_ids)
