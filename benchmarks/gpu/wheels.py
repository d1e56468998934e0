"""Install the carried wheels (.whl/) that the GPU image lacks, or has too old, into one folder.

    python3 -m benchmarks.gpu.wheels /root/site && export PYTHONPATH=/root/site:$PYTHONPATH
    python3 -m benchmarks.gpu.wheels /root/site deepspeed transformers   # only these imports must work
    python -m benchmarks.gpu.wheels --download                           # on the CPU machine: fill .whl/

The device machine reaches no package registry (see the device tool's README): wheels travel with the working
tree, downloaded here with `pip download --no-deps --python-version 3.12 ...`. A wheel is installed only when
its distribution is missing or older than MIN_VERSION asks, so the image's own builds (torch, triton, numpy)
are never shadowed. Prints what it installed; exits 1 when a required import (by default CHECK_IMPORTS, or
the modules named after the folder: a session that carries only some wheels) still fails.
"""
import argparse
import glob
import importlib.metadata as md
import os
import subprocess
import sys

from packaging.version import Version

# distributions whose version matters to what we run (datasets 5.2 needs these)
MIN_VERSION = {"pyarrow": "24.0.0", "huggingface_hub": "1.31.0", "transformers": "5.24.0"}  # 5.24: Qwen3.5 classes
CHECK_IMPORTS = ["datasets", "pyarrow.parquet", "deepspeed", "gguf"]
# what the GPU image lacks for collect, train and export (about 20 MB; the image has torch, triton, numpy, pyarrow,
# pandas, huggingface_hub, safetensors, msgpack, xxhash)
DOWNLOAD = ["datasets==5.2.0", "dill", "multiprocess", "gguf", "transformers==5.24.0", "hjson", "py-cpuinfo",
            "einops", "pydantic", "pydantic-core", "annotated-types", "typing-inspection"]
BUILD = ["deepspeed==0.19.8"]                             # an sdist: built into a pure-Python wheel here


def download(folder: str = ".whl") -> None:
    """Fetch DOWNLOAD as Python 3.12 manylinux wheels and build BUILD (run on a machine that reaches PyPI)."""
    plat = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any"]
    for req in DOWNLOAD:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--python-version", "3.12",
                        "--only-binary=:all:", *plat, "-d", folder, req], check=True)
    for req in BUILD:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", folder, req], check=True)


def needed(dist: str, version: str) -> bool:
    try:
        have = md.version(dist)
    except md.PackageNotFoundError:
        return True
    floor = MIN_VERSION.get(dist.replace("-", "_").lower())
    return floor is not None and Version(have) < Version(floor)


def main(site: str, check: list[str]) -> int:
    wheels = sorted(glob.glob(".whl/*.whl"))
    todo = []
    for w in wheels:
        dist, version = os.path.basename(w).split("-")[:2]
        if needed(dist, version):
            todo.append(w)
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", site, *todo], check=True)
    print("installed:", " ".join(os.path.basename(w).split("-")[0] for w in todo) or "nothing")
    # a fresh interpreter: this one cached the folder as missing when PYTHONPATH named it before it existed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
    bad = 0
    for mod in check:
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], env=env, capture_output=True, text=True)
        if r.returncode:
            print(f"import {mod} failed: {r.stderr.strip().splitlines()[-1:]}")
            bad = 1
    return bad


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("site", nargs="?", default="/root/site", help="folder to install into (default: /root/site)")
    ap.add_argument("check", nargs="*", default=CHECK_IMPORTS, help="imports that must work afterwards")
    ap.add_argument("--download", action="store_true", help="fill .whl/ from PyPI instead (the CPU machine)")
    args = ap.parse_args()
    if args.download:
        download()
        sys.exit(0)
    sys.exit(main(args.site, args.check))
