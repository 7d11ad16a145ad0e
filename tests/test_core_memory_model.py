"""The memory model's arithmetic, exact, on architectures small enough to count by hand (docs/mutation.md).

``tests/test_memory_model.py`` checks the model against measurements on the tiny DistilBERT, within the
tolerance a measured peak needs; here every figure is derived by hand from the documented formulas (the
docstrings of ``course_lib.memory_model``), on a two-block DistilBERT of width 3, FFN width 5, 2 heads,
7 tokens and 11 positions (``TINY``), for each precision, attention kernel, checkpointing choice, optimizer
and ZeRO stage. ``t`` is batch x seq_len, ``s`` batch x heads x seq_len^2.
"""

from types import SimpleNamespace

import pytest
from transformers import DistilBertConfig

from course_lib import memory_model as mm

# d = 3, f = 5, heads = 2, L = 2 blocks, vocabulary 7, 11 positions, 2 labels
TINY = mm.Arch(vocab_size=7, dim=3, hidden_dim=5, n_layers=2, n_heads=2, max_position_embeddings=11)
KEYS = ("where", "tensor", "numel", "bytes/elem", "count", "alias", "bytes")


def _rows(*rows: tuple) -> list[dict]:
    return [dict(zip(KEYS, row, strict=True)) for row in rows]


# ----------------------------------------------------------------------------------------------
# Arch: the parameters


def test_the_parameter_shapes_follow_distilberts_layout():
    block = [(3, 3), (3,)] * 4 + [(3,), (3,), (5, 3), (5,), (3, 5), (3,), (3,), (3,)]
    embeddings = [(7, 3), (11, 3), (3,), (3,)]  # word, position, LayerNorm
    head = [(3, 3), (3,), (2, 3), (2,)]  # pre_classifier, classifier
    assert TINY.param_shapes() == embeddings + block + block + head


def test_the_parameter_counts_of_the_model_a_block_and_the_matmul_weights():
    # embeddings 21 + 33 + 6 = 60; a block 4 x 12 + 6 + 20 + 18 + 6 = 98; head 9 + 3 + 6 + 2 = 20
    assert TINY.num_params() == 60 + 2 * 98 + 20 == 276
    assert TINY.block_numel() == 98
    # per block 4 x 3 x 3 + 2 x 3 x 5 = 66, twice, + pre_classifier 9 + classifier 6
    assert TINY.matmul_weight_numel() == 147


def test_an_arch_by_hand_takes_distilberts_defaults():
    arch = mm.Arch(vocab_size=7, dim=3, hidden_dim=5, n_layers=1, n_heads=1)
    assert arch.param_shapes()[1] == (512, 3) and arch.param_shapes()[-2:] == [(2, 3), (2,)]
    assert arch.num_params() == 21 + 512 * 3 + 6 + 98 + 20
    config = DistilBertConfig(vocab_size=7, dim=3, hidden_dim=5, n_layers=1, n_heads=1)
    assert mm.Arch.from_config(config) == arch  # sdpa, dropout 0.1, 512 positions, 2 labels


def _config(**changes) -> SimpleNamespace:
    sizes = dict(vocab_size=7, dim=3, hidden_dim=5, n_layers=2, n_heads=2)
    return SimpleNamespace(**sizes, max_position_embeddings=11, attention_dropout=0.25, **changes)


def test_from_config_reads_every_size_and_the_attention_kernel():
    arch = mm.Arch.from_config(_config(num_labels=4, _attn_implementation="eager"))
    assert arch == mm.Arch(7, 3, 5, 2, 2, 11, num_labels=4, attention="eager", attention_dropout=0.25)


def test_from_config_without_labels_or_kernel_takes_two_labels_and_sdpa():
    assert mm.Arch.from_config(_config()) == mm.Arch(7, 3, 5, 2, 2, 11, 2, "sdpa", 0.25)
    assert mm.Arch.from_config(_config(_attn_implementation=None)).attention == "sdpa"


