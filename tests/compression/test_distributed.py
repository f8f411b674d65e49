"""Data-parallel compress under torchrun (squeeze.compression.distributed): a world whose ranks disagree is
refused on every rank; 2 gloo ranks on stories260K, one of them killed mid-run, leave a resumable work area, and
rerunning the same torchrun command finishes with the bytes one process writes (the first run's distributed
Fisher and layer groups are in them).

The torchrun worlds start real processes (``python -m torch.distributed.run``, gloo on CPU), one thread each as
torchrun sets; the one-process reference runs on one thread too (the conftest's default for tiny models).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch

import squeeze.calibrate.fisher as fisher
from squeeze import api
from squeeze.calibrate.fisher import finish_sums, fisher_information, fisher_sums
from squeeze.compression.distributed import (
    SINGLE,
    World,
    backend_for,
    check_same_job,
    check_visible,
    check_world_options,
    job_digest,
    join,
    owns_group,
    window_range,
    world_from_env,
)
from squeeze.compression.workarea import WORK_NAME
from squeeze.errors import ConfigError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.models.targets import find_target_linears

WORKER = Path(__file__).with_name("torchrun_compress.py")
CALIB = {"num_samples": 5, "seq_len": 64}  # 5 windows: 2 ranks get 2 and 3 (an uneven split)


# -- the pieces, without a process group


def test_the_world_comes_from_torchruns_environment() -> None:
    assert world_from_env({}) == SINGLE
    assert world_from_env({"WORLD_SIZE": "1"}) == World(rank=0, size=1)
    assert world_from_env({"WORLD_SIZE": "4", "RANK": "3"}) == World(rank=3, size=4)
    assert World(rank=3, size=4).active and not World(rank=3, size=4).is_main and SINGLE.is_main
    with pytest.raises(ConfigError, match="must be integers"):
        world_from_env({"WORLD_SIZE": "two", "RANK": "0"})
    with pytest.raises(ConfigError, match=r"RANK must be in \[0, WORLD_SIZE\)"):
        world_from_env({"WORLD_SIZE": "2", "RANK": "2"})


def test_a_world_size_set_by_hand_without_torchrun_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set"):
        join(World(rank=0, size=2))
    assert join(SINGLE) is False  # one process: no process group


def test_gloo_for_cpu_and_nccl_for_cuda_tensors() -> None:
    assert backend_for(cuda_available=False) == "gloo"
    assert backend_for(cuda_available=True) == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize(("n", "size"), [(5, 2), (32, 3), (2, 4), (1, 1)])
def test_windows_are_split_into_contiguous_ranges_covering_each_once(n: int, size: int) -> None:
    ranges = [window_range(n, World(rank=r, size=size)) for r in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in pairwise(ranges))  # contiguous, in rank order
    assert max(stop - start for start, stop in ranges) - min(stop - start for start, stop in ranges) <= 1


def test_layer_groups_are_dealt_round_robin() -> None:
    worlds = [World(rank=r, size=3) for r in range(3)]
    owners = [[w.rank for w in worlds if owns_group(i, w)] for i in range(7)]
    assert owners == [[0], [1], [2], [0], [1], [2], [0]]
    assert all(owns_group(i, SINGLE) for i in range(7))


def test_fisher_partial_sums_added_in_rank_order_give_the_one_process_bits(tiny_llama) -> None:
    model, _ = tiny_llama
    targets = find_target_linears(model, ["q_proj", "down_proj"], [])
    windows = torch.randint(0, model.config.vocab_size, (5, 16), generator=torch.Generator().manual_seed(0))
    whole = fisher_information(model, windows, targets)
    for cut in ((2,), (1, 3)):  # 2 ranks, 3 ranks
        got = split_fisher(model, windows, targets, cut)
        assert sorted(got) == sorted(whole)
        for name in whole:
            assert got[name].dtype == torch.float32
            assert torch.equal(got[name], whole[name]), name


def test_fp32_sums_would_depend_on_the_split(tiny_llama, monkeypatch) -> None:
    """Why the sums are float64: summed in fp32, a split over ranks moves bits (so the test above can fail)."""
    model, _ = tiny_llama
    targets = find_target_linears(model, ["q_proj", "down_proj"], [])
    windows = torch.randint(0, model.config.vocab_size, (5, 16), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(fisher, "SUM_DTYPE", torch.float32)
    whole = fisher_information(model, windows, targets)
    got = split_fisher(model, windows, targets, (2,))
    assert not all(torch.equal(got[name], whole[name]) for name in whole)


def split_fisher(model, windows, targets, cut: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """fisher_sums of each contiguous share of ``windows``, added in share order, rounded once."""
    bounds = [0, *cut, len(windows)]
    parts = [fisher_sums(model, windows[a:b], targets) for a, b in pairwise(bounds)]
    total = parts[0]
    for part in parts[1:]:
        for name in total:
            total[name] += part[name]
    return finish_sums(total)


def test_a_world_whose_ranks_disagree_is_refused() -> None:
    fingerprint = {"seed": 0, "recipe": {"name": "w4"}}
    same = job_digest(fingerprint, {"output": "/o"})
    assert len(same) == 32
    check_same_job(World(rank=1, size=2), [same, same])
    other = job_digest({**fingerprint, "seed": 1}, {"output": "/o"})
    with pytest.raises(ConfigError, match=r"disagree on the job: rank\(s\) \[1\]"):
        check_same_job(World(rank=0, size=3), [same, other, same])
    assert job_digest(fingerprint, {"output": "/other"}) != same


def test_a_rank_that_cannot_see_the_work_area_is_refused(tmp_path: Path) -> None:
    check_visible(World(rank=1, size=2), tmp_path)
    with pytest.raises(ConfigError, match="cannot see the work area") as info:
        check_visible(World(rank=1, size=2), tmp_path / "absent")
    assert "shares" in (info.value.hint or "")


def test_what_is_not_split_yet_is_refused_under_torchrun() -> None:
    two = World(rank=0, size=2)
    check_world_options(SINGLE, error_compensation=True)
    check_world_options(two, error_compensation=False)
    with pytest.raises(ConfigError, match="error compensation"):
        check_world_options(two, error_compensation=True)


# -- real torchrun worlds (gloo)


def files(directory: Path) -> dict[str, bytes]:
    """Every file but the manifest (its creation time differs between runs)."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, stories_dir, tinystories_file) -> Path:
    out = tmp_path_factory.mktemp("one") / "w4"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's ranks (OMP_NUM_THREADS=1)
    try:
        api.compress(str(stories_dir), out, "w4", str(tinystories_file), calibration_overrides=CALIB)
    finally:
        torch.set_num_threads(before)
    return out


