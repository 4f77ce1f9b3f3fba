"""Worker row table: install validation, generation rules, retire by (id, generation)."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.metadata import DiffusionKVContextMetadata, DiffusionKVMetadata, DiffusionKVSequenceMetadata
from diffusion_kv.worker import RowIdentity, WorkerRowTable


def table(num_rows=4, max_rows=2, num_blocks=8, block_size=4, max_model_len=16):
    return WorkerRowTable(
        num_rows=num_rows,
        max_rows_per_request=max_rows,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        registered_roles={"primary", "ar_decode"},
    )


def seq(sequence_id, blocks, seq_len=None, prefix_len=2):
    seq_len = seq_len if seq_len is not None else 4 * len(blocks)
    return DiffusionKVSequenceMetadata(sequence_id, prefix_len, seq_len - prefix_len, seq_len, (list(blocks),))


def meta(request_id="r", generation=1, sequences=None, contexts=()):
    sequences = sequences if sequences is not None else (seq(0, [3, 1], seq_len=7),)
    return DiffusionKVMetadata(request_id, generation, tuple(sequences), tuple(contexts))


def state(t):
    return (t.block_tables.clone(), t.num_free_rows, t.installed_request_ids, t.version)


def test_install_writes_rows_from_the_top_of_the_free_stack():
    t = table()
    ctx = DiffusionKVContextMetadata("ar", "ar_decode", 5, ([6, 0],))
    assert t.install(meta(sequences=(seq(0, [3, 1], seq_len=7),), contexts=(ctx,)))
    primary = t.row(RowIdentity("r", sequence_id=0))
    context = t.row(RowIdentity("r", context_id="ar"))
    assert (primary.index, primary.cache_role, primary.num_tokens) == (0, "primary", 7)
    assert (context.index, context.cache_role, context.num_tokens) == (1, "ar_decode", 5)
    assert t.block_tables[:2].tolist() == [[3, 1, 0, 0], [6, 0, 0, 0]]
    assert t.num_free_rows == 2


@pytest.mark.parametrize(
    "bad,match",
    [
        (
            meta(sequences=(seq(0, [3]),), contexts=(DiffusionKVContextMetadata("c", "cross.text", 4, ([2],)),)),
            r"context 'c' uses unregistered cache role 'cross.text'; registered roles=\['ar_decode', 'primary'\]",
        ),
        (meta(sequences=(seq(0, [1]), seq(0, [2]))), "Duplicate diffusion KV row identity"),
        (meta(sequences=(seq(0, [1, 2], seq_len=4),)), "has 2 blocks; expected 1 for 4 tokens"),
        (meta(sequences=(seq(0, [1, 8]),)), r"block id 8; ids must be ints in \[0, 8\)"),
        (meta(sequences=(seq(0, [1, 2, 3, 4, 5]),)), "beyond the row capacity of 4 blocks"),
        (meta(sequences=(seq(0, [1]), seq(1, [2]), seq(2, [3]))), "requires 3 rows; max_rows_per_request is 2"),
        (meta(sequences=(DiffusionKVSequenceMetadata(0, 0, 4, 4, ([1], [2])),)), "has 2 block groups; expected 1"),
        (meta(sequences=(DiffusionKVSequenceMetadata(0, 0, 4, 4, ((1,),)),)), "block ids must be a list"),
        (meta(sequences=()), "has no sequences"),
        (meta(request_id=""), "request_id must be a non-empty str"),
        (meta(generation=-1), "allocation_generation must be an int >= 0"),
    ],
)
def test_bad_metadata_is_rejected_and_changes_nothing(bad, match):
    t = table()
    t.install(meta("other", sequences=(seq(0, [5]),)))
    before = state(t)
    with pytest.raises(ValueError, match=match):
        t.install(bad)
    after = state(t)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


def test_generation_rules_for_an_installed_request():
    t = table()
    assert t.install(meta(generation=5)) is True
    version = t.version
    with pytest.raises(
        ValueError, match="Stale Diffusion KV allocation generation 4 for request 'r'; installed generation is 5"
    ):
        t.install(meta(generation=4))
    with pytest.raises(ValueError, match="Conflicting Diffusion KV allocation snapshot for active request 'r'"):
        t.install(meta(generation=6, sequences=(seq(0, [2, 1], seq_len=7),)))
    assert t.install(meta(generation=5)) is False  # same: no-op
    assert t.install(meta(generation=9)) is False  # newer, identical: only the generation moves
    assert t.generation_of("r") == 9 and t.version == version and t.num_free_rows == 3


def test_retire_by_generation_never_removes_a_reused_id():
    t = table()
    t.install(meta(generation=1))
    assert t.remove([("r", 1)]) == 1
    t.install(meta(generation=2, sequences=(seq(0, [4, 2], seq_len=8),)))
    assert t.remove([("r", 1)]) == 0  # old cleanup arrives late
    assert t.block_tables[t.row(RowIdentity("r", sequence_id=0)).index, :2].tolist() == [4, 2]
    assert t.remove(["r", "never-installed"]) == 1
    assert t.num_free_rows == 4 and not t.installed_request_ids
    assert not t.block_tables.any()
    with pytest.raises(KeyError, match="is not installed on this worker"):
        t.row(RowIdentity("r", sequence_id=0))


def test_pool_exhaustion_names_free_rows():
    t = table(num_rows=2, max_rows=2)
    t.install(meta("a", sequences=(seq(0, [1]), seq(1, [2]))))
    with pytest.raises(ValueError, match="Diffusion KV request 'b' requires 1 rows, but only 0 rows are free"):
        t.install(meta("b", sequences=(seq(0, [3]),)))


def test_row_identity_needs_exactly_one_owner():
    with pytest.raises(ValueError, match="exactly one of sequence_id / context_id"):
        RowIdentity("r", sequence_id=0, context_id="c")
    with pytest.raises(ValueError, match="exactly one of sequence_id / context_id"):
        RowIdentity("r")


def test_table_geometry_is_validated():
    with pytest.raises(ValueError, match=r"num_rows \(5\) must be a multiple of max_rows_per_request \(2\)"):
        table(num_rows=5)
