"""Writes kiln's default calibration sample (quant/data/calibration-sample.txt): eleven modules of the
Python 3.11 standard library, whole, each under a header line naming it (PSF licence).

Why these: real, varied Python with English docstrings and comments -- the distribution kiln's bundled
model was trained on (none of them is in its held-out set: json, email, tomllib), and text plus code for a
general model's activation ranges. A chat model should be calibrated on chat data instead (--calib-dataset).

    python scripts/make_calibration_sample.py [--stdlib /usr/lib/python3.11]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

MODULES = ("textwrap", "functools", "dataclasses", "heapq", "bisect", "fractions", "statistics", "shlex", "csv",
           "pprint", "contextlib")
OUT = Path(__file__).resolve().parent.parent / "kiln" / "quant" / "data" / "calibration-sample.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="a Python 3.11 standard library")
    args = parser.parse_args()
    chunks = []
    for name in MODULES:
        text = (Path(args.stdlib) / f"{name}.py").read_text(encoding="utf-8")
        chunks.append(f"# --- {name}.py (Python 3.11 standard library, PSF licence) ---\n{text}")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n".join(chunks), encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
