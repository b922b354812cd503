"""experiments/suite_time: a profiled run's per-test lines summed per file, rendered and plotted."""
import json

import pytest

from experiments.suite_time import report


def test_per_file_sums_each_kind_and_the_rest(tmp_path):
    prof = tmp_path / "prof"
    prof.mkdir()
    lines = {"1.jsonl": [{"test": "tests/test_a.py::t1", "wall_s": 5.0, "backend_compile_duration": 2.0,
                          "jaxpr_trace_duration": 0.5, "jaxpr_to_mlir_module_duration": 0.25},
                         {"test": "tests/test_b.py::t[x]", "wall_s": 1.0}],
             "2.jsonl": [{"test": "tests/test_a.py::t2", "wall_s": 3.0, "backend_compile_duration": 1.0}]}
    for name, recs in lines.items():
        (prof / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    recs = report.per_file(str(prof))
    assert [r["file"] for r in recs] == ["tests/test_a.py", "tests/test_b.py"]
    assert recs[0] == {"file": "tests/test_a.py", "tests": 2, "wall_s": 8.0, "compile_s": 3.0, "trace_s": 0.75,
                       "rest_s": 4.25}
    md = report.render(recs, top=1)
    assert "3 tests, 9 worker-seconds" in md and "| tests/test_a.py | 2 | 8.0 | 3.0 | 0.8 | 4.2 |" in md
    assert "| 1 other files | 1 | 1.0 |" in md
    report.plot(recs, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 5_000
    with pytest.raises(SystemExit, match="no profile records"):
        report.per_file(str(tmp_path))
