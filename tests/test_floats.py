import math

import matplotlib
import pytest
import torch

from course_lib import data, floats, models

matplotlib.use("Agg")


# ------------------------------------------------------------------------------------------- formats


def test_fp16_facts():
    f = floats.format_info("fp16")
    assert (f.bits, f.sign_bits, f.exponent_bits, f.mantissa_bits, f.exponent_bias) == (16, 1, 5, 10, 15)
    assert f.max == 65504.0
    assert f.smallest_normal == 2.0**-14
    assert f.smallest_subnormal == 2.0**-24
    assert f.eps == 2.0**-10


def test_bf16_has_the_fp32_range_and_a_coarser_precision():
    bf16, fp32 = floats.format_info(torch.bfloat16), floats.format_info("float32")
    assert (bf16.exponent_bits, bf16.mantissa_bits, bf16.exponent_bias) == (8, 7, 127)
    assert (fp32.exponent_bits, fp32.mantissa_bits) == (8, 23)
    assert bf16.eps == 2.0**-7 and fp32.eps == 2.0**-23
    assert bf16.smallest_normal == fp32.smallest_normal == 2.0**-126
    assert bf16.smallest_subnormal == 2.0**-133 and fp32.smallest_subnormal == 2.0**-149
    assert bf16.max == pytest.approx(fp32.max, rel=2**-7)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_smallest_subnormal_is_smallest_normal_times_eps(fmt):
    f = floats.format_info(fmt)
    assert f.smallest_subnormal == f.smallest_normal * f.eps
    assert f.sign_bits + f.exponent_bits + f.mantissa_bits == f.bits


def test_format_names_and_errors():
    assert floats.format_name("half") == "fp16"
    assert floats.format_name("torch.bfloat16") == "bf16"
    assert floats.format_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="'fp16'"):
        floats.format_name("fp8")
    with pytest.raises(ValueError, match="torch.float32"):
        floats.format_name(torch.int8)


def test_render_format_table_lists_the_facts():
    text = floats.render_format_table()
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].startswith("format")
    fp16 = next(line for line in lines if line.startswith("fp16"))
    assert "65504" in fp16 and "2^-14" in fp16 and "2^-24" in fp16 and "2^-10" in fp16


# ------------------------------------------------------------------------------------------- bits


@pytest.mark.parametrize(
    ("x", "fmt", "bits"),
    [
        (1.0, "fp16", ("0", "01111", "0000000000")),
        (-2.0, "bf16", ("1", "10000000", "0000000")),
        (65504.0, "fp16", ("0", "11110", "1111111111")),
        (0.1, "fp32", ("0", "01111011", "10011001100110011001101")),  # 0x3DCCCCCD
        (2.0**-24, "fp16", ("0", "00000", "0000000001")),  # the smallest subnormal
        (float("inf"), "fp16", ("0", "11111", "0000000000")),
    ],
)
def test_float_bits_known_patterns(x, fmt, bits):
    b = floats.float_bits(x, fmt)
    assert (b.sign, b.exponent, b.mantissa) == bits
    assert str(b) == " ".join(bits)


def test_rounding_underflow_overflow_subnormal():
    assert floats.rounding(1e-8, "fp16").status == "underflow"
    assert floats.rounding(1e-8, "fp16").stored == 0.0
    assert floats.rounding(1e-8, "bf16").status == "normal"
    assert floats.rounding(1e-8, "bf16").stored == pytest.approx(1e-8, rel=2**-8)
    assert floats.rounding(70000, "fp16").status == "overflow"
    assert math.isinf(floats.rounding(70000, "fp16").stored)
    assert floats.rounding(70000, "bf16").status == "normal"
    assert floats.rounding(1e-5, "fp16").status == "subnormal"
    assert floats.rounding(0.0, "fp16").status == "zero"
    assert floats.rounding(float("nan"), "fp16").status == "nan"
    assert floats.rounding(float("nan"), "bf16").rel_error == 0.0  # nan stays nan: no error (nan != nan)
    assert floats.rounding(float("inf"), "fp16").rel_error == 0.0


def test_rounding_is_round_to_nearest_even():
    assert floats.rounding(2.0**-25, "fp16").stored == 0.0  # a tie between 0 and 2^-24: even is 0
    assert floats.rounding(3 * 2.0**-25, "fp16").stored == 2.0**-23  # tie between 2^-24 and 2^-23
    r = floats.rounding(1 + 2.0**-11, "fp16")  # halfway between 1 and 1 + eps
    assert r.stored == 1.0 and not r.exact and r.rel_error == pytest.approx(2.0**-11 / (1 + 2.0**-11))
    assert floats.rounding(0.5, "bf16").exact


