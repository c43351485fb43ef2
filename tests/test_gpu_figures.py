"""benchmarks/gpu_figures.py at toy sizes on CPU: the script a lent GPU runs once must not fail
there, so every path it takes (train step, sampler, FLOP count, README block) runs here."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("gpu_figures", os.path.join(ROOT, "benchmarks", "gpu_figures.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_matmul_params_of_qwen25_05b():
    g = _load()
    # Qwen2.5-0.5B: 494M parameters of which 136M are the tied embedding table; the matrices
    # a token passes (no norms, no biases) plus the unembedding are what 6 N T counts.
    n = g.matmul_params(g.QWEN25_05B)
    assert 0.48e9 < n < 0.50e9
    assert g.peak_tflops("NVIDIA H200", None) == 989.0 and g.peak_tflops("cpu", None) is None
    assert g.peak_tflops("cpu", 2.0) == 2.0


def test_tiny_run_writes_figures_and_readme_block(tmp_path):
    g = _load()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{g.START}\nnot yet measured\n{g.END}\noutro\n")
    out = tmp_path / "gpu.json"
    res = g.main(["--tiny", "--sampler_rows=4", "--repeats=1", f"--out={out}", f"--readme={readme}"])
    saved = json.loads(out.read_text())
    assert saved["train_step"]["loss_finite"] and saved["train_step"]["tflops_per_s"] > 0
    assert saved["sampler"]["tokens_per_s"] > 0 and saved["sampler"]["rows"] == 4
    assert saved["mfu"] is None  # no peak rate for a CPU
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "not yet measured" not in text
    assert "tokens/s" in text and res["device_kind"] in text
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        g.write_readme(str(readme), g.readme_block(res))