def test_from_config_of_another_model_names_what_it_lacks():
    config = SimpleNamespace(vocab_size=7, hidden_dim=5, n_layers=2, max_position_embeddings=11)
    with pytest.raises(ValueError, match=r"lacks dim, n_heads: .*build an Arch"):
        mm.Arch.from_config(config)


# ----------------------------------------------------------------------------------------------
# Setup


def test_a_setup_defaults_to_fp32_adamw_without_checkpointing():
    setup = mm.Setup(2, 3)
    assert (setup.precision, setup.gradient_checkpointing, setup.optimizer) == ("no", False, "adamw")


def test_a_setup_reads_a_train_config():
    config = SimpleNamespace(precision="bf16", gradient_checkpointing=True, optimizer="adafactor")
    assert mm.Setup.from_train_config(config, 4, 8) == mm.Setup(4, 8, "bf16", True, "adafactor")


def test_a_setup_takes_one_token_and_refuses_none():
    assert mm.Setup(1, 1).batch == 1
    for batch, seq_len in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match=rf"must be >= 1, got {batch} and {seq_len}"):
            mm.Setup(batch, seq_len)


def test_a_setup_names_the_precisions_and_optimizers_it_knows():
    with pytest.raises(ValueError, match=r"precision must be one of no, fp16, bf16, got 'fp8'"):
        mm.Setup(2, 3, precision="fp8")
    with pytest.raises(ValueError, match=r"optimizer must be one of adamw, adafactor, adamw8bit, got 'sgd'"):
        mm.Setup(2, 3, optimizer="sgd")


# ----------------------------------------------------------------------------------------------
# The optimizer's state and its step's temporary


def test_adamw_keeps_two_fp32_moments_per_element_of_any_size():
    assert mm.param_state((5, 3), "adamw") == 2 * 4 * 15
    assert mm.param_state((5,), "adamw") == 40
    assert mm.param_state((64, 64), "adamw") == 8 * 4096  # not quantised, unlike adamw8bit's


def test_adafactor_keeps_a_vector_per_element_and_a_matrix_by_rows_and_columns():
    assert mm.param_state((5,), "adafactor") == 4 * 5
    assert mm.param_state((5, 3), "adafactor") == 4 * (5 + 3)
    # a stack of 2 matrices 3 x 4: row variances 2 x 3, column variances 2 x 4
    assert mm.param_state((2, 3, 4), "adafactor") == 4 * (6 + 8)


def test_adamw8bit_quantises_tensors_from_4096_elements_with_an_absmax_per_256():
    assert mm.param_state((4095,), "adamw8bit") == 8 * 4095  # under min_8bit_size: 32-bit moments
    assert mm.param_state((64, 64), "adamw8bit") == 2 * 4096 + 2 * 4 * 16
    assert mm.param_state((4097,), "adamw8bit") == 2 * 4097 + 2 * 4 * 17  # a partial block has its absmax


def test_optimizer_state_of_the_whole_model_per_optimizer():
    assert mm.optimizer_state(TINY, "adamw") == 8 * 276
    # matrices: 4 x (7+3 + 11+3 + 2 x (4 x 6 + 8 + 8) + 6 + 5) = 460; vectors: 4 x 75 = 300
    assert mm.optimizer_state(TINY, "adafactor") == 460 + 300
    # every tensor under 4096 elements stays 32-bit, plus the two shared 256-value fp32 qmaps
    assert mm.optimizer_state(TINY, "adamw8bit") == 8 * 276 + 2 * 256 * 4


def test_optimizer_state_quantises_the_large_tensors_of_a_model():
    arch = mm.Arch(vocab_size=4096, dim=1, hidden_dim=1, n_layers=1, n_heads=1, max_position_embeddings=4)
    # the word embeddings (4096 x 1) in 8 bits, the other 4 + 2 + 16 + 6 elements in 32 bits
    small = arch.num_params() - 4096
    assert small == 28
    assert mm.optimizer_state(arch, "adamw8bit") == 2 * 4096 + 8 * 16 + 8 * small + 2048


def test_optimizer_state_names_the_optimizers_it_knows():
    with pytest.raises(ValueError, match=r"optimizer must be one of adamw, adafactor, adamw8bit, got 'sgd'"):
        mm.optimizer_state(TINY, "sgd")


