"""Stage bookkeeping of the study (HOST): where a stage writes, and when its result is reused.

    <work_dir>/<stage>/stamp.json = {"stamp": what made it, "result": what it returned}
    cached(cfg, stage, stamp) -> result   only when the saved stamp equals this one
    finish(cfg, stage, stamp, result)     writes it

A stamp holds the stage's config, the stamps (or weight mtimes, `policy_mtime`) of its inputs
and, for stages whose verdict or data comes from code, that code's fingerprint
(`code_fingerprint`), so changed code re-runs them instead of reusing what it would no longer say.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os

from experiments.binary_search_rl.config import StudyConfig


def stage_dir(cfg: StudyConfig, name: str) -> str:
    path = os.path.join(cfg.work_dir, name)
    os.makedirs(path, exist_ok=True)
    return path


def cached(cfg: StudyConfig, name: str, stamp: dict) -> dict | None:
    """The saved result of stage `name` if it finished with this exact `stamp`, else None."""
    path = os.path.join(cfg.work_dir, name, "stamp.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    return saved["result"] if saved.get("stamp") == json.loads(json.dumps(stamp, default=str)) else None


def policy_mtime(policy_dir: str) -> float:
    """When the policy's weights were written: a re-made input stage invalidates its users
    even though its directory keeps the same path."""
    return os.path.getmtime(os.path.join(policy_dir, "model.safetensors"))


def code_fingerprint(module) -> str:
    """A fingerprint of a module's source, in the stamps of the stages whose verdict it
    computes or whose data it makes (evaluation.py for the gate and the evaluations,
    diagnostics.py for the diagnostic, the expert for the demonstrations): changed code re-runs
    them instead of reusing what it would no longer say."""
    return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:16]


def finish(cfg: StudyConfig, name: str, stamp: dict, result: dict) -> dict:
    with open(os.path.join(stage_dir(cfg, name), "stamp.json"), "w") as f:
        json.dump({"stamp": stamp, "result": result}, f, indent=1, default=str)
    return result
