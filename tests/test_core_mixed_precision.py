"""Behaviours of the precision policy that mutation testing found unguarded (course_lib.mixed_precision).

Sections: the precision names accepted on input; CPU feature detection (fast bf16 / fp16) from the
``/proc/cpuinfo`` of each kind of machine, written to a file and read by the real reader, so no test
depends on this machine's CPU; the warnings of ``check_precision``; the exact verdicts and summary the
lessons print; ``advise_precision``'s thresholds; and which device ``best_precision``, ``measure_matmul``
and ``advise`` measure and judge. GPUs (and Apple's MPS) are faked where a test needs one, since these
tests run on a CPU-only machine, and matmul speeds are faked so that every decision is deterministic.
"""

import sys
import warnings

import pytest
import torch

import course_lib.instruments.throughput as throughput
from course_lib import devices
from course_lib import mixed_precision as mp

# The texts the lessons print and the warnings a learner reads, as they must read.
CPU_FP16 = "CPU では Accelerate と Trainer が FP16 の指定を黙って無視し、FP32 で学習します"
MPS_BF16 = "Apple の GPU の BF16 autocast は新しく対応が不完全なので、コースは FP16 を使います"
PICKED = "コースが選ぶ精度（FP32 の 1.15 倍以上速いもののうち最速、なければ FP32）: "
DEFAULT = "このマシンの既定: "
NOT_USED = "このマシンではトレーニングに使いません"
FP16_TRAP_TAIL = (
    " Accelerator(mixed_precision='fp16') / TrainingArguments(fp16=True) silently train in fp32 on a CPU. "
    "Use precision='bf16' (the CPU's mixed precision) or 'no'."
)
FP16_ON_FAST_FP16_CPU = (
    "fp16 on a CPU is a trap: this CPU has AVX512-FP16, so fp16 matmuls are native here, but" + FP16_TRAP_TAIL
)
FP16_ON_OTHER_CPU = (
    "fp16 on a CPU is a trap: on CPUs without AVX512-FP16 (most) fp16 matmuls run far slower than fp32, and"
    + FP16_TRAP_TAIL
)
BF16_EMULATED = (
    "This CPU has no native bf16 instructions (AVX512-BF16/AMX): bf16 autocast is emulated "
    "and may be slower than fp32. Consider precision='no'."
)
BF16_ON_OLD_GPU = "This GPU has no native bf16 support (needs compute capability 8.0+): use 'fp16'."


def _old_gpu(major: int, minor: int) -> str:
    return f"BF16 には compute capability 8.0 以上の GPU が必要です（この GPU は {major}.{minor}）"


