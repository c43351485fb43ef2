"""HOST: how a benchmark writes its JSON (under benchmarks/results/ by default), with the
machine it ran on. Benchmarks import it as a sibling (`python benchmarks/X.py` puts the
directory on the path)."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine(**extra) -> dict:
    """Cores, platform and JAX version (plus `extra`): what a ratio measured here depends on."""
    import jax

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__, **extra}


def write_result(out: str | os.PathLike, result: dict) -> None:
    """Write `result` as indented JSON to `out` (parents made) and say where."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
