#!/usr/bin/env bash
# Check every GPU path of the course on a machine with a CUDA GPU, in one call, and print one table:
#   cuda placement, fp16 with GradScaler, bf16, torchrun with nccl (1 and N processes), the techniques
#   of lessons 04-06 (8-bit AdamW, checkpointing; bf16 compression hook and local SGD with N GPUs),
#   the benchmark on CUDA (--quick), the time-to-accuracy ladder on CUDA, and every lesson run on the
#   GPU under nbval, each checked cell whose output differs from the committed one listed.
# Usage (from the repository root, with the course installed in .venv or the active Python):
#   bash scripts/gpu_check.sh            # writes gpu-check/ (logs, summary.md) and prints the table
#   OUT=/tmp/gpu bash scripts/gpu_check.sh
# Needs a CUDA build of torch 2.13.0 (see README, "Using a GPU"). Runs offline (embedded model and data).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.md"
echo "| check | result | seconds | figures |" > "$SUMMARY"
echo "|---|---|---|---|" >> "$SUMMARY"

# check NAME COMMAND...: run, log to $OUT/NAME.log, add a row (figures: the log's lines starting with "FIGURE ")
check() {
  local name="$1"; shift
  local start=$SECONDS
  if "$@" > "$OUT/$name.log" 2>&1; then result=PASS; else result="FAIL (exit $?)"; fi
  local figures
  figures=$(grep -h '^FIGURE ' "$OUT/$name.log" | sed 's/^FIGURE //' | paste -sd ';' - | cut -c1-300)
  echo "| $name | $result | $((SECONDS - start)) | ${figures:-see $OUT/$name.log} |" >> "$SUMMARY"
  echo "$name: $result"
}

"$PY" - > "$OUT/machine.log" 2>&1 <<'PYEOF'
import torch
from course_lib.devices import format_machine
print(format_machine())
assert torch.cuda.is_available(), "no CUDA GPU visible: this script checks the GPU paths"
PYEOF
if ! grep -q "cuda_available: True" "$OUT/machine.log"; then
  cat "$OUT/machine.log"; echo "No CUDA GPU here: nothing to check."; exit 2
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")

check placement "$PY" - <<'PYEOF'
import torch
from course_lib import data, models
from course_lib.devices import get_device
from course_lib.training import fresh_accelerator
device = get_device()
assert device.type == "cuda", device
accelerator = fresh_accelerator()
assert accelerator.device.type == "cuda", accelerator.device
tok = models.load_tokenizer()
ds = data.tokenize_dataset(data.load_mrpc()["train"].select(range(64)), tok)
model, loader = accelerator.prepare(models.load_model(), data.make_dataloader(ds, tok, 16))
batch = next(iter(loader))
assert next(model.parameters()).device.type == "cuda" and batch["input_ids"].device.type == "cuda"
print(f"FIGURE model and batch on {accelerator.device} ({torch.cuda.get_device_name()})")
PYEOF

# fp16 + GradScaler and bf16 through the course loop, against fp32: losses finite, scaler active.
for precision in fp16 bf16 no; do
  check "loop-$precision" "$PY" - "$precision" <<'PYEOF'
import math, sys, torch
from course_lib import data, models
from course_lib.training import TrainConfig, train
precision = sys.argv[1]
if precision == "bf16" and not torch.cuda.is_bf16_supported():
    print("FIGURE skipped: this GPU has no bf16"); sys.exit(0)
tok = models.load_tokenizer()
splits = data.tokenize_dataset(data.load_mrpc(), tok)
train_dl = data.make_dataloader(splits["train"].select(range(1024)), tok, 32, shuffle=True, precision=precision)
val_dl = data.make_dataloader(splits["validation"], tok, 64, precision=precision)
h = train(models.load_model(), train_dl, TrainConfig(epochs=1, precision=precision, lr=3e-4, progress=False), val_dl)
assert h.config["device"].startswith("cuda") and all(math.isfinite(x) for x in h.losses)
if precision == "fp16":
    assert h.scaler_scales, "fp16 on CUDA must use a GradScaler"
print(f"FIGURE {precision}: {h.median_step_time() * 1000:.1f} ms/step, {h.tokens_per_s():,.0f} tokens/s, "
      f"val acc {h.evals[-1]['accuracy']:.3f}, scaler {h.scaler_scales[-1] if h.scaler_scales else '-'}, "
      f"skipped {h.skipped_steps}")
PYEOF
done

for n in 1 "$NGPU"; do
  check "torchrun-nccl-$n" bash -c "$PY -m torch.distributed.run --standalone --nproc_per_node $n \
    -m course_lib.cli.train --max-steps 40 --precision bf16 --output-dir $OUT/run-$n --no-progress \
    && $PY -c \"import json; m = json.load(open('$OUT/run-$n/metrics.json')); assert m['backend'] == 'nccl' or m['processes'] == 1, m['backend']; print('FIGURE', m['processes'], 'process(es),', m['backend'], ',', round(m['total_tokens_per_s']), 'tokens/s')\""
  [ "$NGPU" -gt 1 ] || break
done

# The techniques of lessons 04-06 on CUDA: 8-bit AdamW (bitsandbytes' CUDA kernels), checkpointing; with
# several GPUs also the bf16 compression hook (NCCL only) and local SGD.
check "techniques-1" "$PY" -m course_lib.cli.train --max-steps 20 --precision bf16 --optimizer adamw8bit \
  --gradient-checkpointing --output-dir "$OUT/run-techniques" --no-progress
if [ "$NGPU" -gt 1 ]; then
  check "torchrun-bf16-hook-$NGPU" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
    -m course_lib.cli.train --max-steps 20 --precision bf16 --comm-hook bf16 --output-dir "$OUT/run-hook" --no-progress
  check "torchrun-local-sgd-$NGPU" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
    -m course_lib.cli.train --max-steps 20 --precision bf16 --local-sgd-steps 4 --save-every 20 \
    --output-dir "$OUT/run-local-sgd" --no-progress
fi

check bench-quick "$PY" -m course_lib.cli.bench --device cuda --quick --json "$OUT/bench.json" --markdown "$OUT/bench.md"
# The time-to-accuracy ladder on the GPU: bf16 (or fp16) and torch.compile take their real turns there.
check recipe "$PY" -m course_lib.cli.recipe --device cuda --json "$OUT/recipe.json" --markdown "$OUT/recipe.md"

# The lessons on the GPU under nbval, against their committed (CPU) outputs: a checked cell must print
# what holds on every device, so each one that differs here is a DIFF line in $OUT/lesson-NAME.log
# (cell, committed and GPU output) and the row fails. Nothing is written back into notebooks/.
for nb in notebooks/0*.ipynb; do
  name=$(basename "$nb" .ipynb)
  check "lesson-$name" "$PY" -m course_tools.checked_outputs "$nb"
done
grep -h '^DIFF ' "$OUT"/lesson-*.log > "$OUT/checked-output-diffs.txt" 2>/dev/null || true

echo
cat "$SUMMARY"
! grep -q "| FAIL" "$SUMMARY"
