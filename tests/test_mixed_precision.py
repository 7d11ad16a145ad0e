"""Precision policy: names, dtypes, warnings, and which precision to use (course_lib.mixed_precision)."""

import warnings

import pytest
import torch

from course_lib import mixed_precision as mp


@pytest.mark.parametrize(
    ("given", "expected"),
    [("no", "no"), (None, "no"), ("fp32", "no"), ("FP16", "fp16"), ("bfloat16", "bf16"), (" bf16 ", "bf16")],
)
def test_normalize_precision(given, expected):
    assert mp.normalize_precision(given) == expected


@pytest.mark.parametrize("bad", ["fp8", "half-ish", "int8", ""])
def test_unknown_precision_is_rejected(bad):
    with pytest.raises(ValueError, match="use 'no'"):
        mp.normalize_precision(bad)


def test_fp16_on_cpu_warns_and_bf16_does_not_when_native(monkeypatch):
    monkeypatch.setattr(mp, "cpu_has_fast_bf16", lambda: True)
    with pytest.warns(mp.PrecisionWarning, match="fp16 on a CPU is a trap"):
        assert mp.check_precision("fp16", "cpu") == "fp16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mp.check_precision("bf16", "cpu") == "bf16"
        assert mp.check_precision("no", "cpu") == "no"


def test_bf16_on_cpu_without_native_support_warns(monkeypatch):
    monkeypatch.setattr(mp, "cpu_has_fast_bf16", lambda: False)
    with pytest.warns(mp.PrecisionWarning, match="emulated"):
        mp.check_precision("bf16", "cpu")
    assert mp.best_precision("cpu") == "no"


def test_best_precision_on_cpu_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(mp, "cpu_has_fast_bf16", lambda: True)
    assert mp.best_precision("cpu", measure=False) == "bf16"


def test_autocast_dtype():
    assert mp.autocast_dtype("bf16") is torch.bfloat16
    assert mp.autocast_dtype("fp16") is torch.float16
    assert mp.autocast_dtype("no") is torch.float32


def test_measured_best_precision_follows_the_measurement(monkeypatch):
    import course_lib.instruments.throughput as throughput

    monkeypatch.setattr(mp, "cpu_has_fast_bf16", lambda: True)
    speeds = {torch.float32: 100.0, torch.bfloat16: 300.0}
    monkeypatch.setattr(
        throughput, "matmul_gflops", lambda dtype, device=None, n=None: {"gflops": speeds[dtype]}
    )
    assert mp.best_precision("cpu", measure=True) == "bf16"
    speeds[torch.bfloat16] = 50.0
    assert mp.best_precision("cpu", measure=True) == "no"


def test_one_table_maps_names_to_dtypes_and_labels():
    assert {name: (p.dtype, p.label) for name, p in mp.PRECISIONS.items()} == {
        "no": (torch.float32, "fp32"),
        "fp16": (torch.float16, "fp16"),
        "bf16": (torch.bfloat16, "bf16"),
    }
    assert [mp.precision_label(x) for x in ("fp32", "float16", "bf16")] == ["fp32", "fp16", "bf16"]


