"""Writes a tiny random-weight Llama checkpoint (with a small trained BPE tokenizer) to a directory.

Until the bundled trained model lands this is what README's first command builds: it shows the whole
path (checkpoint -> engine -> generation) in seconds; its text is gibberish because its weights are random.
Usage: python scripts/make_tiny_llama.py OUTPUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

# One tiny-model recipe for the tests and this script.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from model_factory import make_checkpoint  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path, _ = make_checkpoint(Path(sys.argv[1]), "LlamaForCausalLM", max_position_embeddings=512)
    print(f"tiny Llama checkpoint written to {path}")
