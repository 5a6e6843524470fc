"""load_pyfunc leaves sys.path as it was (MLflow prepends a logged model's code folder for good)."""
import sys

import mlflow.pyfunc


class _Echo(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        return model_input


def test_loading_a_model_with_code_keeps_sys_path(tmp_path):
    from pipeline.tracking.pyfunc import load_pyfunc

    code = tmp_path / "code" / "pipeline"
    code.mkdir(parents=True)
    (code / "__init__.py").write_text("")  # a partial copy of the package, as the served model ships
    path = str(tmp_path / "model")
    mlflow.pyfunc.save_model(path, python_model=_Echo(), code_paths=[str(code)])
    before = list(sys.path)
    try:
        model = load_pyfunc(path)
        assert sys.path == before
        assert list(model.predict([[1, 2]])) == [[1, 2]]
        mlflow.pyfunc.load_model(path)  # what load_pyfunc guards against
        assert sys.path != before and sys.path[0].endswith("code")
    finally:
        sys.path[:] = before
