"""Two local CPU processes × 4 devices train 3 steps with the losses of one process × 8 devices."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
from helpers import ROOT
from test_train import BASE, SMALL

from jaxring.train.loop import train

FLAGS = [
    "--steps",
    "3",
    "--batch-size",
    "4",
    "--seq-len",
    "64",
    "--lr",
    "3e-3",
    "--warmup",
    "1",
    "--sample-tokens",
    "0",
    "--no-progress",
    "--dp",
    "2",
    "--sp",
    "4",
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    one = [r["loss"] for r in train(BASE.updated(dp=2, sp=4), log=lambda *a: None)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    metrics = tmp_path / "metrics.jsonl"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "train.py"),
                *FLAGS,
                "--cpu-devices",
                "4",
                *[f"--override={k}={v}" for k, v in SMALL.items()],
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--metrics-file",
                str(metrics),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    two = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    np.testing.assert_allclose(two, one, rtol=1e-4)