def torchrun(stories_dir: Path, tinystories_file: Path, out: Path, *extra: str, env: dict[str, str] | None = None):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        "compress",
        str(stories_dir),
        "-o",
        str(out),
        "--recipe",
        "w4",
        "--calibration",
        str(tinystories_file),
        "--num-samples",
        str(CALIB["num_samples"]),
        "--seq-len",
        str(CALIB["seq_len"]),
        "--json",
        *extra,
    ]
    child = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=child, timeout=300, check=False)


def json_results(stdout: str) -> list[dict]:
    """The JSON documents the ranks printed (each rank's is one small write to the pipe: never interleaved)."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find("{")
    while at >= 0:
        value, end = decoder.raw_decode(stdout, at)
        found.append(value)
        at = stdout.find("{", end)
    return found


def test_a_world_whose_ranks_disagree_on_the_seed_is_refused_on_every_rank(
    tmp_path, stories_dir, tinystories_file
) -> None:
    out = tmp_path / "disagree"
    run = torchrun(stories_dir, tinystories_file, out, "--seed", "{rank}")
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert output.count("Error: the 2 torchrun ranks disagree on the job: rank(s) [1]") == 2, output[-3000:]
    assert not out.exists()  # nothing was committed: rank 0 leaves no trace


def test_a_rank_that_fails_stops_the_others_with_one_line(tmp_path, stories_dir, tinystories_file) -> None:
    out = tmp_path / "failing"
    run = torchrun(stories_dir, tinystories_file, out, env={"SQUEEZE_TEST_FAIL_LOAD_RANK": "1"})
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "Error: test: rank 1 cannot load the model" in output, output[-3000:]  # rank 1's own error
    assert "Error: rank 1 of the torchrun world failed (load); its error is printed above" in output  # rank 0
    assert not out.exists()  # nothing was committed: rank 0 leaves no trace


def test_two_gloo_ranks_killed_mid_run_resume_to_the_bytes_one_process_writes(
    one_process, tmp_path, stories_dir, tinystories_file
) -> None:
    out = tmp_path / "killed"
    # stories260K has 5 layer groups: rank 1 owns groups 1 and 3, and dies as it starts group 3
    run = torchrun(
        stories_dir, tinystories_file, out, env={"SQUEEZE_TEST_DIE_RANK": "1", "SQUEEZE_TEST_DIE_AFTER": "1"}
    )
    assert run.returncode != 0
    work = out / WORK_NAME
    assert (work / "fisher.safetensors").is_file()
    assert (work / "groups" / "00001.safetensors").is_file()
    assert not (work / "groups" / "00003.safetensors").exists()
    assert not (out / MANIFEST_NAME).exists()

    rerun = torchrun(stories_dir, tinystories_file, out)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not work.exists()
    # the Fisher (2 + 3 windows, summed in rank order) and groups 0-2 of the first run, the rest of the rerun:
    # every byte as one process writes them
    assert files(out) == files(one_process)
    assert api.verify_model_integrity(out).ok
    results = json_results(rerun.stdout)
    assert len(results) == 1  # rank 0 speaks for the world: one JSON summary, not one per rank
    root = json.loads((out / MANIFEST_NAME).read_text())["root_digest"]
    assert results[0]["root_digest"] == root


def test_two_gloo_ranks_streaming_within_max_memory_write_the_bytes_one_process_writes(
    one_process, tmp_path, stories_dir, tinystories_file
) -> None:
    out = tmp_path / "bounded"
    run = torchrun(stories_dir, tinystories_file, out, "--max-memory", "64GB")
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (out / WORK_NAME).exists()
    # each rank streamed its windows (2 and 3) block by block, each group's sums added in rank order inside the
    # pass, the groups dealt round robin: every byte as one unbounded process writes them (and a bounded one)
    assert files(out) == files(one_process)
    (result,) = json_results(run.stdout)
    assert result["max_memory"] > 0 and result["peak_estimate_bytes"] > 0
