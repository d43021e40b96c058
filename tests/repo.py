"""The repository root, for tests that run scripts or read committed files."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
