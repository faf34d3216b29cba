#!/usr/bin/env bash
# embedded-mars v7: v6 continued on a 2-core CPU on real-world prompts (recipes/README.md, "v7").
# Greedy bfloat16 answers to mixed prompts (half template prompts, half code and text requests built from the
# Python standard library's documentation), then `mars-hf train` from the shipped adapter for a wall-clock
# budget. Extra arguments go to `mars-hf train`. Evaluation prompts (MT-Bench, HumanEval, the held-out template
# split) cannot be drawn; v6's learning-curve prompts (data/embedded-mars/curve.jsonl) can, so that curve is v6's.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-embedded-mars-cpu-work}
TRAIN_MINUTES=${TRAIN_MINUTES:-68}
CALIBRATION_ROWS=${CALIBRATION_ROWS:-64}  # per distillation round
RANK=${RANK:-16}
mkdir -p "$WORK"
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

distill() {  # out seed prompts [more `mars-hf distill` arguments...]
    local out=$1 seed=$2 prompts=$3; shift 3
    mars-hf distill --out "$WORK/$out" --prompt-source mixed --num-prompts "$prompts" --seed "$seed" --batch-size 32 \
        --chunk 64 --dtype bfloat16 --max-new-tokens 128 "$@"
}
stamp "1. greedy answers (bfloat16) to 800 + 2,000 mixed prompts (two draws; the second skips the first's)"
distill round1.jsonl 7 800
distill round2.jsonl 11 2000 --exclude-prompts-from "$WORK/round1.jsonl"
stamp "2. the last $CALIBRATION_ROWS answers of each round kept apart to fit the calibration"
: > "$WORK/train.jsonl"; : > "$WORK/calibration.jsonl"
for round in round1 round2; do
    head -n "-$CALIBRATION_ROWS" "$WORK/$round.jsonl" >> "$WORK/train.jsonl"
    tail -n "$CALIBRATION_ROWS" "$WORK/$round.jsonl" >> "$WORK/calibration.jsonl"
done

stamp "3. training from the shipped adapter on $(wc -l < "$WORK/train.jsonl") answers for $TRAIN_MINUTES minutes"
mars-hf train --config recipes/embedded-mars.yaml --dataset_name "$WORK/train.jsonl" --output_dir "$WORK/run" \
    --init_adapter embedded-mars --use_cpu true --per_device_train_batch_size 8 --learning_rate 1e-3 \
    --max_train_minutes "$TRAIN_MINUTES" --max_length 768 --save_strategy no "$@"

stamp "4. package (PEFT's frozen copies dropped), cut to rank $RANK, calibrate on the kept-apart answers"
python examples/package_adapter.py "$WORK/run" "$WORK/embedded-mars-r32"
mars-hf reduce-rank "$WORK/embedded-mars-r32" --rank "$RANK" --out "$WORK/embedded-mars"
mars-hf calibrate "$WORK/embedded-mars" --data "$WORK/calibration.jsonl"
stamp "done: $WORK/embedded-mars"