def test_each_part_s_formula_refuses_an_optimizer_it_does_not_know_rather_than_count_it_as_another():
    # param_state and step_temporary are the per-tensor and per-step parts the lesson calls on their own
    for part in (lambda: mm.param_state((4, 3), "sgd"), lambda: mm.step_temporary(TINY, "sgd")):
        with pytest.raises(
            ValueError, match=r"optimizer must be one of adamw, adafactor, adamw8bit, got 'sgd'"
        ):
            part()


def test_the_optimizer_steps_temporary():
    assert mm.step_temporary(TINY, "adamw") == 0  # fused, in place
    assert mm.step_temporary(TINY, "adafactor") == 4 * 11 * 3  # the largest matrix: the positions
    assert mm.step_temporary(TINY, "adamw8bit") == 20 * 33


# ----------------------------------------------------------------------------------------------
# What one block saves for backward: batch 2 x 3 tokens (t = 6), s = 2 x 2 x 9 = 36


def test_one_fp32_block_saves_with_the_cpu_math_attention():
    assert mm.block_saved_rows(TINY, mm.Setup(2, 3)) == [
        ("layers", "q/k/v projection input", 18, 4, 1, False),
        ("attention", "q, k (scaled), v (fp32)", 54, 4, 1, False),
        ("attention", "probs, dropout mask, dropped probs", 108, 4, 1, False),
        ("layers", "out_lin input", 18, 4, 1, False),
        ("layers", "2 LayerNorm inputs (residual sums, fp32)", 36, 4, 1, False),
        ("layers", "2 LayerNorm mean + rstd", 24, 4, 1, False),
        ("layers", "2 LayerNorm weight + bias", 12, 4, 1, True),
        ("FFN", "lin1 input", 18, 4, 1, False),
        ("FFN", "GELU input, lin2 input", 60, 4, 1, False),
        ("FFN", "dropout mask", 18, 4, 1, False),
        ("layers", "matmul weights", 66, 4, 1, True),  # the parameters themselves
    ]


BF16_BLOCK_TAIL = [
    ("layers", "out_lin input", 18, 2, 1, False),
    ("layers", "2 LayerNorm inputs (residual sums, fp32)", 36, 4, 1, False),
    ("layers", "2 LayerNorm mean + rstd", 24, 4, 1, False),
    ("layers", "2 LayerNorm weight + bias", 12, 4, 1, True),
    ("FFN", "lin1 input", 18, 2, 1, False),
    ("FFN", "GELU input, lin2 input", 60, 2, 1, False),
    ("FFN", "dropout mask", 18, 2, 1, False),
    ("layers", "matmul weights", 66, 2, 1, False),  # autocast's 16-bit copies: new memory
]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_block_saves_a_copy_per_projection_and_fp32_math_attention(precision):
    assert mm.block_saved_rows(TINY, mm.Setup(2, 3, precision)) == [
        ("layers", "q/k/v projection input", 18, 2, 3, False),
        ("attention", "q, k (scaled), v (fp32)", 54, 4, 1, False),
        ("attention", "probs, dropout mask, dropped probs", 108, 4, 1, False),
        *BF16_BLOCK_TAIL,
    ]


def test_a_16_bit_block_with_eager_attention_saves_its_scores_in_16_bits():
    arch = mm.Arch(7, 3, 5, 2, 2, 11, attention="eager")
    assert mm.block_saved_rows(arch, mm.Setup(2, 3, "bf16")) == [
        ("layers", "q/k/v projection input", 18, 2, 3, False),
        ("attention", "q, k^T, v", 54, 2, 1, False),
        ("attention", "probs, dropout mask, dropped probs", 108, 2, 1, False),
        *BF16_BLOCK_TAIL,
    ]


