import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from http_server import serving, stop

from pipeline.config import apply_overrides

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Where the budget marks a project's budget as started (budget.started_mark): the tests' own, not the home's.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="dpfm-test-state-")
atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], ignore_errors=True)  # one per test process
# DVC's user and machine config (a cache.dir set there is the one DVC uses): the tests' own, empty.
for name in ("DVC_GLOBAL_CONFIG_DIR", "DVC_SYSTEM_CONFIG_DIR"):
    os.environ[name] = tempfile.mkdtemp(prefix="dpfm-test-dvc-config-")
    atexit.register(shutil.rmtree, os.environ[name], ignore_errors=True)
# The helper modules' asserts report their values as a test's own do.
pytest.register_assert_rewrite("fault_hooks", "shard_data")


def pytest_collection_modifyitems(items):
    """dp.compile's tests, every test whose name or parameters say compile, are a tier of their own
    (`make test-compiled`): Dynamo's tracing, 7 minutes or more on 2 cores."""
    for item in items:
        if "compile" in item.nodeid.lower():
            item.add_marker(pytest.mark.compiled)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a scratch project directory holding the schema and default params."""
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas/params.schema.yaml").write_text((ROOT / "schemas/params.schema.yaml").read_text())
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Private/eval shards and a tokenizer at stage_runs.MICRO scale, made once by the real stages;
    each test copies them into its own project (stage_runs.project)."""
    from stage_runs import MICRO, run_in_process  # here, not above: it imports torch, which most tests need not

    work = tmp_path_factory.mktemp("dpdata")
    for item in ("schemas", "params.yaml"):
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy)(ROOT / item, work / item)
    params = apply_overrides(yaml.safe_load((work / "params.yaml").read_text()), MICRO)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    cwd = os.getcwd()
    os.chdir(work)
    try:
        for name in ("shards", "tokenizer"):
            run_in_process(name, [])
    finally:
        os.chdir(cwd)
    # An empty MLflow store, its tables made once: each project copies it (stage_runs.project), where a
    # first tracked stage would spend 1-3 s creating them (tests/test_e2e.py's projects still do).
    import mlflow

    mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}").search_experiments()
    return work


@pytest.fixture
def serve():
    """serve(root, ignore_range=False): a loopback HTTP server for files under root (tests/http_server.py);
    every one started is stopped after the test."""
    start, started = serving()
    yield start
    stop(started)


@pytest.fixture
def local_mlflow(tmp_path, monkeypatch):
    """The default SQLite store in tmp_path, whatever an earlier test set; mlflow's process-wide URI
    is reset for the next tests."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)
    yield
    mlflow.set_tracking_uri(None)  # tracking._mlflow sets it for the whole process (and its environment)


@pytest.fixture
def progress_clock(monkeypatch):
    """The clock of every progress bar, and of the `time` module's clocks, moved by the test
    (`.advance(seconds)`) where the work would take time: what a run prints measured against how long
    its pieces took, with no sleep."""
    import time
    import types

    import tqdm.std

    clock = types.SimpleNamespace(now=1e6)
    clock.advance = lambda s: setattr(clock, "now", clock.now + s)
    monkeypatch.setattr(tqdm.std, "time", lambda: clock.now)
    for name in ("time", "monotonic", "perf_counter"):
        monkeypatch.setattr(time, name, lambda: clock.now)
    return clock


@pytest.fixture
def one_update_more(monkeypatch):
    """one_update_more(): from then on every private training reports one optimizer update more than its
    ledger charged, the bug that verification must stop."""
    from pipeline.privacy import training

    real = training.train_private

    def one_extra_update(*args, **kw):
        model, counters, record = real(*args, **kw)
        return model, {**counters, "applied_updates": counters["applied_updates"] + 1}, record

    return lambda: monkeypatch.setattr(training, "train_private", one_extra_update)
