"""An fp8 KV cache against the model's own on held-out text: python scripts/eval_kv_cache.py --checkpoint PATH --data FILE.

--data: a prepared token file (.bin beside its meta.json; after `make train`: data/stdlib/val.bin, held
out from training) or a text file. Prints one JSON line (meshlab/bench/kv_quality.py says what it holds).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    from meshlab.bench.kv_quality import main
    main(description=__doc__.splitlines()[0])