def test_a_16_bit_block_with_flash_attention_saves_no_scores_but_a_log_sum_exp_per_row():
    arch = mm.Arch(7, 3, 5, 2, 2, 11, attention="flash")
    assert mm.block_saved_rows(arch, mm.Setup(2, 3, "bf16")) == [
        ("layers", "q/k/v projection input", 18, 2, 3, False),
        ("attention", "q, k, v, output", 72, 2, 1, False),
        ("attention", "log-sum-exp per row", 12, 4, 1, False),  # 2 sequences x 2 heads x 3 rows
        *BF16_BLOCK_TAIL,
    ]


# ----------------------------------------------------------------------------------------------
# What the whole forward saves: the embeddings, L blocks (or their inputs) and the head

EMBEDDINGS = [
    ("embeddings", "input_ids + position_ids (int64)", 9, 8, 1, False, 72),  # 2 x 3 ids + 3 positions
    ("embeddings", "LayerNorm input, mean, rstd", 30, 4, 1, False, 120),  # t x d + 2 t
    ("embeddings", "LayerNorm weight + bias", 6, 4, 1, True, 24),
    ("embeddings", "dropout mask", 18, 4, 1, False, 72),
]
HEAD_FP32 = [
    ("head", "[CLS] rows, ReLU out, dropout mask, classifier input", 24, 4, 1, False, 96),
    ("head", "pre_classifier + classifier weights", 15, 4, 1, True, 60),
    ("head", "log-softmax, labels (int64: 2 x 4 B), loss", 9, 4, 1, False, 36),  # 2 x 2 + 2 x 2 + 1
]
HEAD_BF16 = [
    ("head", "[CLS] rows, ReLU out, dropout mask, classifier input", 24, 2, 1, False, 48),
    ("head", "pre_classifier + classifier weights", 15, 2, 1, False, 30),
    ("head", "log-softmax, labels (int64: 2 x 4 B), loss", 9, 4, 1, False, 36),
]


def test_an_fp32_forward_saves_every_blocks_tensors_once_per_block():
    rows = mm.saved_tensors(TINY, mm.Setup(2, 3))
    assert rows == _rows(
        *EMBEDDINGS,
        ("layers", "q/k/v projection input", 18, 4, 2, False, 144),
        ("attention", "q, k (scaled), v (fp32)", 54, 4, 2, False, 432),
        ("attention", "probs, dropout mask, dropped probs", 108, 4, 2, False, 864),
        ("layers", "out_lin input", 18, 4, 2, False, 144),
        ("layers", "2 LayerNorm inputs (residual sums, fp32)", 36, 4, 2, False, 288),
        ("layers", "2 LayerNorm mean + rstd", 24, 4, 2, False, 192),
        ("layers", "2 LayerNorm weight + bias", 12, 4, 2, True, 96),
        ("FFN", "lin1 input", 18, 4, 2, False, 144),
        ("FFN", "GELU input, lin2 input", 60, 4, 2, False, 480),
        ("FFN", "dropout mask", 18, 4, 2, False, 144),
        ("layers", "matmul weights", 66, 4, 2, True, 528),
        *HEAD_FP32,
    )
    assert all(type(r["numel"]) is int and type(r["bytes"]) is int for r in rows)  # element counts


def test_a_bf16_forward_saves_three_projection_copies_per_block():
    rows = mm.saved_tensors(TINY, mm.Setup(2, 3, "bf16"))
    assert rows[4] == dict(zip(KEYS, ("layers", "q/k/v projection input", 18, 2, 6, False, 216), strict=True))
    assert rows[:4] == _rows(*EMBEDDINGS) and rows[-3:] == _rows(*HEAD_BF16)
    assert rows[14] == _rows(("layers", "matmul weights", 66, 2, 2, False, 264))[0]
    assert sum(r["bytes"] for r in rows) == 3210


def test_a_flash_forward_saves_a_log_sum_exp_per_row_per_block():
    rows = mm.saved_tensors(mm.Arch(7, 3, 5, 2, 2, 11, attention="flash"), mm.Setup(2, 3, "bf16"))
    assert rows[6] == _rows(("attention", "log-sum-exp per row", 12, 4, 2, False, 96))[0]
    assert all(type(r["numel"]) is int and type(r["bytes"]) is int for r in rows)


