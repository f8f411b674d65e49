"""The compress modes as a 2 x 2 product: the torchrun modes derived from the one-process pipelines (each stage
placed on its ranks, one override for the world-wide sensitivity), and every stage function with a name of its
own (the byte-identity of the modes is tested in test_streaming.py and test_distributed.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from squeeze.compression.pipelines import Pipeline, plain, registered
from squeeze.compression.pipelines.bounded import BOUNDED, bounded_world_sensitivity_stage
from squeeze.compression.pipelines.torchrun import BOUNDED_DATA_PARALLEL, DATA_PARALLEL, PLACEMENT, across_ranks
from squeeze.compression.sensitivity import world_sensitivity_stage

T = TypeVar("T")


@dataclass
class RecordingWorld:
    """A rank of a world that records each step's label instead of exchanging a status row."""

    rank: int
    steps: list[str] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def step(self, what: str, fn: Callable[[], T], payload: Any = None) -> tuple[T, list[bytes]]:
        self.steps.append(what)
        return fn(), []


@dataclass
class FakeJob:
    world: RecordingWorld
    ran: list[str] = field(default_factory=list)


def recording(name: str) -> Callable[[Any], None]:
    def stage(job: Any) -> None:
        job.ran.append(name)

    stage.__name__ = f"odd_{name}_stage"  # the step is labelled by the pipeline's stage name, not this
    return stage


def test_torchrun_modes_are_the_one_process_stages_with_the_world_wide_sensitivity() -> None:
    assert sorted(registered()) == ["bounded", "bounded_data_parallel", "data_parallel", "plain"]
    for one, world, sensitivity in (
        (plain.PLAIN, DATA_PARALLEL, world_sensitivity_stage),
        (BOUNDED, BOUNDED_DATA_PARALLEL, bounded_world_sensitivity_stage),
    ):
        assert world.names == one.names
        assert dict(world.stages)["sensitivity"] is sensitivity
        assert dict(one.stages)["sensitivity"] is not sensitivity
        # every other stage is placed, not replaced: a wrapper around the one-process stage
        for (name, placed), (_, stage) in zip(world.stages, one.stages, strict=True):
            if name != "sensitivity":
                assert placed is not stage and placed.__closure__ is not None
                assert any(cell.cell_contents is stage for cell in placed.__closure__)


#: the steps every rank takes part in, labelled by stage name (plan's two: rank 0 first, then the others)
STEPS = ["calibrate", "plan", "plan", "quantize", "seal"]


@pytest.mark.parametrize(
    ("rank", "ran", "steps"),
    [
        # rank 0: every stage, plan in the first of its two steps (rank 0 commits, then the others read it back)
        (0, ["calibrate", "sensitivity", "plan", "quantize", "seal"], STEPS),
        # rank 1: no rank-0-only stage; plan in the second step, after rank 0's
        (1, ["calibrate", "sensitivity", "plan", "quantize"], STEPS),
    ],
)
def test_each_stage_runs_on_the_ranks_its_placement_names(rank: int, ran: list[str], steps: list[str]) -> None:
    names = ("calibrate", "sensitivity", "plan", "quantize", "seal")
    toy = Pipeline("toy", tuple((name, recording(name)) for name in names))
    derived = across_ranks(toy, "toy_parallel", recording("sensitivity"))
    job = FakeJob(RecordingWorld(rank))
    for _name, stage in derived.stages:
        stage(job)  # type: ignore[arg-type]
    assert job.ran == ran
    assert job.world.steps == steps  # the world-wide sensitivity communicates itself: no step of its own here


def test_a_stage_without_a_placement_is_refused_naming_it() -> None:
    stage = recording("x")
    with pytest.raises(ValueError, match=r"stage 'dance' of the 'toy' compress mode has no placement .*PLACEMENT"):
        across_ranks(Pipeline("toy", (("sensitivity", stage), ("dance", stage))), "t", stage)
    with pytest.raises(ValueError, match="the 'toy' compress mode has no 'sensitivity' stage"):
        across_ranks(Pipeline("toy", (("load", stage),)), "t", stage)


def test_every_stage_the_modes_run_has_a_name_of_its_own() -> None:
    # the bounded forms of load / sensitivity / quantize / write were once defined under the plain ones' names
    functions = [stage for pipeline in (plain.PLAIN, BOUNDED) for _, stage in pipeline.stages]
    functions += [world_sensitivity_stage, bounded_world_sensitivity_stage]
    by_name: dict[str, set[Any]] = {}
    for stage in functions:
        by_name.setdefault(stage.__name__, set()).add(stage)
    assert {name: fns for name, fns in by_name.items() if len(fns) > 1} == {}
    assert set(PLACEMENT) | {"sensitivity"} == set(plain.PLAIN.names) | set(BOUNDED.names)