def test_loss_scaling_rescues_a_value_that_underflows():
    assert floats.rounding(1e-8, "fp16").status == "underflow"
    assert floats.rounding(1e-8 * 2**16, "fp16").status == "normal"


def test_rounding_rejects_text_with_advice():
    with pytest.raises(ValueError, match="1e-8"):
        floats.rounding("abc", "fp16")


def test_describe_number_flags_each_format():
    text = floats.describe_number(1e-8)
    line = {row.split()[0]: row for row in text.splitlines()[2:]}
    assert "UNDERFLOW" in line["fp16"] and "UNDERFLOW" not in line["bf16"]
    scaled = floats.describe_number(1e-8, scale=2**16)
    assert "UNDERFLOW" not in scaled and "scale 65536" in scaled


# ------------------------------------------------------------------------------------------- underflow


def test_underflow_stats_counts_exactly():
    g = torch.tensor([1e-8, 1e-5, 1.0, 0.0, 1e5])
    s = floats.underflow_stats(g, "fp16")
    assert (s["values"], s["nonzero"], s["underflow"], s["subnormal"], s["overflow"]) == (5, 4, 1, 1, 1)
    assert s["underflow_share"] == 0.25
    scaled = floats.underflow_stats(g, "fp16", scale=2**16)
    assert (scaled["underflow"], scaled["subnormal"], scaled["overflow"]) == (0, 0, 2)  # 1 x 2^16 > 65504
    assert floats.underflow_stats(g, "bf16")["underflow"] == 0


def test_underflow_stats_accepts_dicts_and_lists_and_checks_input():
    a, b = torch.tensor([1e-8, 1.0]), torch.tensor([[1e-9]])
    assert floats.underflow_stats({"a": a, "b": b})["underflow"] == 2
    assert floats.underflow_stats([a, b])["nonzero"] == 3
    with pytest.raises(ValueError, match="2\\*\\*16"):
        floats.underflow_stats(a, scale=0)
    with pytest.raises(ValueError, match="No gradients"):
        floats.underflow_stats([])


def test_grad_log2_hist_counts_nonzero_values_and_shifts_with_scale():
    g = torch.tensor([2.0**-20, 2.0**-10, 0.0, -1.0])
    counts, edges = floats.grad_log2_hist(g)
    assert counts.sum() == 3
    counts16, edges16 = floats.grad_log2_hist(g, scale=2**16, bins=edges + 16)
    assert (counts16 == counts).all()
    r = floats.format_log2_range("fp16")
    assert r == {"smallest_subnormal": -24.0, "smallest_normal": -14.0, "max": math.log2(65504)}


@pytest.fixture(scope="module")
def real_grads():
    tok = models.load_tokenizer("embedded")
    split = data.tokenize_dataset(data.load_mrpc("embedded")["train"].select(range(16)), tok)
    batch = next(iter(data.make_dataloader(split, tok, batch_size=16)))
    torch.manual_seed(0)
    model = models.load_model("embedded")
    return model, batch, floats.fp32_gradients(model, batch)


def test_real_gradients_underflow_less_when_the_loss_is_scaled(real_grads):
    model, _, grads = real_grads
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(
        g.dtype == torch.float32 and g.shape == p.shape
        for (_, g), p in zip(grads.items(), model.parameters())
    )
    assert all(p.grad is None for p in model.parameters())  # left clean
    small = {n: g * 2.0**-10 for n, g in grads.items()}
    unscaled = floats.underflow_stats(small, "fp16")
    scaled = floats.underflow_stats(small, "fp16", scale=2**16)
    assert unscaled["nonzero"] > 0 and unscaled["underflow_share"] > 0.01
    assert scaled["underflow_share"] < unscaled["underflow_share"] / 10
    assert floats.underflow_stats(small, "bf16")["underflow"] == 0


def test_loss_factor_scales_gradients_linearly(real_grads):
    model, batch, _ = real_grads
    model.eval()  # no dropout: the two backward passes see the same network
    base = floats.fp32_gradients(model, batch)
    half = floats.fp32_gradients(model, batch, loss_factor=0.5)
    model.train()
    name = "classifier.weight"
    torch.testing.assert_close(half[name], base[name] * 0.5)


def test_plot_grad_hist_draws_both_scales():
    ax = floats.plot_grad_hist(torch.tensor([1e-8, 1e-5, 0.1]), scales=(1.0, 2.0**16))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "loss x 1 (unscaled)" in labels and "loss x 2^16" in labels