# Matmul GFLOP/s as measured on each kind of machine (the course's CI machines and the lessons' own runs), faked here
# so the verdicts are tested without such a machine.
MACHINES = {
    "intel_no_amx": ("cpu", {"no": 330.0, "bf16": 166.0, "fp16": 311.0}, None),
    "intel_amx": ("cpu", {"no": 300.0, "bf16": 1500.0, "fp16": 1400.0}, None),
    "amd_zen4": ("cpu", {"no": 170.0, "bf16": 390.0, "fp16": 0.4}, None),
    "apple_mps": ("mps", {"no": 3000.0, "fp16": 5000.0}, None),
    "ampere_gpu": ("cuda", {"no": 19000.0, "bf16": 150000.0, "fp16": 150000.0}, (8, 0)),
    "older_gpu": ("cuda", {"no": 14000.0, "fp16": 110000.0, "bf16": 14000.0}, (7, 0)),
}
EXPECTED = {  # machine: (fastest, safe default, phrases the summary must contain)
    "intel_no_amx": (
        "no",
        "no",
        [
            "BF16: FP32 の 0.50 倍（このマシンでは遅い）",
            "FP16: FP32 の 0.94 倍（このマシンでは FP32 とほぼ同じ）",
        ],
    ),
    "intel_amx": (
        "bf16",
        "bf16",
        ["BF16: FP32 の 5.00 倍（このマシンでは速い）", "トレーニングに使いません"],
    ),
    "amd_zen4": (
        "bf16",
        "bf16",
        ["BF16: FP32 の 2.29 倍（このマシンでは速い）", "FP16: FP32 の 0.00 倍（このマシンでは遅い）"],
    ),
    "apple_mps": ("fp16", "fp16", ["FP16: FP32 の 1.67 倍（このマシンでは速い）"]),
    "ampere_gpu": (
        "bf16",
        "bf16",
        ["BF16: FP32 の 7.89 倍（このマシンでは速い）", "FP16: FP32 の 7.89 倍（このマシンでは速い）"],
    ),
    "older_gpu": (
        "fp16",
        "fp16",
        [
            "FP16: FP32 の 7.86 倍（このマシンでは速い）",
            "BF16 には compute capability 8.0 以上の GPU が必要です",
        ],
    ),
}


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_precision_advice_follows_the_measurement_on_every_kind_of_machine(machine):
    device_type, gflops, capability = MACHINES[machine]
    advice = mp.advise_precision(device_type, gflops, capability)
    fastest, safe, phrases = EXPECTED[machine]
    assert (advice.fastest, advice.safe_default) == (fastest, safe), advice.summary()
    text = advice.summary()
    for phrase in phrases:
        assert phrase in text, text
    if device_type == "cpu":
        assert "FP16: " in text and "トレーニングに使いません" in text  # never fp16 on a CPU
        assert advice.fastest != "bf16" or advice.speedups["bf16"] >= mp.FASTER  # bf16 only where faster


def test_advice_needs_fp32_to_compare_against():
    with pytest.raises(ValueError, match="fp32"):
        mp.advise_precision("cpu", {"bf16": 100.0})


def test_best_precision_on_cpu_measures_by_default(monkeypatch):
    import course_lib.instruments.throughput as throughput

    monkeypatch.setattr(mp, "cpu_has_fast_bf16", lambda: True)
    speeds = {torch.float32: 330.0, torch.bfloat16: 166.0}
    monkeypatch.setattr(
        throughput, "matmul_gflops", lambda dtype, device=None, n=None: {"gflops": speeds[dtype]}
    )
    assert mp.best_precision("cpu") == "no"  # the flags say bf16; the measurement says slower
    assert mp.best_precision("cpu", measure=False) == "bf16"


def test_advise_measures_this_machine_and_decides_from_those_measurements(monkeypatch):
    import course_lib.instruments.throughput as throughput

    real, measured = throughput.matmul_gflops, {}

    def spy(dtype, device=None, n=None, **kwargs):
        result = real(dtype, device, n=n, **kwargs)
        measured[dtype] = (torch.device(device).type, n, result["gflops"])
        return result

    monkeypatch.setattr(throughput, "matmul_gflops", spy)
    advice = mp.advise("cpu")
    assert set(measured) == {torch.float32, torch.bfloat16, torch.float16}  # really measured, all three
    assert {device for device, _, _ in measured.values()} == {"cpu"}
    fp32 = measured[torch.float32][2]
    assert advice.speedups == {
        "fp16": measured[torch.float16][2] / fp32,
        "bf16": measured[torch.bfloat16][2] / fp32,
    }
    # The course's rule, whatever this CPU measured: fp16 never on a CPU, bf16 only at FASTER x fp32.
    bf16_pays = advice.speedups["bf16"] >= mp.FASTER
    assert (advice.fastest, advice.safe_default) == (("bf16", "bf16") if bf16_pays else ("no", "no"))
    assert "fp16" in advice.unusable and advice.device_type == "cpu"