def _cpu_with_flags(monkeypatch, flags: str) -> None:
    """This CPU's feature flags, as ``devices.cpu_flags`` would read them (not this machine's)."""
    monkeypatch.setattr(mp, "cpu_flags", lambda: frozenset(flags.split()))


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two GPUs: cuda:0 (current) and cuda:1, capabilities in the returned dict.

    Faked (torch.cuda.is_available and get_device_capability): these tests run on a CPU-only machine.
    The fake resolves its argument as torch does: None is the current GPU (0), "cuda" too.
    """
    caps = {0: (9, 0), 1: (7, 5)}

    def get_device_capability(device=None):
        if device is None:
            return caps[0]
        if isinstance(device, int):
            return caps[device]
        device = torch.device(device)  # raises for a name that is no device
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return caps[device.index or 0]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    return caps


@pytest.fixture
def caller(monkeypatch):
    """Where check_precision was called from (file, line), read off the call stack as it runs.

    A spy on the ``get_device`` it calls first: the frame above check_precision's is its caller's, so the
    check also holds where check_precision is wrapped (mutmut's trampoline is such a wrapper).
    """
    seen: list[tuple[str, int]] = []
    real = mp.get_device

    def get_device(device=None):
        frame = sys._getframe(2)  # 0: this spy, 1: check_precision, 2: whoever called it
        seen.append((frame.f_code.co_filename, frame.f_lineno))
        return real(device)

    monkeypatch.setattr(mp, "get_device", get_device)
    return seen


@pytest.fixture
def matmuls(monkeypatch):
    """Fake ``matmul_gflops``: records (dtype, device it ran on, n) per call, returns the speeds table."""
    calls: list[tuple] = []
    speeds = {torch.float32: 100.0, torch.float16: 50.0, torch.bfloat16: 300.0}

    def matmul_gflops(dtype=torch.float32, device=None, n=None, **kwargs):
        calls.append((dtype, devices.get_device(device), n))
        return {"n": n or 4096, "seconds": 0.01, "gflops": speeds[dtype]}

    monkeypatch.setattr(throughput, "matmul_gflops", matmul_gflops)
    return calls, speeds


# ----------------------------------------------------------------------------------------------
# Names


@pytest.mark.parametrize("given", ["none", "None", " NONE "])
def test_none_spelled_out_means_fp32(given):
    assert mp.normalize_precision(given) == "no"
    assert mp.autocast_dtype(given) is torch.float32
    assert mp.precision_label(given) == "fp32"


# ----------------------------------------------------------------------------------------------
# CPU feature detection, from each kind of machine's /proc/cpuinfo

CPUINFO = {  # machine: (the line's name, its flags, fast bf16, fast fp16)
    "intel_skylake": (
        "flags",
        "fpu sse sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni",
        False,
        False,
    ),
    "intel_cooper_lake": ("flags", "fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16", True, False),
    "amd_zen4": ("flags", "fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16 avx512vl", True, False),
    "intel_sapphire_rapids": (
        "flags",
        "fpu sse2 avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8",
        True,
        True,
    ),
    # a VM that passes AMX through but hides AVX-512 from the guest
    "vm_amx_without_avx512": ("flags", "fpu sse2 avx2 amx_bf16 amx_fp16 amx_tile amx_int8", True, True),
    "arm_graviton3": (
        "Features",
        "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm",
        True,
        False,
    ),
    # ARM's fp16 arithmetic (asimdhp) is shown by the course, but does not count as fast fp16 matmuls
    "raspberry_pi5": (
        "Features",
        "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid",
        False,
        False,
    ),
}


@pytest.mark.parametrize("machine", sorted(CPUINFO))
def test_fast_bf16_and_fp16_are_detected_from_the_cpu_flags(monkeypatch, tmp_path, machine):
    key, flags, bf16, fp16 = CPUINFO[machine]
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: {machine}\n{key}\t\t: {flags}\n\nprocessor\t: 1\n")
    monkeypatch.setattr(mp, "cpu_flags", lambda: devices.cpu_flags(str(cpuinfo)))
    assert (mp.cpu_has_fast_bf16(), mp.cpu_has_fast_fp16()) == (bf16, fp16)
    # and what the policy makes of them, trusting the flags
    assert mp.best_precision("cpu", measure=False) == ("bf16" if bf16 else "no")


def test_a_cpu_without_cpuinfo_has_neither(monkeypatch, tmp_path):
    """Where /proc/cpuinfo does not exist (macOS, Windows) no flags are read: no fast bf16 or fp16."""
    monkeypatch.setattr(mp, "cpu_flags", lambda: devices.cpu_flags(str(tmp_path / "no-cpuinfo")))
    assert (mp.cpu_has_fast_bf16(), mp.cpu_has_fast_fp16()) == (False, False)


# ----------------------------------------------------------------------------------------------
# check_precision's warnings: what they say, their category, and that they point at the caller


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("avx2 avx512_bf16 avx512_fp16 amx_bf16", FP16_ON_FAST_FP16_CPU),
        ("avx2 avx512_bf16", FP16_ON_OTHER_CPU),
    ],
)
def test_fp16_on_a_cpu_warns_what_the_cpu_can_do_and_points_at_the_caller(
    monkeypatch, caller, flags, expected
):
    _cpu_with_flags(monkeypatch, flags)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mp.check_precision("fp16", "cpu") == "fp16"
    assert [(w.category, str(w.message), (w.filename, w.lineno)) for w in caught] == [
        (mp.PrecisionWarning, expected, caller[0])
    ]


def test_emulated_bf16_on_a_cpu_warns_and_points_at_the_caller(monkeypatch, caller):
    _cpu_with_flags(monkeypatch, "avx2 avx512f")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mp.check_precision("bfloat16", "cpu") == "bf16"
    assert [(w.category, str(w.message), (w.filename, w.lineno)) for w in caught] == [
        (mp.PrecisionWarning, BF16_EMULATED, caller[0])
    ]


def test_bf16_on_an_older_gpu_warns_and_points_at_the_caller(two_gpus, caller):
    two_gpus[1] = (7, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mp.check_precision("bf16", "cuda:1") == "bf16"
    assert [(w.category, str(w.message), (w.filename, w.lineno)) for w in caught] == [
        (mp.PrecisionWarning, BF16_ON_OLD_GPU, caller[0])
    ]


def test_check_precision_judges_the_device_it_is_given(monkeypatch, two_gpus):
    """On a machine with GPUs (cuda:0 at 9.0, cuda:1 at 7.0), each precision is checked against the named device."""
    _cpu_with_flags(monkeypatch, "avx2")
    two_gpus[1] = (7, 0)
    with pytest.warns(mp.PrecisionWarning) as caught:
        mp.check_precision("fp16", "cpu")
    assert [str(w.message) for w in caught] == [FP16_ON_OTHER_CPU]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these warn
        assert mp.check_precision("bf16", "cuda") == "bf16"  # cuda:0 has bf16
        assert mp.check_precision("bf16", "cuda:0") == "bf16"
        assert mp.check_precision("fp16", "cuda:1") == "fp16"  # fp16 is what an older GPU is for
        assert mp.check_precision("no", "cuda:1") == "no"
        assert mp.check_precision("fp16", "cuda:0") == "fp16"


# ----------------------------------------------------------------------------------------------
# The verdicts and the summary the lessons print


def test_summary_of_a_cpu_with_amx_reads_exactly():
    advice = mp.advise_precision("cpu", {"no": 300.0, "fp16": 1400.0, "bf16": 1500.0})
    assert advice.summary() == "\n".join(
        [
            "FP32: 基準",
            f"FP16: FP32 の 4.67 倍（このマシンでは速い）。{NOT_USED}（{CPU_FP16}）",
            "BF16: FP32 の 5.00 倍（このマシンでは速い）",
            PICKED + "BF16",
            DEFAULT + "BF16",
        ]
    )


def test_summary_names_an_unmeasured_unusable_precision_and_why():
    advice = mp.advise_precision("cpu", {"no": 100.0, "bf16": 100.0})
    assert advice.unusable == {"fp16": CPU_FP16}
    assert advice.summary() == "\n".join(
        [
            "FP32: 基準",
            f"FP16: {NOT_USED}（{CPU_FP16}）",
            "BF16: FP32 の 1.00 倍（このマシンでは FP32 とほぼ同じ）",
            PICKED + "FP32",
            DEFAULT + "FP32",
        ]
    )


def test_summary_leaves_out_an_unmeasured_usable_precision():
    advice = mp.advise_precision("cuda", {"no": 100.0, "fp16": 800.0}, (8, 0))
    assert (advice.fastest, advice.safe_default) == ("fp16", "bf16")
    assert advice.summary() == "\n".join(
        ["FP32: 基準", "FP16: FP32 の 8.00 倍（このマシンでは速い）", PICKED + "FP16", DEFAULT + "BF16"]
    )
    assert advice.verdict("bf16") == "BF16: 未計測"


def test_summary_of_an_older_gpu_where_nothing_pays():
    advice = mp.advise_precision("cuda", {"no": 100.0, "fp16": 100.0, "bf16": 200.0}, (7, 5))
    assert advice.unusable == {"bf16": _old_gpu(7, 5)}
    assert advice.summary() == "\n".join(
        [
            "FP32: 基準",
            "FP16: FP32 の 1.00 倍（このマシンでは FP32 とほぼ同じ）",
            f"BF16: FP32 の 2.00 倍（このマシンでは速い）。{NOT_USED}（{_old_gpu(7, 5)}）",
            PICKED + "FP32",
            DEFAULT + "FP16",
        ]
    )


def test_apple_gpus_do_not_train_in_bf16():
    advice = mp.advise_precision("mps", {"no": 3000.0, "fp16": 5000.0, "bf16": 6000.0})
    assert advice.unusable == {"bf16": MPS_BF16}
    assert (advice.fastest, advice.safe_default) == ("fp16", "fp16")
    assert advice.verdict("bf16") == f"BF16: FP32 の 2.00 倍（このマシンでは速い）。{NOT_USED}（{MPS_BF16}）"


def test_verdict_thresholds_are_inclusive():
    """A speed of exactly FASTER x fp32 reads as faster, exactly SLOWER x as slower."""
    advice = mp.PrecisionAdvice("cuda", {"fp16": mp.FASTER, "bf16": mp.SLOWER}, {}, "fp16", "bf16")
    assert advice.verdict("fp32") == "FP32: 基準"
    assert advice.verdict("fp16") == "FP16: FP32 の 1.15 倍（このマシンでは速い）"
    assert advice.verdict("bf16") == "BF16: FP32 の 0.87 倍（このマシンでは遅い）"


# ----------------------------------------------------------------------------------------------
# advise_precision's inputs and thresholds


def test_a_precision_exactly_faster_times_fp32_is_picked():
    advice = mp.advise_precision("cpu", {"no": 100.0, "bf16": 115.0})
    assert advice.speedups["bf16"] == mp.FASTER
    assert (advice.fastest, advice.safe_default) == ("bf16", "bf16")


def test_a_slow_machine_under_one_gflops_is_still_advised():
    advice = mp.advise_precision("cpu", {"no": 0.5, "bf16": 1.0})
    assert advice.speedups == {"bf16": 2.0}
    assert advice.fastest == "bf16"


@pytest.mark.parametrize("fp32", [0.0, -1.0])
def test_advice_refuses_an_fp32_speed_that_is_not_positive(fp32):
    with pytest.raises(ValueError) as excinfo:
        mp.advise_precision("cpu", {"no": fp32, "bf16": 100.0})
    assert str(excinfo.value) == "advise_precision needs the fp32 ('no') GFLOP/s to compare against."


# ----------------------------------------------------------------------------------------------
# Which device is measured and judged: best_precision, measure_matmul, advise, gpu_has_native_bf16


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        ((9, 0), "bf16"),
        ((8, 6), "bf16"),
        ((8, 0), "bf16"),
        ((7, 5), "fp16"),
        ((7, 0), "fp16"),
        ((6, 1), "no"),
    ],
)
def test_best_precision_judges_the_gpu_asked_for_not_the_current_one(two_gpus, capability, expected):
    two_gpus[1] = capability  # cuda:0, the current GPU, stays at 9.0
    assert mp.best_precision("cuda:1") == expected
    assert mp.gpu_has_native_bf16("cuda:1") is (expected == "bf16")


def test_gpu_has_native_bf16_asks_the_current_gpu_by_default(two_gpus):
    two_gpus[0] = (8, 0)
    assert mp.gpu_has_native_bf16() is True
    assert mp.gpu_has_native_bf16("cuda") is True
    two_gpus[0] = (7, 5)
    assert mp.gpu_has_native_bf16() is False


def test_best_precision_on_apple_gpus_is_fp16(monkeypatch):
    """Faked MPS (torch.backends.mps.is_available): this machine has no Apple GPU."""
    _cpu_with_flags(monkeypatch, "avx2")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert mp.best_precision("mps") == "fp16"
    assert mp.best_precision("cpu") == "no"


def test_best_precision_of_a_cpu_next_to_a_gpu_judges_the_cpu(monkeypatch, two_gpus, matmuls):
    _cpu_with_flags(monkeypatch, "avx2")
    assert mp.best_precision("cpu") == "no"  # no bf16 instructions: nothing measured
    assert matmuls[0] == []


def test_best_precision_measures_the_cpu_as_measure_matmul_does(monkeypatch, two_gpus, matmuls):
    """fp32 and bf16 timed on the CPU (not the GPU next to it) at the 512 x 512 that measure_matmul and
    so advise() use on a CPU: best_precision and the lessons' table agree on what they measured."""
    calls, speeds = matmuls
    _cpu_with_flags(monkeypatch, "avx2 avx512_bf16")
    cpu = torch.device("cpu")
    assert mp.best_precision("cpu") == "bf16"  # 300 vs 100 GFLOP/s
    assert calls == [(torch.float32, cpu, 512), (torch.bfloat16, cpu, 512)]
    calls.clear()
    assert mp.measure_matmul("cpu") == {"no": 100.0, "fp16": 50.0, "bf16": 300.0}
    assert calls == [(torch.float32, cpu, 512), (torch.float16, cpu, 512), (torch.bfloat16, cpu, 512)]
    speeds[torch.bfloat16] = 110.0  # under FASTER x fp32
    assert mp.best_precision("cpu") == "no"


def test_measure_matmul_on_a_gpu_lets_matmul_gflops_choose_the_size(two_gpus, matmuls):
    calls, _ = matmuls
    gpu = torch.device("cuda:1")
    assert mp.measure_matmul("cuda:1") == {"no": 100.0, "fp16": 50.0, "bf16": 300.0}
    assert calls == [(torch.float32, gpu, None), (torch.float16, gpu, None), (torch.bfloat16, gpu, None)]


def test_advise_measures_and_judges_the_gpu_it_is_given(two_gpus, matmuls):
    calls, speeds = matmuls
    speeds[torch.float16] = 800.0
    advice = mp.advise("cuda:1")  # 7.5: no native bf16, although cuda:0 has it
    assert {device for _, device, _ in calls} == {torch.device("cuda:1")}
    assert advice.device_type == "cuda"
    assert advice.unusable == {"bf16": _old_gpu(7, 5)}
    assert (advice.fastest, advice.safe_default) == ("fp16", "fp16")


def test_advise_of_a_cpu_next_to_a_gpu_judges_the_cpu(two_gpus, matmuls):
    calls, _ = matmuls
    advice = mp.advise("cpu")
    assert {(device, n) for _, device, n in calls} == {(torch.device("cpu"), 512)}
    assert advice.device_type == "cpu"
    assert advice.unusable == {"fp16": CPU_FP16}
    assert (advice.fastest, advice.safe_default) == ("bf16", "bf16")
