"""Provenance saved next to every pipeline output: code revision, package versions, host."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time

PACKAGES = ("torch", "transformers", "ray", "datasets", "pyarrow", "deepspeed", "triton", "safetensors",
            "huggingface_hub")


def git_revision(cwd: str | None = None) -> str:
    cwd = cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TFM_GIT_REVISION", "unknown")


def provenance() -> dict:
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            versions[p] = None
    return {"git_revision": git_revision(), "packages": versions, "python": platform.python_version(),
            "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
