#!/usr/bin/env python3
"""MawForge's fuzzer: `python scripts/fuzz.py --cases 10000 --jobs 2 --out bench-runs/fuzz`.
Prints the outcome classes (clean, accepted, crash, blowup, hang; found/harmless/missed for
the digest flips) and exits 1 if any case crashed, blew up, hung or was missed.
See mawforge/fuzz/runner.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mawforge.fuzz.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
