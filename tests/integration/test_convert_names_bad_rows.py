"""data.decode=convert on a table holding one truncated JPEG: the conversion (Spark's Python workers decode every row)
fails with an error that names that row's path and what the decoder said, not a wrapped Spark job failure naming no
row. Real Spark local[2] and a real Delta table written with deltalake."""
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BAD = "/photos/cat/truncated-07.jpg"


def _jpeg(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (24, 24, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


def test_an_undecodable_image_fails_the_conversion_naming_its_row(spark, tmp_path):
    from deltalake import write_deltalake

    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.data.shards import LAYOUTS, ConversionError
    from pipeline.lakehouse.delta import get_engine

    rows = []
    for i in range(16):
        label = ("cat", "dog")[i % 2]
        content = _jpeg(i)
        path = BAD if i == 7 else f"/photos/{label}/ok-{i:02d}.jpg"
        if path == BAD:
            content = content[:len(content) // 2]  # truncated: the header reads, the pixels do not
        rows.append({"path": path, "label": label, "label_index": i % 2, "width": 24, "height": 24, "mode": "RGB",
                     "content": content})
    table = tmp_path / "delta" / "photos"
    write_deltalake(str(table), pa.Table.from_pylist(rows))
    cfg = make_config(tmp_path, f"delta.table={table}", "data.decode=convert", "data.image_size=16",
                      "data.channels=3")
    df, pinned = get_engine("delta-rs").read(spark, str(table))

    with pytest.raises(ConversionError) as err:
        convert_for_training(spark, df, cfg, 1, class_names_of(df), pinned)
    message = str(err.value)
    assert BAD in message, message[-3000:]
    assert "Truncated File Read" in message  # what the decoder said
    assert "Traceback" not in message and len(message) < 2000, message  # the row, not Spark's wrapping

    # the row repaired (removed): the same conversion writes decoded pixels and no path, as before
    write_deltalake(str(table), pa.Table.from_pylist([r for r in rows if r["path"] != BAD]), mode="overwrite")
    df, pinned = get_engine("delta-rs").read(spark, str(table))
    data = convert_for_training(spark, df, cfg, 1, class_names_of(df), pinned)
    assert data.layout == "pixels" and sum(data.train.row_group_rows) + sum(data.val.row_group_rows) == 15
    for url in data.train.file_urls + data.val.file_urls:
        assert pq.read_schema(url[len("file://"):]).names == list(LAYOUTS["pixels"])