@pytest.mark.parametrize(("precision", "head"), [("no", HEAD_FP32), ("bf16", HEAD_BF16)])
def test_a_checkpointed_forward_saves_only_each_blocks_fp32_input(precision, head):
    rows = mm.saved_tensors(TINY, mm.Setup(2, 3, precision, True))
    assert rows == _rows(*EMBEDDINGS, ("layers", "block input (checkpoint)", 18, 4, 2, False, 144), *head)


def test_saved_tensors_names_the_attention_kernels_it_models():
    xformers = mm.Arch(7, 3, 5, 2, 2, attention="xformers")
    for rows in (mm.saved_tensors, mm.block_saved_rows):  # a block's rows too: not the eager formulas
        with pytest.raises(ValueError, match=r"attention must be one of sdpa, eager, flash, got 'xformers'"):
            rows(xformers, mm.Setup(2, 3))


def test_sdpa_without_dropout_is_not_modelled_but_eager_without_dropout_is():
    with pytest.raises(ValueError, match="SDPA without dropout .* not modelled"):
        mm.saved_tensors(mm.Arch(7, 3, 5, 2, 2, attention_dropout=0.0), mm.Setup(2, 3))
    eager = mm.Arch(7, 3, 5, 2, 2, attention="eager", attention_dropout=0.0)
    assert len(mm.saved_tensors(eager, mm.Setup(2, 3))) == 18


# ----------------------------------------------------------------------------------------------
# autocast's weight cache


def test_autocast_caches_16_bit_copies_of_each_blocks_and_the_heads_matmul_parameters():
    # a block: q, k, v, out 4 x (9 + 3), lin1 15 + 5, lin2 15 + 3 = 86; the head: 9 + 3 + 2 x 4 = 20
    assert mm.autocast_cache(TINY, 2) == 2 * (2 * 86 + 20)
    assert mm.autocast_cache(TINY, 2, head=False) == 2 * 2 * 86
    assert mm.autocast_cache(TINY, 0) == 2 * 20
    assert mm.autocast_cache(TINY, 0, head=False) == 0


# ----------------------------------------------------------------------------------------------
# The forward's peak: above the weights and the optimizer state
# saved without aliases (batch 2 x 3): fp32 3228, bf16 3090; checkpointed: fp32 540, bf16 522


def test_the_fp32_forward_peaks_at_the_last_layernorms_output():
    assert mm.forward_peak(TINY, mm.Setup(2, 3)) == 3228 + 4 * 18


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_16_bit_forward_adds_the_bias_copies_and_the_residuals_two_copies(precision):
    # biases: 2 bytes x (2 x (4 x 3 + 5 + 3) + 3 + 2); the LayerNorm output 4 x 18, dropout 2 x 18, fp32 4 x 18
    assert mm.forward_peak(TINY, mm.Setup(2, 3, precision)) == 3090 + 90 + 72 + 36 + 72


def test_the_checkpointed_fp32_forward_peaks_in_the_math_attention():
    # probs, mask, dropped: 3 x 36 x 4; q, k, v and their fp32 copies: 4 x 18 x 4
    assert mm.forward_peak(TINY, mm.Setup(2, 3, "no", True)) == 540 + 432 + 288


def test_the_checkpointed_bf16_forward_peaks_in_the_last_blocks_attention_beside_earlier_copies():
    # 522 saved + block 0's copies 2 x 86 + attention 432 + 6 x 18 x 4 + q/k/v copies 2 x 3 x 12
    assert mm.forward_peak(TINY, mm.Setup(2, 3, "bf16", True)) == 522 + 172 + 432 + 432 + 72


def test_the_checkpointed_forward_with_eager_attention_holds_its_scores_in_the_activations_precision():
    eager = mm.Arch(7, 3, 5, 2, 2, 11, attention="eager")
    assert mm.forward_peak(eager, mm.Setup(2, 3, "no", True)) == 540 + 3 * 36 * 4 + 3 * 18 * 4
    assert mm.forward_peak(eager, mm.Setup(2, 3, "bf16", True)) == 522 + 172 + 3 * 36 * 2 + 3 * 18 * 2 + 72


