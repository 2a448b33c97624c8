"""Outputs that cannot be written, and weights that cannot be used, are said before the work (one line, exit 2)
and a write that fails anyway loses nothing: `train.py --export-hf`, `python -m jaxring.models.hf export`,
`python -m jaxring.eval --out`, NaN/Inf in loaded weights, Ctrl-C during an evaluation (issue 36, items 2, 5).

Full and read-only filesystems are faked (the writer raises OSError(ENOSPC/EROFS), or the disk reports no free
space): tests may run as root, to whom a chmod-read-only directory is writable."""

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from helpers import ROOT
from safetensors import SafetensorError
from test_reliability import CLI, _env

from jaxring.core.stop_signals import Interrupted
from jaxring.eval import cli as eval_cli
from jaxring.eval import loading, output_files, perplexity
from jaxring.models import gpt, hf
from jaxring.models.hf import cli as hf_export
from jaxring.train import checksum
from jaxring.train.checkpoint import Checkpointer

TINY = gpt.get_config("tiny-llama3", vocab_size=384, num_layers=1)
FULL = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")  # its own text


def _one_line(code, capsys, want_code=2) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == want_code and len(err) == 1 and "Traceback" not in err[0], (code, err)
    return err[0]


def _leftovers(directory) -> list[str]:
    """Hidden staged or temporary entries a failed write would leave."""
    return [e for e in os.listdir(directory) if e.startswith(".")]


def _save_file_fails(monkeypatch, error=FULL, under=None):
    """safetensors' writer raises `error` (for files under `under`, when given) as on a full disk."""
    real = safetensors.numpy.save_file

    def save_file(data, file, metadata=None):
        if under is None or str(file).startswith(str(under)):
            raise error
        return real(data, file, metadata=metadata)

    monkeypatch.setattr(safetensors.numpy, "save_file", save_file)


def _read_only(monkeypatch, directory):
    """Writing a file in `directory` fails as on a read-only mount (the output checks' probe write)."""
    real = output_files.tempfile.TemporaryFile

    def probe(*args, dir=None, **kwargs):
        if str(dir) == str(directory):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(output_files.tempfile, "TemporaryFile", probe)


