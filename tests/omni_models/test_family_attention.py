"""omni's attention for the families: the ragged-text path, the processors against diffusers' own, and the
optional-dependency boundary (``import omni_models`` and the shipped model never need diffusers)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from omni_models.attention import BACKENDS, RowLengths, attention, row_lengths


def _reference(query, key, value, keep):
    """SDPA over the kept key positions only, one row at a time."""
    rows = []
    for r in range(query.shape[0]):
        q, k, v = (x[r : r + 1, keep[r]].transpose(1, 2) for x in (query, key, value))
        rows.append(F.scaled_dot_product_attention(q, k, v).transpose(1, 2)[0])
    return rows


@pytest.mark.parametrize("lengths", [(16, 9, 13), (9, 13, 9), (16, 16, 16)])
def test_ragged_rows_attend_only_to_their_own_leading_positions(lengths):
    torch.manual_seed(0)
    padded = 16
    query, key, value = (torch.randn(3, padded, 2, 8) for _ in range(3))
    out = attention(query, key, value, RowLengths(lengths))
    keep = [list(range(n)) for n in lengths]
    for r, expected in enumerate(_reference(query, key, value, keep)):
        torch.testing.assert_close(out[r, keep[r]], expected, rtol=0, atol=1e-6)
        assert not out[r, lengths[r] :].any()  # padding positions produce zeros
    assert row_lengths([4, 4], 4) is None and row_lengths([4, 3], 4) == RowLengths((4, 3))
    assert [backend.name for backend in BACKENDS] == ["sdpa"]


def test_bad_row_lengths_are_refused():
    with pytest.raises(ValueError, match="positive ints"):
        RowLengths((4, 0))
    query = torch.randn(2, 4, 1, 8)
    with pytest.raises(ValueError, match="exceed the padded length 4"):
        attention(query, query, query, RowLengths((5, 2)))
    with pytest.raises(ValueError, match="2 rows"):
        attention(query, query, query, RowLengths((3,)))


def test_the_processors_compute_what_diffusers_processors_compute():
    pytest.importorskip("diffusers")
    from omni_models import synthetic
    from omni_models.family_attention import OmniFluxAttnProcessor, OmniQwenImageAttnProcessor

    generator = torch.Generator().manual_seed(0)
    flux = synthetic.flux_components("tiny")["transformer"]
    flux_inputs = dict(
        hidden_states=torch.randn(2, 64, 16, generator=generator),
        encoder_hidden_states=torch.randn(2, 10, 32, generator=generator),
        pooled_projections=torch.randn(2, 32, generator=generator),
        timestep=torch.tensor([0.5, 0.7]),
        guidance=torch.tensor([3.5, 2.0]),
        txt_ids=torch.zeros(10, 3),
        img_ids=torch.randn(64, 3, generator=generator),
        return_dict=False,
    )
    qwen = synthetic.qwen_image_components("tiny")["transformer"]
    text = torch.randn(2, 7, 16, generator=generator)
    qwen_inputs = dict(
        hidden_states=torch.randn(2, 16, 16, generator=generator),
        encoder_hidden_states=text,
        timestep=torch.tensor([0.5, 0.7]),
        img_shapes=[[(1, 4, 4)]] * 2,
        return_dict=False,
    )
    with torch.no_grad():
        flux_expected, qwen_expected = flux(**flux_inputs)[0], qwen(**qwen_inputs)[0]
        row_alone = qwen(
            **{
                **qwen_inputs,
                "hidden_states": qwen_inputs["hidden_states"][1:],
                "encoder_hidden_states": text[1:, :4],
                "timestep": torch.tensor([0.7]),
                "img_shapes": [[(1, 4, 4)]],
            }
        )[0]
        flux.set_attn_processor(OmniFluxAttnProcessor())
        qwen.set_attn_processor(OmniQwenImageAttnProcessor())
        assert torch.equal(flux(**flux_inputs)[0], flux_expected)
        assert torch.equal(qwen(**qwen_inputs)[0], qwen_expected)
        # Row 1 uses 4 of the 7 text positions: it equals that row run alone with its 4 tokens.
        padded = text.clone()
        padded[1, 4:] = 0
        ragged = qwen(**{**qwen_inputs, "encoder_hidden_states": padded, "attention_kwargs": {"text_lengths": [7, 4]}})[
            0
        ]
    # A ragged batch attends in [image, text] order (each row's padding is then a tail the attention skips
    # without copies): the same keys in another order, so equal within float32 summation-order rounding.
    torch.testing.assert_close(ragged[0], qwen_expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ragged[1], row_alone[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"text_lengths \[7, 8\] must each be in \[1, 7\]"):
        qwen(**{**qwen_inputs, "attention_kwargs": {"text_lengths": [7, 8]}})


def test_omni_models_works_without_diffusers_and_says_what_to_install(flux_dev_dir):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["diffusers"] = None  # as if diffusers were not installed
        import omni_models
        pipe = omni_models.load("omni-shapes-tiny")
        assert pipe("a red circle", num_inference_steps=2, seed=0)[0].size == (32, 32)
        assert "transformers" not in sys.modules and "omni_models.diffusers_adapter" not in sys.modules
        try:
            omni_models.load({str(flux_dev_dir)!r})
        except omni_models.MissingDependencyError as error:
            print(error)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "install them with pip install 'omni-models[diffusers]'" in result.stdout
