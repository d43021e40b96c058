"""The `full` tier (tests/conftest.py): every name in a class's `full_tier` is a collected test of that class
(a stale or misspelt name would silently keep its case in CI), and `make test` leaves out exactly the
tier's CPU cases (gpu ones stay, skipped with their reason)."""
import importlib
import re
import subprocess
import sys

from tests.repo import REPO

# the modules whose classes name their full_tier cases by id
FILES = ["tests/pallas_kernels/kda/test_api.py", "tests/pallas_kernels/kda/test_stages.py",
         "tests/pallas_kernels/depth_attention/test_depth_attention.py"]


def _collect(*args):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def test_full_tier_names_match_collected_tests():
    every, ci = _collect("--full-tier", *FILES), _collect(*FILES)
    left_out = every - ci
    assert left_out and ci < every and not any(re.search(r"GPU::", node) for node in left_out)
    for path in FILES:
        for cls_name, cls in vars(importlib.import_module(path[:-3].replace("/", "."))).items():
            for name in (getattr(cls, "full_tier", ()) if isinstance(cls, type) else ()):
                tests = {n for n in every if n.startswith(f"{path}::{cls_name}::")}
                named = {n for n in tests if name in (n.rsplit("::", 1)[1], n.rsplit("::", 1)[1].split("[")[0])}
                assert named, f"{cls_name}.full_tier names {name!r}, which is no test of {cls_name}"
                assert named <= left_out, (cls_name, name)