def _not_loaded(monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(loading, "load_model", load_model)


# ---- python -m jaxring.models.hf export ------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A jaxring checkpoint of a one-layer tiny-llama3 (its parameters only, as the exporter reads them)."""
    path = tmp_path_factory.mktemp("ckpt")
    params = nnx.to_pure_dict(nnx.state(gpt.GPT(TINY, rngs=nnx.Rngs(0))))
    with Checkpointer(path, lock=True) as ckpt:
        ckpt.save(1, {"params": params}, metadata={"model": {"kind": "gpt", **dataclasses.asdict(TINY)}})
    return str(path)


def test_export_replaces_an_earlier_export_only_with_overwrite(checkpoint, tmp_path, capsys):
    """It refused every non-empty OUT_DIR, an earlier export too, with no way to replace it; train.py's
    --export-hf overwrote anything silently. Now both: an earlier export needs --overwrite(-export), other files
    are never replaced."""
    out = tmp_path / "hf"
    assert hf_export.main(["export", checkpoint, str(out)]) == 0
    first = sorted(os.listdir(out))
    line = _one_line(hf_export.main(["export", checkpoint, str(out)]), capsys)
    assert f"OUT_DIR '{out}' holds an earlier export (config.json, safetensors); pass --overwrite" in line
    assert hf_export.main(["export", checkpoint, str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == first and not _leftovers(tmp_path)
    (out / "notes.txt").write_text("mine")
    line = _one_line(hf_export.main(["export", checkpoint, str(out), "--overwrite"]), capsys)
    assert "holds files that are not an export (notes.txt)" in line
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("overwrite", [False, True], ids=["new-dir", "over-an-earlier-export"])
def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(checkpoint, tmp_path, capsys, monkeypatch, overwrite):
    """The write failing mid-way (safetensors' SafetensorError, or an OSError) used to be a traceback and a
    partial OUT_DIR; now one line, exit 2, OUT_DIR as it was (absent, or the earlier export intact)."""
    out = tmp_path / "hf"
    if overwrite:
        assert hf_export.main(["export", checkpoint, str(out)]) == 0
        before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    _save_file_fails(monkeypatch)
    argv = ["export", checkpoint, str(out)] + (["--overwrite"] if overwrite else [])
    line = _one_line(hf_export.main(argv), capsys)
    assert line.startswith(f"error: writing {out} failed ([Errno 28] ") and "No space left" in line, line
    assert line.endswith("nothing was written")
    assert not _leftovers(tmp_path)
    if overwrite:
        assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    else:
        assert not out.exists()


@pytest.mark.parametrize("fault", ["read-only", "no-space", "chmod"])
def test_export_checks_out_dir_before_reading(checkpoint, tmp_path, capsys, monkeypatch, fault):
    """A read-only OUT_DIR or one without room for the tensors is said before the checkpoint is read."""
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the checkpoint was read"))
    out = tmp_path / "ro" / "hf"
    out.parent.mkdir()
    if fault == "read-only":
        _read_only(monkeypatch, out.parent)
        want = f"OUT_DIR '{out}': cannot write in '{out.parent}' (Read-only file system)"
    elif fault == "no-space":
        usage = type("usage", (), {"free": 1000})
        monkeypatch.setattr(output_files.shutil, "disk_usage", lambda path: usage)
        want = "the export (float32) needs about 362 kB, but the filesystem of"
    else:
        if os.geteuid() == 0:
            pytest.skip("running as root: a chmod-read-only directory is writable (the read-only case fakes it)")
        out.parent.chmod(0o500)
        want = "cannot write in"
    try:
        line = _one_line(hf_export.main(["export", checkpoint, str(out)]), capsys)
    finally:
        out.parent.chmod(0o700)
    assert want in line, line
    assert not out.exists()


@pytest.mark.parametrize(
    "stop, code, head",
    [(KeyboardInterrupt(), 130, "interrupted"), (Interrupted(signal.SIGTERM), 143, "stopped by SIGTERM")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stop_during_an_export_is_one_line_and_leaves_nothing(
    checkpoint, tmp_path, capsys, monkeypatch, stop, code, head
):
    """Ctrl-C (or SIGTERM, raised as Interrupted by the command's handler) while the tensors are written: a
    traceback and a partial OUT_DIR before; now one line, 128 + N, nothing left."""
    _save_file_fails(monkeypatch, stop)
    line = _one_line(hf_export.main(["export", checkpoint, str(tmp_path / "hf")]), capsys, want_code=code)
    assert line == f"{head}: nothing written to {tmp_path / 'hf'}"
    assert not (tmp_path / "hf").exists() and not _leftovers(tmp_path)


# ---- train.py --export-hf --------------------------------------------------------------------------------

RUN = ["--override=num_layers=1", "--steps", "1", "--seq-len", "32", "--batch-size", "8", "--dp", "8"]
RUN += ["--sample-tokens", "0", "--no-progress", "--no-eval-at-end", "--warmup", "0"]


def _train(argv, tmp_path, capsys):
    """train.py's main in this process: (exit code, stdout, stderr lines)."""
    code = CLI.main([*RUN, "--out-dir", str(tmp_path / "run"), *argv])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def test_train_py_export_hf_is_checked_before_the_first_step(tmp_path, capsys):
    """The default tiny preset (GELU, LayerNorm) is stored by no Hugging Face architecture; an earlier export
    needs --overwrite-export. Both used to fail (or overwrite) only after training; now before the first step."""
    out = tmp_path / "hf"
    code, _, err = _train(["--export-hf", str(out)], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"error: --export-hf '{out}': no Hugging Face architecture stores a GPT with activation 'gelu'" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not out.exists()  # no step ran
    hf.save_pretrained(gpt.GPT(TINY, rngs=nnx.Rngs(0)), TINY, str(out))
    code, _, err = _train(["--preset", "tiny-llama3", "--export-hf", str(out)], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and "holds an earlier export" in err[0], err
    assert "pass --overwrite-export to replace it" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    code, _, err = _train(["--overwrite-export"], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and "--overwrite-export lets --export-hf DIR replace" in err[0], err


def test_train_py_export_failing_at_the_end_keeps_the_trained_model(tmp_path, capsys, monkeypatch):
    """The disk fills during training: the export's write fails at the end. It used to be a traceback with the
    trained model gone (no --checkpoint-dir); now one line saying where the model went instead (the run's
    OUT_DIR/export-hf), and that directory is a loadable export. --overwrite-export replaced the earlier one."""
    out = tmp_path / "hf"
    hf.save_pretrained(gpt.GPT(TINY, rngs=nnx.Rngs(0)), TINY, str(out))
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    _save_file_fails(monkeypatch, under=tmp_path / ".hf.")  # the staged directory beside --export-hf DIR
    argv = ["--preset", "tiny-llama3", "--export-hf", str(out), "--overwrite-export"]
    code, stdout, err = _train(argv, tmp_path, capsys)
    fallback = tmp_path / "run" / "export-hf"
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --export-hf '{out}': writing the export failed ([Errno 28] ")
    assert f"the trained model was exported to '{fallback}' instead; the trained state (step " in err[0], err[0]
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before and not _leftovers(tmp_path)
    _, cfg = hf.load_pretrained(str(fallback))
    assert cfg.num_layers == 1 and f"exported the model to the fallback directory {fallback}" in stdout


@pytest.mark.slow  # a second training run: the --checkpoint-dir variant of the test above
def test_train_py_export_failing_with_a_checkpoint_dir_names_the_checkpoint(tmp_path, capsys, monkeypatch):
    out, ck = tmp_path / "hf", tmp_path / "ck"
    _save_file_fails(monkeypatch, under=tmp_path / ".hf.")
    argv = ["--preset", "tiny-llama3", "--export-hf", str(out), "--checkpoint-dir", str(ck)]
    code, _, err = _train(argv, tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith(
        f"the trained model is the final checkpoint in '{ck}': export it with python -m jaxring.models.hf export "
        f"{ck} DIR"
    )
    assert hf_export.main(["export", str(ck), str(tmp_path / "exported")]) == 0  # as the line says


# ---- NaN / Inf in loaded weights -------------------------------------------------------------------------


def _hf_dir_with_nans(tmp_path, count=12):
    src = tmp_path / "src"
    hf.save_pretrained(gpt.GPT(TINY, rngs=nnx.Rngs(0)), TINY, str(src))
    (file,) = src.glob("*.safetensors")
    tensors = safetensors.numpy.load_file(str(file))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name].reshape(-1)[:count] = np.nan
    tensors["model.norm.weight"][:2] = np.inf  # a second damaged tensor: the message names the first
    safetensors.numpy.save_file(tensors, str(file), metadata={"format": "pt"})
    return src, name


def test_nan_in_init_from_weights_is_named_at_load(tmp_path, capsys):
    """It was reported as 'diverged at step 1' (exit 3), after compiling the step."""
    src, name = _hf_dir_with_nans(tmp_path)
    code, _, err = _train(["--init-from", str(src), "--steps", "2"], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"error: --init-from {src}: tensor {name} has 12 NaN values (and 1 more tensors); the checkpoint is damaged"
    ), err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_nan_in_weights_is_named_by_jaxring_eval(tmp_path, capsys, monkeypatch):
    """A Hugging Face directory and a jaxring checkpoint (saved past the saver's own finiteness check): both
    name the tensor, and its layer, in one line."""
    src, name = _hf_dir_with_nans(tmp_path, count=3)
    argv = ["--seq-len", "32", "--no-progress", "--out", str(tmp_path / "e")]
    line = _one_line(eval_cli.main(["perplexity", str(src), *argv]), capsys)
    assert f"tensor {name} has 3 NaN values (and 1 more tensors); the checkpoint is damaged" in line
    params = nnx.to_pure_dict(nnx.state(gpt.GPT(TINY, rngs=nnx.Rngs(0))))
    params["blocks"]["mlp"]["w_in"] = params["blocks"]["mlp"]["w_in"].at[0, 1, :5].set(np.inf)
    monkeypatch.setattr(checksum, "non_finite", lambda sums: [])  # a checkpoint damaged after its save
    with Checkpointer(tmp_path / "ck", lock=True) as ckpt:
        ckpt.save(1, {"params": params}, metadata={"model": {"kind": "gpt", **dataclasses.asdict(TINY)}})
    line = _one_line(eval_cli.main(["perplexity", str(tmp_path / "ck"), *argv]), capsys)
    assert f"checkpoint '{tmp_path / 'ck'}' step 1: parameter blocks.mlp.w_in (layer 0) has 5 Inf values" in line


# ---- python -m jaxring.eval ------------------------------------------------------------------------------

RESULT = {
    "label": "m",
    "model": "m",
    "data": "d",
    "seq_len": 32,
    "tokens": 64,
    "loss": 1.0,
    "perplexity": 2.7,
    "buckets": [{"start": 0, "end": 32, "tokens": 64, "loss": 1.0, "perplexity": 2.7}],
}


@pytest.mark.parametrize(
    "case, want",
    [
        ("file", "--out '{out}' exists and is not a directory"),
        ("read-only", "--out '{out}': cannot write in '{parent}' (Read-only file system)"),
        ("pp", "--pp 2: evaluation does not pipeline"),
    ],
    ids=["file", "read-only", "pp"],
)
def test_eval_checks_its_outputs_and_plan_before_loading(tmp_path, capsys, monkeypatch, case, want):
    """--out naming a file or a read-only place failed after scoring (a traceback); --pp 2 answered with
    train.py's batch-size advice, which changed nothing. Now one line each, before the model is loaded."""
    _not_loaded(monkeypatch)
    out = tmp_path / "e"
    argv = ["perplexity", str(ROOT / "tests/fixtures/hf/llama3"), "--seq-len", "32", "--no-progress"]
    if case == "file":
        out.write_text("x")
    elif case == "read-only":
        _read_only(monkeypatch, tmp_path)
    else:
        argv += ["--pp", "2"]
    line = _one_line(eval_cli.main([*argv, "--out", str(out)]), capsys)
    assert want.format(out=out, parent=tmp_path) in line, line


def test_eval_prints_its_table_when_the_files_cannot_be_written(tmp_path, capsys, monkeypatch):
    """A full disk after scoring: three chained tracebacks, no table, an empty PNG. Now the table, then one line
    naming the file not written; no empty or partial file is left."""
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(perplexity, "evaluate", lambda *a, **k: RESULT)
    import matplotlib.figure

    def full(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG partial")  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    out = tmp_path / "e"
    argv = ["perplexity", "unused", "--seq-len", "32", "--no-progress", "--out", str(out), "--cpu-devices", "8"]
    code = eval_cli.main(argv)
    stdout, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert perplexity.table(RESULT) in stdout
    assert err[0].startswith(f"error: could not write {out}/perplexity.png: [Errno 28] No space left on device")
    assert err[0].endswith(f"; wrote {out}/perplexity.json (the table above is the result)")
    assert sorted(os.listdir(out)) == ["perplexity.json"] and json.loads((out / "perplexity.json").read_text())


CHILD = """
import sys, time
from jaxring.eval import cli, loading, perplexity
loading.load_model = lambda *a, **k: None
def scoring(*a, **k):
    print("scoring", flush=True)
    for _ in range(1200):  # batches of 0.1 s: a real evaluation runs Python between its batches
        time.sleep(0.1)
perplexity.evaluate = scoring
sys.exit(cli.main(["perplexity", "m", "--seq-len", "32", "--no-progress", "--out", sys.argv[1]]))
"""


@pytest.mark.parametrize(
    "signum, code, line",
    [
        (signal.SIGINT, 130, "interrupted"),
        (signal.SIGTERM, 143, "stopped by SIGTERM"),
    ],
    ids=["sigint", "sigterm"],
)
def test_a_stop_signal_during_an_evaluation_is_one_line(tmp_path, signum, code, line):
    """Ctrl-C while scoring: a KeyboardInterrupt traceback before; now 'interrupted' and exit code 130. SIGTERM
    ends it the same way (its clean-up runs: no temporary file is left), exit code 143."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "e")],
        env={**_env(), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout.readline().strip() == "scoring" and time.monotonic() < deadline
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code and err == line + "\n", err
    assert not (tmp_path / "e").exists()
