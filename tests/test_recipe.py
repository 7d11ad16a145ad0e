"""The recipe ladder (``python -m course_lib.cli.recipe``) and the data code it adds.

No timing assertions: times are only checked for bookkeeping (positive, increasing within a run).
The data tests are fast; ``test_quick_ladder_*`` share one ``--quick`` run (about a minute on 2 cores).
"""

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from course_lib import data
from course_lib.benchmark import recipe, rungs
from course_lib.cli import recipe as recipe_cli
from course_lib.models import load_tokenizer
from course_lib.tooling import sections

# ---------------------------------------------------------------------------------------------
# Length grouping and padding (fast)


def _epoch(sampler: data.LengthGroupedBatchSampler) -> list[list[int]]:
    return [list(b) for b in sampler]


@pytest.mark.parametrize(
    "rows, batch, drop_last", [(103, 8, False), (103, 8, True), (64, 16, False), (5, 8, False)]
)
def test_length_grouping_yields_every_row_once_per_epoch(rows, batch, drop_last):
    lengths = [(7 * i) % 50 + 3 for i in range(rows)]
    sampler = data.LengthGroupedBatchSampler(lengths, batch, seed=1, mega_batches=2, drop_last=drop_last)
    for _ in range(3):  # three epochs in a row
        batches = _epoch(sampler)
        assert len(batches) == len(sampler)
        seen = Counter(i for b in batches for i in b)
        assert max(seen.values()) == 1
        if drop_last:
            assert all(len(b) == batch for b in batches) and len(seen) == rows - rows % batch
        else:
            assert set(seen) == set(range(rows))
            assert all(len(b) == batch for b in batches[:-1])


def test_length_grouping_shuffles_between_epochs_and_seeds_and_is_reproducible():
    lengths = [(13 * i) % 40 + 5 for i in range(200)]
    a = data.LengthGroupedBatchSampler(lengths, 10, seed=0)
    first, second = _epoch(a), _epoch(a)
    assert first != second  # a new order every epoch
    assert _epoch(data.LengthGroupedBatchSampler(lengths, 10, seed=0)) == first  # same seed, same epoch 0
    assert _epoch(data.LengthGroupedBatchSampler(lengths, 10, seed=1)) != first
    a.set_epoch(0)
    assert _epoch(a) == first  # set_epoch picks the epoch, as a DistributedSampler's does
    assert a.batches(1) == second and a.batches(1) == a.batches(1)


def test_length_grouping_puts_similar_lengths_together():
    lengths = [(37 * i) % 90 + 10 for i in range(400)]
    grouped = data.LengthGroupedBatchSampler(lengths, 16, seed=0)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(400, generator=generator).tolist()
    random_batches = [order[i : i + 16] for i in range(0, 400, 16)]

    def spread(batches):
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)

    assert spread(_epoch(grouped)) < spread(random_batches) / 3
    # The batch order is shuffled: consecutive batches do not simply run from long to short.
    maxima = [max(lengths[i] for i in b) for b in _epoch(grouped)]
    assert maxima != sorted(maxima, reverse=True) and maxima != sorted(maxima)


def test_length_grouping_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        data.LengthGroupedBatchSampler([3, 4], 0)
    with pytest.raises(ValueError, match="No lengths"):
        data.LengthGroupedBatchSampler([], 4)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def rows(tokenizer):
    return data.tokenize_dataset(data.load_mrpc("embedded")["train"].select(range(400)), tokenizer)


def test_padded_token_counts_of_the_three_schemes(rows, tokenizer):
    lengths = data.split_lengths(rows)
    fixed = data.padding_counts(data.make_dataloader(rows, tokenizer, 16, pad_to=128))
    dynamic = data.padding_counts(data.make_dataloader(rows, tokenizer, 16))
    grouped = data.padding_counts(data.make_dataloader(rows, tokenizer, 16, group_by_length=True))
    assert fixed == {"real": sum(lengths), "padded": 400 * 128}
    expected = sum(len(c) * max(c) for c in (lengths[i : i + 16] for i in range(0, 400, 16)))
    assert dynamic == {"real": sum(lengths), "padded": expected}
    assert grouped["real"] == sum(lengths) and sum(lengths) <= grouped["padded"] < dynamic["padded"]
    bf16 = data.make_dataloader(rows, tokenizer, 16, precision="bf16", group_by_length=True)
    assert all(b["input_ids"].shape[1] % 8 == 0 for b in bf16)


