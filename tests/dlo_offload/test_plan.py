from __future__ import annotations

import pytest
from dlo_test_models import make_model, make_two_list_model
from torch import nn

from dlo_offload import OffloadPlan, check_allgather_plan, enable_layerwise_offload, resolve_plan


def test_resolves_blocks_resident_count_and_modules() -> None:
    model = make_model(num_blocks=4)
    resolved = resolve_plan(model, OffloadPlan("blocks", resident_blocks=1, resident_modules=("embed", "head")))
    assert resolved.block_names == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert [n for n, _ in resolved.streamed] == ["blocks.1", "blocks.2", "blocks.3"]
    assert [n for n, _ in resolved.resident] == ["blocks.0"]
    assert [n for n, _ in resolved.resident_modules] == ["embed", "head"]


def test_resident_count_larger_than_the_list_keeps_every_block_resident() -> None:
    resolved = resolve_plan(make_model(num_blocks=2), OffloadPlan("blocks", resident_blocks=9))
    assert resolved.resident_count == 2 and resolved.streamed == ()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"blocks": ""}, ValueError, "dotted path of the model's block list"),
        ({"blocks": ()}, ValueError, "non-empty tuple of such paths"),
        ({"blocks": ("double_blocks", "")}, ValueError, "non-empty tuple of such paths"),
        ({"blocks": ("double_blocks", "double_blocks")}, ValueError, "lists a path twice"),
        ({"blocks": "blocks", "resident_blocks": -1}, ValueError, "must be >= 0, got -1"),
        ({"blocks": "blocks", "resident_blocks": 1.5}, TypeError, "must be an int"),
        ({"blocks": "blocks", "resident_modules": "embed"}, TypeError, "tuple of non-empty dotted paths"),
        ({"blocks": "blocks", "resident_modules": ("embed", "embed")}, ValueError, "lists a path twice"),
    ],
)
def test_invalid_plans_are_rejected_at_construction(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        OffloadPlan(**kwargs)


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (
            OffloadPlan("layers"),
            r"'layers' does not name a submodule of TinyDiT; its top-level children are \['embed', 'blocks', 'head'\]",
        ),
        (OffloadPlan("embed"), "is a Linear; it must be the nn.ModuleList"),
        (OffloadPlan("blocks", resident_modules=("final_norm",)), "resident_modules path 'final_norm' does not name"),
        (OffloadPlan("blocks", resident_modules=("blocks.0",)), "overlaps the block list"),
    ],
)
def test_plans_that_do_not_fit_the_model_are_rejected(plan: OffloadPlan, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_plan(make_model(), plan)


def test_empty_block_list_is_rejected() -> None:
    model = make_model()
    model.blocks = nn.ModuleList()
    with pytest.raises(ValueError, match="is empty: there is nothing to offload"):
        resolve_plan(model, OffloadPlan("blocks"))


def test_tied_tensors_across_blocks_or_with_resident_modules_are_rejected() -> None:
    model = make_model(num_blocks=3)
    model.blocks[2].qkv.weight = model.blocks[0].qkv.weight
    with pytest.raises(ValueError, match="blocks 'blocks.0' and 'blocks.2' share a parameter"):
        resolve_plan(model, OffloadPlan("blocks"))
    model = make_model(num_blocks=3)
    model.head.weight = model.blocks[1].mlp[2].weight
    with pytest.raises(ValueError, match="resident module 'head' shares a tensor with block 'blocks.1'"):
        resolve_plan(model, OffloadPlan("blocks", resident_modules=("head",)))


def test_a_group_without_initialized_torch_distributed_is_rejected() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs a process without a default group")
    model = make_model(num_blocks=3)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        enable_layerwise_offload(model, OffloadPlan("blocks", resident_blocks=1), device="cpu", group=object())  # type: ignore[arg-type]


def test_resident_blocks_need_rank_local_mode_when_sharding() -> None:
    with pytest.raises(
        ValueError,
        match=r"OffloadPlan\(resident_blocks=2\) was combined with use_allgather=True.*"
        "Pass use_allgather=False or resident_blocks=0",
    ):
        check_allgather_plan(2, use_allgather=True)
    check_allgather_plan(2, use_allgather=False)
    check_allgather_plan(0, use_allgather=True)


def test_several_block_lists_resolve_in_execution_order() -> None:
    model = make_two_list_model(num_double=2, num_single=3)
    plan = OffloadPlan(["double_blocks", "single_blocks"], resident_blocks=3, resident_modules=("embed", "head"))
    assert plan.blocks == ("double_blocks", "single_blocks") and plan.block_lists == plan.blocks
    assert OffloadPlan("blocks").block_lists == ("blocks",)
    resolved = resolve_plan(model, plan)
    assert resolved.block_names == (
        "double_blocks.0",
        "double_blocks.1",
        "single_blocks.0",
        "single_blocks.1",
        "single_blocks.2",
    )
    assert resolved.blocks == (*model.double_blocks, *model.single_blocks)
    # resident_blocks counts across the lists: both double blocks and the first single block stay.
    assert [n for n, _ in resolved.resident] == ["double_blocks.0", "double_blocks.1", "single_blocks.0"]
    assert [n for n, _ in resolved.streamed] == ["single_blocks.1", "single_blocks.2"]


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (OffloadPlan(("double_blocks", "double_blocks.0")), "paths 'double_blocks' and 'double_blocks.0' overlap"),
        (OffloadPlan(("double_blocks", "layers")), "'layers' does not name a submodule"),
        (OffloadPlan(("double_blocks", "embed")), "'embed' is a Linear"),
        (
            OffloadPlan(("double_blocks", "single_blocks"), resident_modules=("single_blocks.1",)),
            "overlaps the block list 'single_blocks'",
        ),
    ],
)
def test_several_block_lists_that_do_not_fit_the_model_are_rejected(plan: OffloadPlan, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_plan(make_two_list_model(), plan)


def test_a_tensor_tied_across_two_block_lists_is_rejected() -> None:
    model = make_two_list_model()
    model.single_blocks[0].norm.weight = model.double_blocks[1].norm.weight
    with pytest.raises(ValueError, match="blocks 'double_blocks.1' and 'single_blocks.0' share a parameter"):
        resolve_plan(model, OffloadPlan(("double_blocks", "single_blocks")))
