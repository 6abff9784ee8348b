"""The generated Triton model.py imports the kiln that wrote the repository whatever the server's working
directory: Triton's Python backend puts that directory on sys.path, and a folder holding a `kiln/` directory
(the folder above a clone named kiln) used to be imported instead (issue 40). Run in a subprocess as the
backend would, `python -c` putting the working directory first on sys.path, with the stand-in of
`triton_python_backend_utils` (tests/triton_stub); no Triton server needed (tests/test_triton_server.py has
the real one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from kiln.cli import main

STUB = Path(__file__).parent / "triton_stub"
KILN_DIR = str(Path(kiln.__file__).resolve().parent)
# Loads model.py as the backend does and prints where its kiln came from.
LOAD = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('model', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print('KILN_DIR=' + m.kiln.__path__[0])")
# Runs only model.py's import logic (the code before it imports numpy), then its _import_kiln: kiln itself and
# not the serving modules, so each case takes a second rather than the ten a full load takes on 2 cores.
IMPORT_LOGIC = ("import sys; path = sys.argv[1]; head = open(path).read().split('\\nimport numpy as np')[0]; "
                "ns = {'__file__': path, '__name__': 'model'}; exec(compile(head, path, 'exec'), ns); "
                "print('KILN_DIR=' + ns['_import_kiln'](ns['RECORDED']).__path__[0])")


@pytest.fixture(scope="module")
def repo(tiny_code_engine, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton-import") / "models"
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(repo), "--model-name", "m"]) == 0
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(repo), "--model-name", "bare",
                 "--no-site-path"]) == 0
    return repo


def _load_from(cwd: Path, model_py: Path, whole: bool = False) -> subprocess.CompletedProcess:
    """model.py (`whole`) or its import logic run by a Python whose sys.path starts with `cwd`, as the backend's."""
    env = {**os.environ, "PYTHONPATH": str(STUB)}
    return subprocess.run([sys.executable, "-c", LOAD if whole else IMPORT_LOGIC, str(model_py)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("shadow", ["folder", "package"])
def test_model_py_imports_the_recorded_kiln_from_a_folder_holding_kiln(repo, tmp_path, shadow):
    """`folder`: a clone's parent (kiln/ without __init__.py, found before an editable install's finder);
    `package`: another kiln package in the working directory, which must not be imported either."""
    assert json.loads((repo / "m" / "1" / "kiln_env.json").read_text())["kiln_dir"] == KILN_DIR
    (tmp_path / "kiln" / "kiln").mkdir(parents=True)  # what a clone named kiln holds
    if shadow == "package":
        (tmp_path / "kiln" / "__init__.py").write_text("raise ImportError('the shadowing kiln was imported')\n")
    result = _load_from(tmp_path, repo / "m" / "1" / "model.py", whole=shadow == "folder")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"KILN_DIR={KILN_DIR}" in result.stdout
    assert f"kiln's Triton model: kiln {kiln.__version__} from {KILN_DIR}" in result.stderr


def test_without_a_recorded_kiln_a_shadowing_folder_is_dropped_from_sys_path(repo, tmp_path):
    """--no-site-path records no kiln_dir: the working directory's `kiln/` folder (no __init__.py) is left out
    of sys.path, so the installed kiln is imported."""
    assert json.loads((repo / "bare" / "1" / "kiln_env.json").read_text())["kiln_dir"] is None
    (tmp_path / "kiln" / "kiln").mkdir(parents=True)
    result = _load_from(tmp_path, repo / "bare" / "1" / "model.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"KILN_DIR={KILN_DIR}" in result.stdout
    assert f"kiln's Triton model: kiln {kiln.__version__} from {KILN_DIR}" in result.stderr
