"""Load a script under benchmarks/ as a module, for the tests of its helpers.

benchmarks/ is not a package (its scripts run as `python benchmarks/X.py` and import their
siblings by name), so the directory goes on sys.path before the script is executed.
"""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ on the path for its sibling imports)."""
    if os.path.join(ROOT, "benchmarks") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
