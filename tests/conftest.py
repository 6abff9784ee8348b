import sys
from pathlib import Path

# The test helpers (tokenizer_factory, model_factory) import each other by plain name.
sys.path.insert(0, str(Path(__file__).parent))
