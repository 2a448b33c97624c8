"""Deviceless compile checks beside tests/unit/planner/test_compiler_decides.py:
the compiled tier, which needs the gpu-compile or tpu-compile extra and skips without it."""

from __future__ import annotations

import pytest
from test_compiler_decides import _budget_between, pessimistic  # noqa: F401  (pessimistic: a fixture)

from jaxring.analysis import tpu
from jaxring.planner.fit import GIB

needs_libtpu = pytest.mark.skipif(
    not tpu.available()[0], reason=f"deviceless TPU compile unavailable: {tpu.available()[1]}"
)


@needs_libtpu
@pytest.mark.usefixtures("pessimistic")
def test_train_py_compile_for_a_tpu_slice_accepts_what_compiles_within_the_budget(capsys):
    """The real route: train.py --compile-for v5e-8 with the pessimistic calibration and a budget between the
    compiled bytes and the estimate: exit 0, the verdict's line naming both."""
    import train as cli  # the repository's train.py

    args = ["--preset", "tiny", "--seq-len", "8192", "--batch-size", "1", "--sp", "8", "--attention", "ring"]
    args += ["--remat", "full"]
    assert cli.main([*args, "--compile-for", "v5e-8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    compiled, estimate = (float(line.split(k)[1].split(" GiB")[0]) * GIB for k in ("compiled ", "estimate "))
    budget = _budget_between(compiled, estimate)
    assert cli.main([*args, "--device-memory-gib", f"{budget:.4f}", "--compile-for", "v5e-8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("fits: compiled") and f"estimate {estimate / GIB:.3f}" in line, line