def test_grouped_loader_changes_order_each_epoch_and_keeps_every_row(rows, tokenizer):
    loader = data.make_dataloader(rows, tokenizer, 16, group_by_length=True, seed=3, drop_last=True)
    assert len(loader) == 400 // 16
    epochs = [[tuple(b["labels"].tolist()) for b in loader] for _ in range(2)]
    assert epochs[0] != epochs[1]
    assert all(len(e) == 25 and all(len(b) == 16 for b in e) for e in epochs)
    fixed = next(iter(data.make_dataloader(rows, tokenizer, 4, pad_to=128)))
    assert fixed["input_ids"].shape == (4, 128) and fixed["attention_mask"].shape == (4, 128)


# ---------------------------------------------------------------------------------------------
# Settings, verdict and report from made-up records (fast)


def test_config_rejects_what_would_break_the_comparison():
    with pytest.raises(ValueError, match="Unknown rung"):
        recipe.RecipeConfig(rungs=("slides", "quantum"))
    with pytest.raises(ValueError, match="needs rung 'slides'"):
        recipe.RecipeConfig(rungs=("dynamic_padding",))
    with pytest.raises(ValueError, match="multiple of large_batch"):
        recipe.RecipeConfig(eval_every=5, large_batch=2)
    assert recipe.quick_config(epochs=2).epochs == 2


def _row(number, name, status, seconds=None, reason="why", final=0.8):
    row = {"rung": number, "name": name, "label": name.replace("_", " "), "status": status, "reason": reason}
    if seconds is not None or status in ("reference", "kept", "dropped"):
        evals = [{"step": 4, "examples": 64, "seconds": (seconds or 9.0) / 2, "accuracy": 0.6}]
        evals.append({"step": 8, "examples": 128, "seconds": seconds or 9.0, "accuracy": final})
        row.update(
            evals=evals,
            time_to_target_s=seconds,
            steps_to_target=8 if seconds else None,
            tokens_per_s=1000.0,
            real_tokens_per_s=400.0,
            real_tokens=400,
            padded_tokens=1000,
            final_accuracy=final,
            peak_mem_mb=12.5,
            train_seconds=seconds or 9.0,
        )
    return row


def _record(rows, target=0.79):
    cfg = recipe.quick_config()
    return {
        "about": recipe.RECIPE_ABOUT,
        "date": "2026-12-01",
        "seconds": 95.0,
        "cores": 2,
        "machine": "cpu: test CPU, 2 threads; torch x",
        "load_average": [0.5, 0.7],
        "config": json.loads(json.dumps(cfg.__dict__)),
        "train_rows": 256,
        "eval_rows": 128,
        "target": target,
        "recipe": "dynamic padding, fp32",
        "rows": rows,
    }


def test_verdict_names_what_paid_what_was_dropped_and_the_ratio():
    record = _record(
        [
            _row(1, "slides", "reference", 10.0),
            _row(2, "dynamic_padding", "kept", 4.0),
            _row(3, "length_grouping", "dropped", None, reason="did not reach the target within the budget"),
            _row(6, "mixed_precision", "skipped", reason="bf16 matmuls measured 0.50x fp32 here"),
        ]
    )
    lines = recipe.verdict(record)
    assert "2 dynamic_padding" in lines[0] and "3 length_grouping" in lines[1]
    assert "0.50x fp32" in lines[2]
    assert "2.50x sooner" in lines[3] and "met" in lines[3]
    report = recipe.markdown_report(record)
    assert "| 1 | slides | reference | 10.0 | 1.00x |" in report
    assert "dropped: did not reach the target" in report and "| 40% |" in report
    assert "evaluation is not counted" in report


