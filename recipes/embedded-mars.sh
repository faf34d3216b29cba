#!/usr/bin/env bash
# embedded-mars (v6) in one run: data, training, packaging, calibration (recipes/README.md).
# Budgets are wall-clock, so the same script runs on a GPU (where v6 was made) or, slowly, on a CPU.
# Extra arguments go to `mars-hf train` (e.g. `--max_train_minutes 60`). To continue the shipped model
# instead of starting again (runs add up): INIT_ADAPTER=embedded-mars SAMPLE_SEED=2 bash recipes/embedded-mars.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-embedded-mars-work}
NUM_PROMPTS=${NUM_PROMPTS:-2926}  # every training-split template prompt (none can be an evaluation prompt)
SAMPLES=${SAMPLES:-8}             # sampled answers per prompt
SAMPLE_SECONDS=${SAMPLE_SECONDS:-100}  # 18,432 answers in 100 s on one H200 (v6)
BATCH=${BATCH:-1024}
CALIBRATION_ROWS=${CALIBRATION_ROWS:-128}
RANK=${RANK:-16}
SAMPLE_SEED=${SAMPLE_SEED:-1}     # another seed samples other answers (new data for a continued run)
PROMPT_SOURCE=${PROMPT_SOURCE:-templates}  # templates (v6) | stdlib | mixed: real-world code and text requests too
INIT_ADAPTER=${INIT_ADAPTER:-}    # a saved MARS adapter to start from (MARSConfig.init_adapter); empty: from scratch
CURVE=data/embedded-mars/curve.jsonl  # the learning curve's answers: never trained on
mkdir -p "$WORK"
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

stamp "1. greedy answers (float32) to the training prompts, the learning curve's prompts left out"
mars-hf distill --out "$WORK/greedy.jsonl" --prompt-source "$PROMPT_SOURCE" --num-prompts "$NUM_PROMPTS" --seed 0 --batch-size "$BATCH" \
    --chunk 4096 --exclude-prompts-from "$CURVE"
stamp "2. the last $CALIBRATION_ROWS greedy answers kept apart to fit the calibration"
head -n "-$CALIBRATION_ROWS" "$WORK/greedy.jsonl" > "$WORK/greedy_train.jsonl"
tail -n "$CALIBRATION_ROWS" "$WORK/greedy.jsonl" > "$WORK/calibration.jsonl"

stamp "3. sampled answers (T = 0.8, top-p 0.95), $SAMPLES per prompt, for at most $SAMPLE_SECONDS s"
timeout "$SAMPLE_SECONDS" mars-hf distill --out "$WORK/sampled.jsonl" --prompt-source "$PROMPT_SOURCE" --num-prompts "$NUM_PROMPTS" --seed "$SAMPLE_SEED" \
    --temperature 0.8 --top-p 0.95 --samples-per-prompt "$SAMPLES" --batch-size "$BATCH" --chunk "$BATCH" \
    --exclude-prompts-from "$CURVE" "$WORK/calibration.jsonl" || true
if [ ! -f "$WORK/sampled.jsonl" ]; then  # stopped by the budget: keep its whole chunks
    touch "$WORK/sampled.jsonl.partial"
    sed '$ { /}$/!d }' "$WORK/sampled.jsonl.partial" > "$WORK/sampled.jsonl"
fi
cat "$WORK/greedy_train.jsonl" "$WORK/sampled.jsonl" > "$WORK/train.jsonl"

stamp "4. training on $(wc -l < "$WORK/train.jsonl") answers ($(wc -l < "$WORK/sampled.jsonl") sampled)"
mars-hf train --config recipes/embedded-mars.yaml --dataset_name "$WORK/train.jsonl" \
    --output_dir "$WORK/run" ${INIT_ADAPTER:+--init_adapter "$INIT_ADAPTER"} "$@"

stamp "5. package (PEFT's frozen copies dropped), cut to rank $RANK, calibrate on the kept-apart answers"
python examples/package_adapter.py "$WORK/run" "$WORK/embedded-mars-r32"
mars-hf reduce-rank "$WORK/embedded-mars-r32" --rank "$RANK" --out "$WORK/embedded-mars"
mars-hf calibrate "$WORK/embedded-mars" --data "$WORK/calibration.jsonl"
stamp "done: $WORK/embedded-mars"
