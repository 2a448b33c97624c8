"""`python -m jaxring.demo` at small shapes: 0 when ring attention agrees with dense attention (forward and
dq/dk/dv), 1 when it does not, 2 with one line for a bad flag. (tests/integration/test_readme.py runs it as
docs/training.md shows it.)"""

import jaxring
from jaxring import demo

SMALL = ["--seq", "128", "--heads", "4", "--head-dim", "16", "--runs", "1"]


def test_demo_agrees_on_a_data_and_sequence_mesh(capsys):
    assert demo.main(SMALL + ["--dp", "2", "--sp", "4", "--layout", "striped", "--kv-heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "mesh dp=2 sp=4; striped layout" in out
    assert out.count(" ok") == 4 and "FAIL" not in out, out


def test_demo_exits_nonzero_when_ring_disagrees(monkeypatch, capsys):
    real = jaxring.sharded_attention

    def off_by_one_percent(q, k, v, *, strategy, **kwargs):
        out = real(q, k, v, strategy=strategy, **kwargs)
        return out * 1.01 if strategy == "ring" else out

    monkeypatch.setattr(jaxring, "sharded_attention", off_by_one_percent)
    assert demo.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "out max error relative to dense" in out and "FAIL" in out, out


def test_demo_bad_shape_is_one_line(capsys):
    assert demo.main(["--seq", "100", "--runs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seq 100 is not divisible by 2*sp = 16" in err[0], err
