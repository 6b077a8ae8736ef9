#!/usr/bin/env bash
# The GPU runs behind docs/performance.md and the GPU claims in docs/, on an H100/H200 with the
# .gpu kit (the GPU machine's install, not part of this repository): `bash benchmarks/gpu_suite.sh
# STAGE... ` with $OUT set.
# Stages: tests (tests/gpu, one GPU), linear (native vs bf16 vs torchao at the 70B shapes),
# profile (GPU time per kernel, GEMMs against casts, every engine), cast (the one-pass cast's
# tiles), bench (fp8plug bench, every engine), sweep (the shapes the roofline filter is calibrated
# on), train (probe-model training step), train-1b (the 1b model, filter on and off),
# sdpa (which attention kernel each path runs), optim (optimizer-state memory), dist (two-GPU tests),
# llama-a, llama-b, llama-c (benchmarks/training/hf_llama.py, the Hugging Face Llama table: bf16,
# Accelerate's FP8 and fp8plug, in three parts of under 9 minutes each; `llama` runs all three and
# merges them, about 25 minutes).
# odd (the cost of padding odd token counts to FP8's alignment, ao and te).
# scalings (the benchmark Llama compiled, every scaling against bf16 and bf16 + attention change,
# profiled: docs/performance.md's scaling rows, about 8 minutes), moe (the Mixtral shape against
# bf16 experts with and without the attention change, compiled and eager, and every expert GEMM in the
# grouped kernel: docs/moe.md, about 9 minutes).
# liger-tests (tests/gpu/test_liger.py), liger (the Llama table's bf16 + Liger against fp8plug +
# Liger, under 9 minutes); with LIGER_WHEEL=path/to/liger_kernel-*.whl both install that wheel into
# a private folder first.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-out}; mkdir -p "$OUT"
source .gpu/install.sh >/dev/null 2>"$OUT/kit.log" || { cat "$OUT/kit.log"; exit 1; }
python3 -c "import torch, transformer_engine, torchao; print('device', torch.cuda.get_device_name(), 'torch', torch.__version__, 'TE', transformer_engine.__version__, 'torchao', torchao.__version__)"
LLAMA_A=bf16-compiled,accelerate-ao-compiled,accelerate-ao-noag-compiled,fp8plug-ao-compiled
LLAMA_B=fp8plug-native-compiled,bf16-eager,accelerate-te-eager,fp8plug-eager,fp8plug-native-eager,fp8plug-ao-eager,fp8plug-te-eager
LLAMA_C=fp8plug-compiled,fp8plug-te-compiled,accelerate-te-compiled
llama() {  # llama PART ROWS: one part of the table, JSON and log in $OUT, the table on stdout
  python3 benchmarks/training/hf_llama.py --rows "$2" --deadline 520 --timeout 300 --json "$OUT/hf_llama_$1.json" \
    "${@:3}" 2>"$OUT/hf_llama_$1.log"
}
liger_site() {  # liger-kernel from its carried wheel (the GPU machine has no package index)
  if [ -n "${LIGER_WHEEL:-}" ] && [ -z "${LIGER_SITE:-}" ]; then
    LIGER_SITE=$(mktemp -d) && python3 -m pip install -q --no-deps --no-index --target "$LIGER_SITE" "$LIGER_WHEEL" \
      && export PYTHONPATH="$LIGER_SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
}
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    tests-native) python3 -m pytest tests/gpu/test_native.py -q -p no:cacheprovider -x 2>&1 | tail -3 ;;
    tests) python3 -m pytest tests/gpu -q -m "not slow" -p no:cacheprovider -x -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    tests-all) python3 -m pytest tests/gpu -q -m "" -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    linear) python3 benchmarks/linear/native_70b_shapes.py --json "$OUT/native_linear.json" 2>&1 | grep '^|\|device' ;;
    profile) (cd benchmarks && python3 profile_linear.py --engines native:dynamic,native:delayed,te:delayed,fp8-gemm --json "$OUT/profile.json") 2>&1 | grep -v Warning | tee "$OUT/profile.log" | grep "^==" ;;
    cast) python3 benchmarks/linear/fused_cast_tiles.py --json "$OUT/fused_cast_tiles.json" 2>&1 | tail -8 ;;
    bench) python3 -m fp8plug.bench --no-progress --engines native:dynamic,native:delayed,ao,te:delayed,te:current,fp8-gemm --modes compiled --json "$OUT/bench.json" --csv "$OUT/bench.csv" 2>&1 | tail -40 ;;
    train) python3 benchmarks/training/train_step.py --model probe --engines native,ao --timeout 200 --out "$OUT/probe_native_ao" 2>&1 | tail -12
           python3 benchmarks/training/train_step.py --model probe --engines te --timeout 200 --out "$OUT/probe_te" 2>&1 | tail -8 ;;
    train-1b) python3 benchmarks/training/train_step.py --model 1b --engines native --timeout 150 --out "$OUT/1b_native" 2>&1 | tail -8
              FP8PLUG_AUTO_FILTER=false python3 benchmarks/training/train_step.py --model 1b --engines native --paths fp8plug --timeout 150 --out "$OUT/1b_native_nofilter" 2>&1 | tail -4 ;;
    sweep) python3 -m fp8plug.bench --no-progress --shapes sweep --modes compiled --engines native:delayed,ao --json "$OUT/bench_sweep_queued.json" 2>&1 | tail -64
           python3 -m fp8plug.bench --no-progress --shapes sweep --modes eager --engines te:delayed --json "$OUT/bench_sweep_queued_te_eager.json" 2>&1 | tail -42 ;;
    sdpa) (cd benchmarks && for p in fp8plug raw; do python3 sdpa_choice.py --paths $p --layers 2 --compile blocks; done) 2>&1 | grep "==\|compiled step" ;;
    optim) python3 benchmarks/training/optimizer_states.py --device cuda --kinds fp32,fp8,8bit --out "$OUT/optimizer_states_gpu.md" 2>&1 | tail -10 ;;
    multi) FP8PLUG_RECORD_DIR="$OUT/runs" python3 -m pytest tests/gpu/test_scaling.py tests/gpu/test_trainer.py \
             tests/gpu/test_distributed.py tests/gpu/test_ao_fsdp2.py -k "rank or reduction or two_gpus or fsdp2 or ddp" \
             -q -s -p no:cacheprovider -rs 2>&1 | tee "$OUT/multi.log" | grep -v "^{" | tail -30 ;;
    dist) FP8PLUG_RECORD_DIR="$OUT/runs" python3 -m pytest tests/gpu/test_distributed.py tests/gpu/test_ao_fsdp2.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/dist.log" | tail -30 ;;
    llama-a) llama a "$LLAMA_A" ;;
    llama-b) llama b "$LLAMA_B" ;;
    llama-c) llama c "$LLAMA_C" ;;
    llama) llama a "$LLAMA_A" >/dev/null; llama b "$LLAMA_B" >/dev/null; llama c "$LLAMA_C" >/dev/null
           python3 benchmarks/training/hf_llama.py --table "$OUT"/hf_llama_{a,b,c}.json --json "$OUT/hf_llama.json" ;;
    liger-tests) liger_site
           FP8PLUG_RECORD_DIR="$OUT/runs" python3 -m pytest tests/gpu/test_liger.py -q -s -p no:cacheprovider -rs 2>&1 \
             | tee "$OUT/liger_tests.log" | tail -5 ;;
    liger) liger_site; llama liger bf16-compiled,fp8plug-compiled,bf16-eager,fp8plug-eager --liger ;;
    scalings) python3 benchmarks/training/hf_llama.py --steps 30 --profile 2 --timeout 110 --deadline 560 \
             --rows bf16-usercompiled,bf16-skipmask-usercompiled,fp8plug-usercompiled,fp8plug-rowwise-usercompiled,fp8plug-blockwise-usercompiled \
             --json "$OUT/llama_scalings.json" 2>"$OUT/llama_scalings.log" | grep '^|' ;;
    moe) python3 benchmarks/moe/moe_llm.py --model mixtral --steps 30 --profile 2 --timeout 100 --deadline 520 \
           --rows fp8plug-bf16weights-usercompiled,fp8plug-bf16weights-grouped-usercompiled,bf16-bf16weights-skipmask-usercompiled,bf16-bf16weights-usercompiled,fp8plug-bf16weights-eager,bf16-bf16weights-eager \
           --json "$OUT/moe.json" 2>"$OUT/moe.log" | grep '^|' ;;
    odd) python3 benchmarks/linear/odd_tokens.py --json "$OUT/odd_tokens.json" 2>&1 | grep '^|\|^#' ;;
    *) echo "unknown stage $stage" ;;
  esac
done