def test_the_checkpointed_forward_with_flash_attention_peaks_in_the_ffn():
    flash = mm.Arch(7, 3, 5, 2, 2, 11, attention="flash")
    # the FFN's input 18 x 4 beside lin1's and GELU's outputs 2 x 30 x e
    assert mm.forward_peak(flash, mm.Setup(2, 3, "no", True)) == 540 + 72 + 240
    # ... and under bf16 the 16-bit copies of q, k, v, out (4 x 12), lin1 (15 + 5): 2 x 68
    assert mm.forward_peak(flash, mm.Setup(2, 3, "bf16", True)) == 522 + 172 + 72 + 120 + 136


def test_the_checkpointed_forward_with_flash_attention_and_a_narrow_ffn_peaks_in_the_attention():
    # d = 4, f = 2, batch 2 x 3: saved 312 (embeddings) + 2 x 24 x 4 (inputs) + 164 (head);
    # q, k, v and the output 4 x 24 x 4 outweigh the FFN's 24 x 4 + 2 x 12 x 4
    narrow = mm.Arch(7, 4, 2, 2, 2, 11, attention="flash")
    assert mm.forward_peak(narrow, mm.Setup(2, 3, "no", True)) == 312 + 192 + 164 + 384


def test_the_checkpointed_bf16_forward_of_one_token_peaks_at_its_end_with_every_copy():
    # saved: embeddings 16 + 20 + 12, block inputs 2 x 12, head 24 + 30 + 20; autocast holds 384 bytes
    flash = mm.Arch(7, 3, 5, 2, 2, 11, attention="flash")
    assert mm.forward_peak(flash, mm.Setup(1, 1, "bf16", True)) == 146 + 384


# ----------------------------------------------------------------------------------------------
# The backward's peak
# head gradients 4 x 20 = 80; the last block's LayerNorm and lin2: 4 x (6 + 15 + 3) = 96;
# every gradient at the end: 4 x 276 = 1104


def test_the_fp32_backward_peaks_in_the_last_blocks_gelu():
    assert mm.backward_peak(TINY, mm.Setup(2, 3)) == 3228 + 80 + 96 + 30 * 4


def test_the_bf16_backward_holds_a_16_bit_gelu_gradient():
    assert mm.backward_peak(TINY, mm.Setup(2, 3, "bf16")) == 3090 + 80 + 96 + 30 * 2


def test_the_backward_of_one_token_peaks_at_its_end_with_every_gradient():
    # 492 saved + 80 + 96 + 20 is less than every gradient 1104 beside the embeddings' output 3 x 4
    assert mm.backward_peak(TINY, mm.Setup(1, 1)) == 1104 + 12
    assert mm.backward_peak(TINY, mm.Setup(1, 1, "no", True)) == 1104 + 12


# checkpointed, batch 2 x 3: one block's activations 1416 (fp32) / 1356 (bf16), the embeddings' 264,
# a block's gradients 4 x 98 = 392; the first block's backward holds the second's gradients


def test_the_checkpointed_fp32_backward_peaks_in_the_first_block_beside_the_seconds_gradients():
    assert mm.backward_peak(TINY, mm.Setup(2, 3, "no", True)) == 264 + 72 + 1416 + 80 + 392 + 96 + 120


def test_the_checkpointed_bf16_backward_peaks_in_the_first_block_beside_the_seconds_gradients():
    assert mm.backward_peak(TINY, mm.Setup(2, 3, "bf16", True)) == 264 + 72 + 1356 + 80 + 392 + 96 + 60


def test_the_checkpointed_backward_of_a_large_batch_peaks_in_the_last_block_beside_both_inputs():
    # batch 12 x 3 (t = 36): embeddings 312 + 720 + 432, two fp32 inputs 2 x 36 x 3 x 4, a block 8496,
    # the GELU gradient 36 x 5 x 4; the inputs outweigh a block's gradients
    assert mm.backward_peak(TINY, mm.Setup(12, 3, "no", True)) == 1464 + 864 + 8496 + 80 + 96 + 720


