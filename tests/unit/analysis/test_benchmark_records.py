"""Benchmark records say when and at which commit they were measured: every file in benchmarks/results carries a
date and a commit, and `save_record` (the one writer) stamps them."""

from __future__ import annotations

import datetime
import glob
import json
import os
import re

import jax
import pytest
from helpers import ROOT as REPO

from jaxring.analysis.records import benchmark_record, save_record

ROOT = str(REPO)
RECORDS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))


@pytest.mark.parametrize("path", RECORDS, ids=os.path.basename)
def test_every_record_has_a_date_and_a_commit(path):
    with open(path) as f:
        record = json.load(f)
    assert isinstance(record, dict) and record.get("benchmark"), path
    date = str(record.get("date", ""))
    datetime.date.fromisoformat(date[:10])  # raises on a missing or malformed date
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", str(record.get("commit", ""))), (path, record.get("commit"))


def test_save_record_stamps_date_and_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRING_COMMIT", "0123456789ab")
    record = benchmark_record("probe", jax.devices()[:1], {})
    save_record(record, str(tmp_path / "r.json"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["commit"] == "0123456789ab"
    assert datetime.datetime.strptime(saved["date"], "%Y-%m-%dT%H:%M:%SZ").year >= 2026


def test_benchmarks_write_results_only_through_save_record():
    writers = []
    for path in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):
        with open(path) as f:
            text = f.read()
        if re.search(r"json\.dump\((record|result|results|out)\b", text):
            writers.append(os.path.basename(path))
    assert not writers, f"write results with jaxring.analysis.records.save_record (it stamps them): {writers}"
