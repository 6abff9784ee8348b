import sys
from pathlib import Path

# The test helpers (tokenizer_factory, model_factory) import each other by plain name.
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`) each worker takes its share of the cores: every worker at torch's default
    (one thread per core) would oversubscribe them and spin in each other's way."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="session", autouse=True)
def kiln_cache_dir(tmp_path_factory):
    """Weight-verification stamps go to a folder of the test session, never to the user's ~/.cache."""
    import os

    path = tmp_path_factory.mktemp("kiln-cache")
    previous = os.environ.get("KILN_CACHE_DIR")
    os.environ["KILN_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("KILN_CACHE_DIR", None)
    else:
        os.environ["KILN_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_code_engine(tmp_path_factory):
    """The bundled kiln-tiny-code built once per test session (float32, CPU)."""
    from serve_util import build_tiny_code_engine

    return build_tiny_code_engine(tmp_path_factory.mktemp("tiny-code") / "engine")


@pytest.fixture(scope="session")
def tiny_code_draft_engine(tmp_path_factory):
    """The bundled draft of kiln-tiny-code (same tokenizer), built like tiny_code_engine."""
    from serve_util import EXAMPLES, build_tiny_code_engine

    return build_tiny_code_engine(tmp_path_factory.mktemp("tiny-code-draft") / "engine",
                                  EXAMPLES / "kiln-tiny-code-draft")


@pytest.fixture(scope="module")
def server(tiny_code_engine):
    """A `kiln serve` server over tiny_code_engine on free ports, one per test module (tests/serve_util.py)."""
    from serve_util import start_server

    srv = start_server(tiny_code_engine)
    yield srv
    srv.stop()
