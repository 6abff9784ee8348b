import sys
from pathlib import Path

# The test helpers (tokenizer_factory, model_factory) import each other by plain name.
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_code_engine(tmp_path_factory):
    """The bundled kiln-tiny-code built once per test session (float32, CPU)."""
    from serve_util import build_tiny_code_engine

    return build_tiny_code_engine(tmp_path_factory.mktemp("tiny-code") / "engine")