def test_a_missed_target_says_which_rung_fell_short():
    record = _record(
        [_row(1, "slides", "reference", 10.0), _row(2, "dynamic_padding", "dropped", 11.0, reason="0.91x")]
    )
    assert (
        "MISSED" in recipe.verdict(record)[-1] and "dynamic_padding did not pay" in recipe.verdict(record)[-1]
    )
    record = _record([_row(1, "slides", "reference", 10.0), _row(2, "dynamic_padding", "kept", 8.0)])
    assert "1.25x" in recipe.verdict(record)[-1] and "gave too little" in recipe.verdict(record)[-1]


def test_time_to_target_is_the_first_evaluation_on_target():
    evals = [{"accuracy": a, "seconds": s} for a, s in ((0.5, 1.0), (0.81, 2.0), (0.79, 3.0), (0.9, 4.0))]
    assert recipe.time_to(evals, 0.8)["seconds"] == 2.0
    assert recipe.time_to(evals, 0.95) is None


def test_apply_changes_one_field_and_mixed_precision_takes_the_measured_choice():
    ladder = {r.name: r for r in rungs.ladder(large_batch=4)}
    base = rungs.Stack()
    assert rungs.apply(ladder["dynamic_padding"], base) == rungs.Stack(dynamic_padding=True)
    assert rungs.apply(ladder["mixed_precision"], base, "bf16").precision == "bf16"
    assert rungs.apply(ladder["large_batch"], base).batch_mult == 4
    assert [r.name for r in rungs.ladder()] == list(rungs.RUNG_NAMES)


@pytest.mark.parametrize(
    ("bf16_gflops", "native", "expected", "says"),
    [
        (240.0, True, "bf16", "2.40x fp32"),  # AMX / Zen 4
        (110.0, True, "no", "1.10x fp32 here (not >= 1.15x)"),  # instructions, no gain
        (25.0, False, "no", "0.25x fp32 here (not >= 1.15x; this CPU has no AVX512-BF16/AMX"),
    ],
)
def test_rung_6_decides_from_the_measured_matmul_ratio(monkeypatch, bf16_gflops, native, expected, says):
    from course_lib.instruments import throughput

    measured = {torch.float32: 100.0, torch.bfloat16: bf16_gflops}
    monkeypatch.setattr(throughput, "matmul_gflops", lambda dtype, *a, **k: {"gflops": measured[dtype]})
    monkeypatch.setattr(rungs, "cpu_has_fast_bf16", lambda: native)
    precision, why = rungs.mixed_precision_choice(torch.device("cpu"))
    assert precision == expected and says in why, (precision, why)


def test_cli_refuses_check_without_a_record_and_a_missing_record(tmp_path, capsys):
    assert recipe_cli.main(["--check"]) == 2
    assert "--from-json" in capsys.readouterr().err
    readme = tmp_path / "README.md"
    readme.write_text("# R\n\n<!-- recipe:start -->\n<!-- recipe:end -->\n", encoding="utf-8")
    assert recipe_cli.main(["--from-json", str(tmp_path / "none.json"), "--readme", str(readme)]) == 2
    assert recipe.MEASURE_COMMAND in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# One --quick run through the command (slow tier)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``--quick --json --markdown --plot --readme`` once; the files it wrote."""
    out = tmp_path_factory.mktemp("recipe")
    readme = out / "README.md"
    readme.write_text(
        "# Course\n\n<!-- recipe:start -->\nold\n<!-- recipe:end -->\n\nafter\n", encoding="utf-8"
    )
    argv = ["--quick", "--json", str(out / "recipe.json"), "--markdown", str(out / "recipe.md")]
    argv += ["--plot", str(out / "recipe.png"), "--readme", str(readme), "--memory"]
    assert recipe_cli.main(argv) == 0
    record = json.loads((out / "recipe.json").read_text(encoding="utf-8"))
    return {"dir": out, "readme": readme, "record": record}


