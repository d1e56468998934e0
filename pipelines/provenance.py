"""Provenance saved next to every pipeline output: code revision, package versions, host; file fingerprints."""
from __future__ import annotations

import hashlib
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


def package_versions(packages=PACKAGES) -> dict[str, str | None]:
    versions = {}
    for p in packages:
        try:
            versions[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            versions[p] = None
    return versions


def provenance() -> dict:
    return {"git_revision": git_revision(), "packages": package_versions(), "python": platform.python_version(),
            "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
