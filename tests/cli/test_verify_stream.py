"""Issue 41 item 15: ``squeeze verify``'s listing of a huge manifest is streamed (300k entries took 84 s and
1.1 GB as one rich table)."""

from __future__ import annotations

import tracemalloc

from typer.testing import CliRunner

from squeeze import api
from squeeze.cli import verify as verify_cli
from squeeze.cli.app import app
from squeeze.format.verify import FileResult, VerifyReport

runner = CliRunner()


def report(files: int) -> VerifyReport:
    results = [FileResult(f"tok/part-{i:06d}.json", True, size=i) for i in range(files)]
    results[-1] = FileResult(results[-1].path, False, "SHA-256 mismatch", size=files - 1)
    return VerifyReport("/a/b", "/a/b/squeeze.manifest.json", "0" * 64, files=results)


def test_a_huge_listing_is_streamed_not_tabled(monkeypatch) -> None:
    monkeypatch.setattr(api, "verify_model_integrity", lambda *args, **kwargs: report(300_000))

    def no_table(*args, **kwargs):
        raise AssertionError("a 300k-row rich table")

    monkeypatch.setattr(verify_cli, "Table", no_table)
    tracemalloc.start()
    result = runner.invoke(app, ["verify", "/a/b"])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert result.exit_code == 1, (result.stderr[-2000:], result.exception)
    lines = result.stdout.splitlines()
    assert sum(1 for line in lines if line.startswith("tok/part-")) == 300_000
    assert "FAILED SHA-256 mismatch" in [line for line in lines if line.startswith("tok/")][-1]
    assert "integrity check failed" in result.stderr
    assert peak < 400 * 2**20


def test_a_small_listing_is_still_a_table(monkeypatch) -> None:
    monkeypatch.setattr(api, "verify_model_integrity", lambda *args, **kwargs: report(3))
    result = runner.invoke(app, ["verify", "/a/b"])
    assert result.exit_code == 1
    assert "│" in result.stdout and "FAILED" in result.stdout