# ----------------------------------------------------------------------------------------------
# predict: every part and branch


def test_predict_an_fp32_adamw_step():
    assert mm.predict(TINY, mm.Setup(2, 3)) == {
        "weights": 1104,
        "gradients": 1104,
        "optimizer state": 2208,
        "saved for backward": 3936,  # 3228 + the aliases: 24 + 2 x (48 + 264) + 60
        "forward": 3300,
        "backward": 3524,
        "optimizer step": 1104,
        "step peak": 3524,
    }


def test_predict_a_checkpointed_bf16_adafactor_step():
    assert mm.predict(TINY, mm.Setup(2, 3, "bf16", True, "adafactor")) == {
        "weights": 1104,
        "gradients": 1104,
        "optimizer state": 760,
        "saved for backward": 546,
        "forward": 1630,
        "backward": 2320,
        "optimizer step": 1104 + 132,
        "step peak": 2320,
    }


def test_predict_an_8bit_step_that_peaks_in_the_optimizer():
    predicted = mm.predict(TINY, mm.Setup(1, 1, optimizer="adamw8bit"))
    assert predicted == {
        "weights": 1104,
        "gradients": 1104,
        "optimizer state": 4256,
        "saved for backward": 1200,  # 492 + 708 of aliases
        "forward": 492 + 12,
        "backward": 1116,
        "optimizer step": 1104 + 660,
        "step peak": 1764,
    }
    assert list(predicted) == [*mm.PARTS[:4], *mm.BRANCHES, "step peak"]
    assert all(type(v) is int for v in predicted.values())


def test_predicted_checkpointed_peaks_are_whole_bytes():
    for setup in (mm.Setup(2, 3, "no", True), mm.Setup(12, 3, "bf16", True)):
        assert all(type(v) is int for v in mm.predict(TINY, setup).values())


# ----------------------------------------------------------------------------------------------
# per_rank: ZeRO's stages over 4 ranks

PARTS = {"weights": 400, "gradients": 800, "optimizer state": 1600}


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        ("ddp", (400, 800, 1600)),
        ("zero1", (400, 800, 400)),
        ("zero2", (400, 200, 400)),
        ("zero3", (100, 200, 400)),
    ],
)
def test_each_zero_stage_shards_one_more_part(stage, expected):
    weights, gradients, state = expected
    assert mm.per_rank(PARTS, stage, 4) == {
        "weights": weights,
        "gradients": gradients,
        "optimizer state": state,
        "total": weights + gradients + state,
    }


def test_per_rank_on_one_rank_holds_everything_and_reads_a_prediction():
    parts = mm.predict(TINY, mm.Setup(2, 3))
    assert mm.per_rank(parts, "zero3", 1) == {
        "weights": 1104,
        "gradients": 1104,
        "optimizer state": 2208,
        "total": 4416,
    }


def test_per_rank_names_the_stages_and_refuses_no_ranks():
    with pytest.raises(ValueError, match=r"stage must be one of ddp, zero1, zero2, zero3, got 'zero4'"):
        mm.per_rank(PARTS, "zero4", 2)
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        mm.per_rank(PARTS, "ddp", 0)


# ----------------------------------------------------------------------------------------------
# bytes per parameter


def test_bytes_per_param_sums_a_row():
    assert mm.bytes_per_param(1, 2, 4, 8) == {
        "weights": 1,
        "gradients": 2,
        "master weights": 4,
        "optimizer state": 8,
        "total": 15,
    }


def test_the_two_rows_of_sixteen_bytes_per_parameter():
    # the ZeRO paper: fp16 weights and gradients, an fp32 master copy, Adam's two fp32 moments
    assert mm.MIXED_ADAMW == {
        "weights": 2,
        "gradients": 2,
        "master weights": 4,
        "optimizer state": 8,
        "total": 16,
    }
    # the course's autocast: fp32 weights and gradients, no master copy
    assert mm.AUTOCAST_ADAMW == {
        "weights": 4,
        "gradients": 4,
        "master weights": 0,
        "optimizer state": 8,
        "total": 16,
    }
