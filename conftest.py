"""pytest setup, read before test_algos.py imports transformers: the tests never use the hub, so
a hub id fails at once instead of after the hub client's network retries (46 s per case here)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
