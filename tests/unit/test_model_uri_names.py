"""`models:/<name>/latest` resolves a registered model whatever quote characters its name holds: MLflow's search filter
has no escape inside a quoted value, so the name was pasted into `name='...'` and `models:/bob's/latest` failed with
MLflow's "Invalid clause(s) in filter string" (and its error message listed no versions, for the same reason)."""
import pytest
from mlflow import MlflowClient

from pipeline.serving.models import ModelNotFound, resolve

NAMES = ["bob's", 'say "hi"', "both ' and \"", "x' OR name LIKE '%", "plain"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db", registry_uri=f"sqlite:///{root}/mlflow.db")
    for i, name in enumerate(NAMES):
        client.create_registered_model(name)
        for _ in range(i + 2):  # each its own count of versions: a filter that matched another name would show
            client.create_model_version(name, str(root / "nowhere"))
    client.create_registered_model("bobXs")  # what a LIKE-style or unquoted match could pick up instead
    for _ in range(9):
        client.create_model_version("bobXs", str(root / "nowhere"))
    return client


@pytest.mark.parametrize("name", NAMES)
def test_latest_resolves_a_name_with_quotes(client, name):
    pinned = resolve(client, f"models:/{name}/latest")
    assert (pinned.name, pinned.version) == (name, str(NAMES.index(name) + 2))
    assert resolve(client, f"models:/{name}/1").version == "1"


@pytest.mark.parametrize("name", NAMES)
def test_a_missing_version_of_a_quoted_name_lists_its_versions(client, name):
    with pytest.raises(ModelNotFound) as err:
        resolve(client, f"models:/{name}/99")
    count = NAMES.index(name) + 2
    assert f"(model {name!r} has versions {list(range(1, count + 1))}, aliases none)" in str(err.value), err.value


def test_names_filters_match_only_their_own_name():
    from pipeline.tracking.registry import name_filter

    assert name_filter("plain") == "name='plain'"
    assert name_filter("bob's") == 'name="bob\'s"'
    assert name_filter("both ' and \"") is None
