"""Which steps took MLA's explicit prefill (model_defs/layers/mla.py's `explicit_prefill`), on every rank of an
engine. Rank 0 runs in the test's process and is patched there (pytest's monkeypatch); ranks 1.. are fresh
Python processes (runtime/distributed/launch.py), patched as they start by a `sitecustomize` module that
`record_explicit_prefill` puts first on their PYTHONPATH. Each call is logged per process as
(query counts, key counts, whether the step had absorbed rows too) of the split's explicit sequences.

Importable without pytest: the workers' sitecustomize imports this module."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

LOG_DIR = "KILN_TEST_MLA_PROBE_DIR"  # where each process writes <pid>.jsonl; unset: no probe

Call = tuple[tuple[int, ...], tuple[int, ...], bool]

_SITECUSTOMIZE = """\
import os
import sys

if os.environ.get({var!r}):
    sys.path.insert(0, {tests!r})
    import mla_probe
    sys.path.remove({tests!r})
    from kiln.model_defs.layers import mla

    mla.explicit_prefill = mla_probe.logged(mla.explicit_prefill, os.environ[{var!r}])
"""


def logged(prefill: Callable, log_dir: str) -> Callable:
    """`prefill` (explicit_prefill) that first appends its split's explicit sequences to log_dir/<pid>.jsonl."""

    def wrapper(*args):
        split = args[6]  # explicit_prefill(q_nope, q_pe, cache, kv_b_weight, mla, scale, split, out)
        call = ([s.rows.stop - s.rows.start for s in split.explicit], [s.seq_len for s in split.explicit],
                split.absorbed is not None)
        with open(Path(log_dir) / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(call) + "\n")
        return prefill(*args)

    return wrapper


def record_explicit_prefill(monkeypatch, tmp_path: Path) -> Callable[[], list[list[Call]]]:
    """Logs explicit_prefill's calls in this process and in the worker ranks started after this call (set
    before the LLM is made). Returns a reader: per process (this one first, then the workers), its calls in
    order, one per layer and step."""
    from kiln.model_defs.layers import mla

    log_dir, site = tmp_path / "mla-probe-log", tmp_path / "mla-probe-site"
    log_dir.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(var=LOG_DIR, tests=str(Path(__file__).parent)))
    monkeypatch.setenv(LOG_DIR, str(log_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(mla, "explicit_prefill", logged(mla.explicit_prefill, str(log_dir)))

    def read() -> list[list[Call]]:
        own = log_dir / f"{os.getpid()}.jsonl"
        files = [own] + sorted(p for p in log_dir.glob("*.jsonl") if p != own)
        return [[(tuple(q), tuple(k), a) for q, k, a in map(json.loads, f.read_text().splitlines())]
                if f.exists() else [] for f in files]

    return read
