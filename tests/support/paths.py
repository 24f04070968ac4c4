"""Where the tests' files are, wherever a test module sits."""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")  # committed test files (tests/support/make_*_files.py writes them)
BENCH = os.path.join(REPO, "bench")
