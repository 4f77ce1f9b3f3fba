from __future__ import annotations

import pytest
import torch.distributed as dist

from dlo_offload import RankGenerator, dlo_group_size, initialize_model_parallel, resolve_data_parallel_size


def test_rank_layout_follows_tp_sp_pp_cfg_dp_order() -> None:
    generator = RankGenerator(tp=2, sp=2, pp=1, cfg=1, dp=2)
    assert generator.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert generator.get_ranks("sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert generator.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert RankGenerator(1, 1, 1, 2, 2, rank_offset=4).get_ranks("cfg") == [[4, 5], [6, 7]]


def test_rank_generator_rejects_a_size_missing_from_the_order() -> None:
    with pytest.raises(RuntimeError, match="sp=2 is not 1 but 'sp' is missing from order 'tp-pp-cfg-dp'"):
        RankGenerator(1, 2, 1, 1, 1, order="tp-pp-cfg-dp")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"world_size": 8, "tensor_parallel_size": 2, "sequence_parallel_size": 2}, 2),
        ({"world_size": 4, "tensor_parallel_size": 2, "data_parallel_size": 2}, 2),
        ({"world_size": 4, "use_hsdp": True, "hsdp_shard_size": 4}, 1),
        ({"world_size": 3}, 3),
    ],
)
def test_dp_is_inferred_from_world(kwargs: dict, expected: int) -> None:
    world = kwargs.pop("world_size")
    assert resolve_data_parallel_size(world, **kwargs) == expected


@pytest.mark.parametrize(
    ("world", "kwargs", "match"),
    [
        (0, {}, r"WORLD size must be > 0, but got 0"),
        (8, {"tensor_parallel_size": 2, "data_parallel_size": 2}, r"data_parallel_size \(2\) does not match WORLD-derived value \(4\)"),
        (6, {"tensor_parallel_size": 4}, r"must be divisible by non-DP parallel size \(4\)"),
        (4, {"use_hsdp": True, "data_parallel_size": 2, "hsdp_shard_size": 4}, "HSDP \\(FSDP2\\) requires data_parallel_size to be 1"),
        (8, {"use_hsdp": True, "hsdp_replicate_size": 2, "hsdp_shard_size": 2}, r"WORLD size \(8\) must equal HSDP size \(2 x 2 = 4\)"),
    ],
)
def test_inconsistent_parallel_sizes_are_rejected(world: int, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_data_parallel_size(world, **kwargs)


@pytest.mark.parametrize(
    ("dp", "sp", "tp", "allgather", "expected"),
    [(1, 1, 1, True, 1), (2, 1, 1, True, 2), (1, 4, 1, True, 4), (2, 2, 2, True, 2), (2, 2, 2, False, 1), (1, 4, 2, False, 1)],
)
def test_dlo_group_covers_the_dp_sp_tp_matrix(dp: int, sp: int, tp: int, allgather: bool, expected: int) -> None:
    assert dlo_group_size(
        data_parallel_size=dp, sequence_parallel_size=sp, tensor_parallel_size=tp, use_allgather=allgather
    ) == expected


def test_hsdp_with_allgather_rejected_and_without_allowed() -> None:
    with pytest.raises(ValueError, match="incompatible with HSDP.*Pass use_allgather=False .* or use_hsdp=False"):
        dlo_group_size(use_hsdp=True, hsdp_shard_size=4)
    assert dlo_group_size(use_hsdp=True, hsdp_shard_size=4, use_allgather=False) == 1


def test_resident_layers_with_allgather_rejected() -> None:
    with pytest.raises(ValueError, match="resident_layers=2 requires use_allgather=False"):
        dlo_group_size(data_parallel_size=2, resident_layers=2)
    with pytest.raises(ValueError, match="resident_layers must be >= 0, got -1"):
        dlo_group_size(resident_layers=-1, use_allgather=False)
    assert dlo_group_size(data_parallel_size=2, resident_layers=2, use_allgather=False) == 1


def test_initialization_needs_torch_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("needs a process without a default group")
    with pytest.raises(RuntimeError, match="torch.distributed must be initialized before model parallel initialization"):
        initialize_model_parallel(tensor_parallel_size=1)