def test_quick_ladder_record_has_a_row_per_rung_with_its_schema(quick):
    record = quick["record"]
    assert record["about"] and record["target"] is not None and record["machine"]
    assert [r["name"] for r in record["rows"]] == list(rungs.RUNG_NAMES)
    for row in record["rows"]:
        assert row["status"] in ("reference", "kept", "dropped", "skipped", "not run", "failed")
        assert row["reason"], row  # every row says why it has its status
        if row["status"] in ("reference", "kept", "dropped"):
            for key in ("train_seconds", "tokens_per_s", "real_tokens_per_s", "final_accuracy", "evals"):
                assert row[key] is not None, (row["name"], key)
            assert row["real_tokens"] <= row["padded_tokens"]
            assert row["peak_mem_mb"] is None or row["peak_mem_mb"] > 0
    statuses = {r["name"]: r["status"] for r in record["rows"]}
    assert statuses["slides"] == "reference" and statuses["compile"] == "not run"
    assert (quick["dir"] / "recipe.png").stat().st_size > 0


def test_quick_ladder_bookkeeping_is_monotone_and_evaluations_line_up(quick):
    ran = [r for r in quick["record"]["rows"] if "evals" in r]
    assert len(ran) >= 4
    points = [[e["examples"] for e in r["evals"]] for r in ran]
    assert all(p == points[0] for p in points), "every rung evaluates after the same training examples"
    same_batch = [[e["step"] for e in r["evals"]] for r in ran if r["batch_size"] == ran[0]["batch_size"]]
    assert all(s == same_batch[0] for s in same_batch)
    for r in ran:
        seconds = [e["seconds"] for e in r["evals"]]
        assert all(b > a for a, b in zip(seconds, seconds[1:])) and seconds[0] > 0
        assert math.isclose(seconds[-1], r["train_seconds"])
        assert r["steps"] * r["batch_size"] == r["evals"][-1]["examples"]
    # Rung 1 pads to max_length: every position it computed on is a multiple of the batch x 128.
    slides = ran[0]
    assert slides["padded_tokens"] == slides["steps"] * slides["batch_size"] * 128
    assert (
        ran[1]["padded_tokens"] < slides["padded_tokens"] and ran[1]["real_tokens"] == slides["real_tokens"]
    )


def test_quick_ladder_reference_reaches_its_target_and_decisions_follow_the_times(quick):
    record = quick["record"]
    ref = record["rows"][0]
    assert ref["time_to_target_s"] is not None and ref["final_accuracy"] >= record["target"]
    kept_time = ref["time_to_target_s"]
    for row in record["rows"][1:]:
        if row["status"] == "kept":
            assert row["time_to_target_s"] < kept_time
            kept_time = row["time_to_target_s"]
        elif row["status"] == "dropped":
            assert row["time_to_target_s"] is None or row["time_to_target_s"] >= kept_time
    assert "x sooner" in recipe.verdict(record)[-1]


def test_quick_ladder_renders_from_json_to_the_written_section(quick, capsys):
    record, readme = quick["record"], quick["readme"]
    body = sections.read_block(readme, recipe.RECIPE)
    assert body == recipe.markdown_report(record)
    assert (quick["dir"] / "recipe.md").read_text(encoding="utf-8") == body
    assert readme.read_text(encoding="utf-8").endswith("<!-- recipe:end -->\n\nafter\n")
    path = str(quick["dir"] / "recipe.json")
    assert recipe_cli.main(["--from-json", path, "--readme", str(readme), "--check"]) == 0
    before = readme.read_bytes()
    assert recipe_cli.main(["--from-json", path, "--readme", str(readme)]) == 0
    assert readme.read_bytes() == before
    Path(readme).write_text(
        readme.read_text(encoding="utf-8").replace("| 1 |", "| one |", 1), encoding="utf-8"
    )
    assert recipe_cli.main(["--from-json", path, "--readme", str(readme), "--check"]) == 1
    assert "--from-json" in capsys.readouterr().err
