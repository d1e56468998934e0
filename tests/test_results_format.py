"""The benchmarks' house rules: results files in the common format, every benchmark module importable on the CPU
with a working --help, and imports that follow the layering (tfm_kernels <- tfm_runtime <- pipelines; collect,
train and export apart)."""
import ast
import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = sorted(glob.glob(os.path.join(REPO, "benchmarks", "results", "*.json")))
ENV_KEYS = ["git_revision", "dirty", "gpu", "driver", "versions", "command", "date"]


@pytest.mark.parametrize("path", RESULTS, ids=os.path.basename)
def test_results_file_starts_with_the_env_block(path):
    assert os.path.getsize(path) <= 100 * 1024, "results files stay under 100 KB: keep the final run only"
    with open(path) as f:
        results = json.load(f)
    assert list(results)[0] == "env"
    assert list(results["env"]) == ENV_KEYS and isinstance(results["env"]["versions"], dict)


def test_results_readme_exists():
    assert os.path.isfile(os.path.join(REPO, "benchmarks", "README.md"))


def _modules(root: str) -> list[tuple[str, str]]:
    """(dotted module name, path) of every .py file under root, a folder of the repository."""
    out = []
    for path in sorted(glob.glob(os.path.join(REPO, root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        out.append((rel.removesuffix(".__init__"), path))
    return out


def _is_entry_point(path: str) -> bool:
    """Has a module-level `if __name__ == "__main__":`."""
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            return True
    return False


# Run in one fresh interpreter: import every module, then run every entry point with --help (argparse exits 0
# before any work). Prints the failures as JSON.
CHECK = """
import importlib, io, json, runpy, sys, traceback, warnings
warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)
modules, entry_points = json.loads(sys.argv[1])
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception:
        failed[name] = "import: " + traceback.format_exc()[-800:]
for name in entry_points:
    sys.argv = [name, "--help"]
    out, sys.stdout = sys.stdout, io.StringIO()
    try:
        runpy.run_module(name, run_name="__main__")
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code
    except Exception:
        code = traceback.format_exc()[-800:]
    finally:
        sys.stdout = out
    if code not in (0, None):
        failed[name] = f"--help: {code}"
print(json.dumps(failed))
"""


def test_benchmark_modules_import_and_answer_help():
    mods = _modules("benchmarks")
    entry = [name for name, path in mods if _is_entry_point(path)]
    assert "benchmarks.kernels.bench_gdn_tree" in entry and "benchmarks.gpu.wheels" in entry
    env = {**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", CHECK, json.dumps([[m for m, _ in mods], entry])], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


def _imports(path: str, package: str) -> set[str]:
    """Every module a file imports, at the top or inside functions; `from a import b` counts as a and a.b."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


FORBIDDEN = {"tfm_kernels": ("pipelines", "benchmarks"), "tfm_runtime": ("pipelines", "benchmarks"),
             "pipelines/train": ("pipelines.collect", "pipelines.export"),
             "pipelines/collect": ("pipelines.train", "pipelines.export"),
             "pipelines/export": ("pipelines.collect", "pipelines.train")}


@pytest.mark.parametrize("root", FORBIDDEN)
def test_imports_follow_the_layering(root):
    bad = []
    for name, path in _modules(root):
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        bad += [f"{name} imports {m}" for m in sorted(_imports(path, package)) if _under(m, FORBIDDEN[root])]
    assert not bad
