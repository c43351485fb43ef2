"""experiments/binary_search_rl/paired_eval.py: two eval summaries paired by task."""
import json

import pytest

from experiments.binary_search_rl.paired_eval import main, paired


def _summary(tmp_path, name, per_task):
    path = tmp_path / name
    path.write_text(json.dumps({"per_task": per_task, "pass1": 0.0}))
    return str(path)


def test_pairs_by_task_and_refuses_different_tasks(tmp_path, capsys):
    a = _summary(tmp_path, "a.json", {"t1": [2, 2], "t2": [1, 2], "t3": [0, 2]})
    b = _summary(tmp_path, "b.json", {"t3": [0, 2], "t1": [1, 2], "t2": [0, 2]})  # order does not matter
    r = paired(a, b)
    assert r["a_pass1"] == pytest.approx(0.5) and r["b_pass1"] == pytest.approx(1 / 6)
    assert r["mean"] == pytest.approx(1 / 3) and (r["n_pos"], r["n_neg"], r["n"]) == (2, 0, 3)
    main([a, b])
    assert "paired by task +0.333" in capsys.readouterr().out
    c = _summary(tmp_path, "c.json", {"t1": [2, 2], "t9": [0, 2], "t3": [0, 2]})
    with pytest.raises(ValueError, match="same --eval.task_file"):
        paired(a, c)
    with pytest.raises(SystemExit, match="usage"):
        main([a])
