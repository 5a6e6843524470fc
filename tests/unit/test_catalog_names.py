"""Delta tables named by a three-level catalog name (Unity Catalog) beside paths."""
import pytest

from pipeline.lakehouse.delta import DeltaError, DeltaRsEngine, catalog_name, local_path


@pytest.mark.parametrize("table", ["main.ml.images", "main.`ml-data`.images", "hive_metastore.default.digits"])
def test_three_level_names_are_catalog_names(table):
    assert catalog_name(table) == table
    assert local_path(table) is None


@pytest.mark.parametrize("table", ["work/delta/digits", "/Volumes/main/ml/lakehouse/images", "digits",
                                   "s3://bucket/a.b.c", "dbfs:/mnt/a.b.c", "ml.images", "./a.b.c", "a.b.c.d"])
def test_paths_and_other_names_are_not(table):
    assert catalog_name(table) is None


def test_an_existing_folder_with_a_dotted_name_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.b.c").mkdir()
    assert catalog_name("a.b.c") is None and local_path("a.b.c") == str(tmp_path / "a.b.c")


def test_delta_rs_refuses_a_catalog_name_saying_what_to_do():
    with pytest.raises(DeltaError, match=r"'delta.table': 'main.ml.images' is a catalog table name.*delta.engine=spark"):
        DeltaRsEngine().exists(None, "main.ml.images")
    with pytest.raises(DeltaError, match="catalog table name"):
        DeltaRsEngine().latest_version(None, "main.ml.images")


def test_the_gate_on_a_catalog_name_without_spark_says_where_to_run_it(monkeypatch):
    import pipeline.lakehouse.spark as spark_module
    from pipeline.tracking.heldout import held_out_rows
    from pipeline.tracking.registry import RegistryError

    # no session in this process (other tests may hold one, active in a thread or the default)
    monkeypatch.setattr(spark_module, "active_session", lambda: None)

    with pytest.raises(RegistryError, match="main.ml.images is a catalog name.*Spark session"):
        held_out_rows("main.ml.images", 3, 0.2)
