#!/usr/bin/env bash
# The GPU checks and measurements of docs/gpu.md in one command, for a bare GPU machine (torch
# only) that got megatron-core as wheels in .whl/ and, for the vLLM phases, vLLM installed with
# ../shared/device/vllm (its /tmp/vllm_env.sh is sourced when present). One log per phase goes to
# $OUT (default /tmp/gpu_out); the JSON lines of every phase are printed at the end.
#
#   bash tests/gpu/device_run.sh grpo_colocate grpo_full_1p5b grpo_lora_1p5b vllm_tests
#
# The gate every change to model, kernel, rollout, weight-sync or LoRA code passes before its
# issue is resolved (docs/gpu.md, "The GPU gate"):
#   matrix          tests/gpu/matrix.py: GRPO with vLLM colocate, full and LoRA, on every model
#                   family at real layer widths (reduced depth), the defaults, the weight-sync
#                   check and the dry run's memory estimate; the cases side by side, one per
#                   visible GPU; one log per case in $OUT/<phase> (also packed as
#                   $OUT/<phase>_logs.tgz), a table at the end. MATRIX_CASES="a b" runs some of
#                   its cases or families (one device call is 10 minutes)
#   matrix_2gpu     server mode, TP=2, PP=2, EP=2, CP=2, each on a dense and a MoE or hybrid
#                   model (2 GPUs per case; two at a time on 4 GPUs)
#   matrix_4gpu     TP=2 x DP=2 and EP=4 on Qwen3.5-MoE (4 GPUs)
#   matrix_all      the three parts packed onto a four-GPU machine, the largest cases first.
#                   A part outlasts a 10-minute device call: run it with tests/gpu/background.sh
#                   (start, then wait in the next calls, then collect)
#
# Phases (run in the order given; a failing phase is reported and the next one still runs):
#   grpo_colocate   GRPO, Qwen2.5-0.5B shape, vLLM colocate with sleep level 1, weight-sync check
#   grpo_full_1p5b  GRPO, Qwen2.5-1.5B shape, full-parameter (reference model copy), vLLM colocate
#   grpo_lora_1p5b  the same with --train_type lora (reference = adapters disabled)
#   vllm_tests      tests/gpu/test_vllm_gpu.py (colocate engine, MoE sync, offload; server: 2 GPUs)
#   bridge_tests    tests/gpu/test_bridge_gpu.py (HF vs Megatron logits; TP=2 parts need 2 GPUs)
#   trl_compare     benchmarks/trl_compare.py: ours vs TRL's GRPOTrainer, Qwen2.5-1.5B shape
#   trl_varlen      the same with completions of spread lengths (--variable_length)
#   trl_tokens      trl_compare with ours forming micro-batches by an 8k-token budget, then a
#                   16k one (--max_tokens_per_micro_batch; one TRL run for both)
#   trl_varlen_tokens  trl_varlen with the same token budget
#   trl_varlen_both  trl_varlen with the 8k budget and $BOTH (no more memory than TRL), 6 batches
#   rollout_probe   benchmarks/rollout.py colocate (0.5B shape): sync speed, logprob mismatch,
#                   sleep levels 1 and 2 with the tensors each changed
#   sleep_level2    benchmarks/sleep_level2.py (0.5B shape, ~6 min): which step of the colocate
#                   flow breaks sleep level 2 and which candidate fix keeps the greedy output
#   profile         ours alone on the trl_compare setup, the 3rd rollout batch under the torch
#                   profiler ($OUT/profile/profile_rank0.txt, training/profile.py)
#   profile_varlen  the same with spread lengths and $BOTH: the 3rd batch, the slow one of both
#                   trl_varlen_both runs
#   profile_workload  the profile phase on another workload of trl_compare's: PROFILE_PRESET
#                   (qwen2.5-1.5b), PROFILE_ARGS (trl_compare's own options, e.g. "--lora 16"
#                   or "--completion_length 4096 --variable_length") and PROFILE_FLAGS (ours'
#                   extra flags after the 8k budget) -> $OUT/profile_<preset>/
# Two GPUs (nvidia-h200-x2):
#   trl_compare_2gpu  trl_compare data-parallel over 2 GPUs, twice the work (weak scaling)
#   lora_scaling      ours with --train_type lora on the trl_compare setup, 1 GPU then 2 GPUs
#   grpo_server       `megatron rollout` on GPU 1, the trainer on GPU 0 (trl_compare setup,
#                     ours only, NCCL weight push)
#   async_server      grpo_server's setup twice on one server: --async_generate false, then true
#   tp2_colocate      grpo_step with --tensor_model_parallel_size 2 on 2 GPUs (sync time)
#   scale_8b          the Qwen3-8B shape (all 36 layers), full parameters, ours alone on 2 GPUs,
#                     colocate, 4 rollout batches of 128 completions: TP=2 with sequence
#                     parallelism (12k budget), then PP=2 (--auto_parallel's choice, 3k), then
#                     DP=2 with the distributed optimizer offloaded while generating (3k); the
#                     layouts and budgets are --auto_parallel's estimates at 139 GiB
#   scale_8b_server   the same model in server mode: `megatron rollout` on GPU 1, the trainer on
#                     GPU 0 with its optimizer on the CPU ($SERVER_8B), NCCL weight push
#   async_8b          scale_8b_server with reasoning-length completions (up to 4096 tokens,
#                     geometric lengths of mean ~500): --async_generate false, then true
#   async_reasoning   the same on trl_reasoning's 1.5B shape (the trainer at the 8k budget):
#                     the long-completion workload of one GPU, generation overlapped on a second
#   scale_8b_lora     weak scaling of the Qwen3-8B shape with LoRA rank 16 (8k budget): 1 GPU,
#                     then 2 GPUs data-parallel with twice the work
#   export_speed      benchmarks/export_speed.py at TP=1 and TP=2 (the bridge's export alone)
#   trl_2gpu_tokens   trl_compare_2gpu with ours at the 8k-token micro-batch budget
#   server_check      grpo_server at the 8k budget with --check_weight_sync true (engine vs
#                     trainer logprob gap after every NCCL push)
#   tp2_lora_vs_full  ours at TP=2 on 2 GPUs (DP=1, the 2-GPU work), full then LoRA, 8k budget
#   moe_ep2           qwen3_5_moe_vllm on 2 GPUs with --expert_model_parallel_size 2 (DP=2)
# One GPU:
#   lora_vs_full      ours on the trl_compare setup with the 8k-token budget: full, LoRA, LoRA
#                     without dropout, and full with --recompute_granularity full
#   lora_train        ours on the same setup: full, LoRA and LoRA without dropout (no TRL: the
#                     LoRA-against-full train phase in one command)
#   lora_dropout      LoRA on the same setup with --lora_dropout 0.05 (ms-swift's default), then 0
#   long_context      benchmarks/long_context.py: one 16k-token sequence at CP=1, then 16k and
#                     32k at CP=2 (2 GPUs), train-step time and peak memory
#   long_recompute    32k tokens with full activation recomputation, CP=1 then CP=2 (2 GPUs)
#   multi_turn        trl_varlen's setup (ours) as 3-turn grid-world episodes (gym_scheduler),
#                     the EOS calibrated on the grid-world prompts
#   qwen3_5           HF vs Megatron logits of the Qwen3.5 shapes (fla kernels; the 1-GPU
#                     cases, ~400 s on a fresh machine), then GRPO on the 9B-layer-shape 4-layer
#                     model without vLLM (generation in transformers: over 250 s, give it 600 s)
#   qwen3_5_vllm      GRPO on the Qwen3.5 9B-layer-shape 4-layer model, vLLM colocate with sleep
#                     level 1, weight-sync check (engine-vs-trainer logprob gap), bf16,
#                     --offload_optimizer (to fit an H100)
#   qwen3_5_moe_vllm  the same on the Qwen3.5-35B-A3B layer shape with 8 layers (64 experts);
#                     --check_weight_sync_atol 0.5 (bf16 routing of a random router: 0.18-0.24
#                     measured on an H200, 0.19 on the CPU; docs/export.md)
#   moe_numerics      benchmarks/moe_numerics.py --device cuda at the preset width: a pushed vLLM
#                     engine against a disk-loaded one, and the bf16 gaps of a random Qwen3.5-MoE
#   sync_split        benchmarks/sync_split.py: the weight sync's pieces, Qwen2.5-1.5B vs
#                     Qwen3.5 9B-layer shape (the offload moves --check_weight_sync adds)
#   vl_grpo           GRPO, Qwen2.5-VL-3B shape (whole 32-block tower, 448x448 colour images of
#                     256 image tokens), vLLM colocate with sleep level 1, weight-sync check,
#                     --offload_optimizer and micro batch 2 (to fit an H100)
#   sleep2            ours at the 8k budget with --check_weight_sync true, sleep level 2 then 1
#   trl_level2        TRL and ours (8k budget) both at sleep level 2 (TRL's default), one command
#   trl_lora          TRL, then ours full, LoRA and LoRA without dropout (8k budget), one command
#   lora_vs_trl       trl_lora without the no-dropout run (fits one call with the vLLM install)
#   fused_logprobs    benchmarks/logprobs_kernel.py (eager vs compiled logprob math), then ours with
#                     SWIFT_MEGATRON_COMPILE_LOGPROBS=0 (eager), then TRL and ours (compiled, the
#                     default on CUDA), 8k budget: before / after on one machine
#   profile_lora      the profile phase with --train_type lora and the 8k budget ($OUT/profile_lora/)
#   lora_last         lora_train in the other order: LoRA, LoRA without dropout, then full (the
#                     first run of a command was the slow one on some hosts)
#   memory_least      ours full-parameter on the trl_compare setup (8k budget) with the least
#                     memory we offer at that budget: --offload_ref_model, full recomputation
#   trl_memory        TRL, ours (8k budget), then ours with memory_least's flags, one command
#   offload_ref       ours on the trl_compare setup (8k budget), then with --offload_ref_model true
#   trl_alone         TRL alone on the trl_compare setup (the baseline of the phases below, run
#                     on the same machine in its own call: TRL and two runs of ours with the
#                     vLLM install do not fit one)
#   head_least        ours with memory_least's flags, then the same with the reference resident
#                     (--offload_ref_model false): the output layer's chunked logprobs keep no
#                     logits, is the freed memory worth a resident reference?
#   head_block        ours at the 8k budget, then with the reference offloaded and 21 of the 28
#                     layers recomputed (--recompute_method block --recompute_num_layers 21)
#   trl_both          ours with head_block's second flags, then TRL, one command, 6 rollout
#                     batches, batches 3-6 averaged (fits one call on a machine where vLLM and
#                     TRL's wheels are already installed); trl_both_first: TRL first;
#                     trl_both_long: 8 rollout batches (is the last batch the slow one?)
#   trl_fast          ours without $BOTH's memory flags (the reference resident, no recomputation)
#                     at the 8k and 16k budgets, against TRL's fastest setting alone (its memory:
#                     103.7 GiB by torch's counter, 71.0 by the device's on 2026-11-29); give
#                     TRL_FASTEST when trl_fastest_sweep does not run first in the same command
#   trl_reasoning     trl_both's flags on reasoning-length completions: up to 4096 tokens, about
#                     geometric lengths of mean 512 (most short, a long tail); TRL in both settings
#   trl_lora8b        the Qwen3-8B shape (all 36 layers), both tools LoRA rank 16 on every linear
#                     layer, ours at the 8k budget; TRL in both settings
#   trl_vl            the Qwen2.5-VL-3B shape (all 36 layers, the whole tower), the colour task
#                     (one 448-pixel image per prompt, 256 image tokens), full parameters, the
#                     tower frozen in both tools; ours at the 8k budget; TRL in both settings
#   trl_fastest_sweep TRL alone on the trl_compare setup with gradient checkpointing off and, one
#                     run each, micro-batches of 16 and 32 completions, vLLM's sleep mode off (TRL's
#                     own default), torch.compile (each run at most 8 minutes): which of TRL's
#                     speed options fit and help (the best ones make `--trl_fastest` for the
#                     headline runs; on 2026-11-29 micro-batches of 32)
#   vl_vs_text        ours alone on trl_vl's setup, then on its text stack as a Qwen2 text model
#                     (the math task): the logprob and train phases' tokens/s with and without
#                     images and the tower
#   trl_qwen3_5       the Qwen3.5-9B layer shape, 4 layers (3 Gated DeltaNet, 1 attention), full
#                     parameters, ours at the 8k budget (TRL: transformers' Qwen3.5 with fla's
#                     kernels); trl_qwen3_5_lora: every layer of Qwen3.5-9B, LoRA rank 16
#   qwen3_5_moe_ours  ours alone on the Qwen3.5-35B-A3B layer shape with 8 layers (64 experts),
#                     full parameters, trl_compare's setup at the 8k budget: tokens/s per phase
#                     and the train phase's model FLOP/s against the bf16 peak (the dry run's
#                     estimate at 139 GiB: peak 95.9 GiB, generate phase)
#   compiled_layers   ours with $BOTH, 6 rollout batches, the layers' elementwise math eager
#                     (SWIFT_MEGATRON_COMPILE_LAYERS=0), then compiled (the default on CUDA)
#   lora_step         benchmarks/lora_step.py: full vs LoRA train step, profiler tables in
#                     $OUT/lora_step/ (the LoRA step measured 2.9x slower than full in GRPO)
#   lora_step_eager   the same, the layers' elementwise nodes eager (no profile): before / after
#   lora_step_8k      lora_step at GRPO's shape (2 micro-batches of 32 x 256 = 8k tokens), the
#                     layers' nodes eager then compiled; lora_8k_defaults: the same shape with
#                     each mode's default (full compiled, LoRA eager)
#   seeds             benchmarks/rollout.py at the trl_compare shape (1.5B, 128 requests of 64 + 256
#                     tokens, memory 0.3): vLLM generation with per-request seeds against one
#                     seed per call, 5 runs each, alternating
#   trl_seeds         trl_both with ours twice: one seed per call (the default), then
#                     --vllm_request_seeds true; TRL once
#   compiled_gpu      tests/gpu/test_compiled_gpu.py (compiled nodes against eager and float64)
#   layer_time        benchmarks/layer_time.py: a Qwen3.5 9B-layer stack's Gated DeltaNet and
#                     attention layers per token (forward + backward, 4k tokens) and the two
#                     kernels alone (fla's rule, SDPA)
#   gdn_gpu           tests/gpu/test_gdn_gpu.py (fla's gated delta rule, first and second calls,
#                     against megatron-core's float32 torch rule)
#   auto_grid         benchmarks/auto_grid.py: --auto_parallel's choice against a hand-tried grid
#                     (recompute x micro-batch budget) on the 1.5B shape, one GPU, one run each;
#                     auto_grid_qwen3_5: the Qwen3.5 9B-layer shape; auto_grid_8b: Qwen3-8B with
#                     LoRA rank 16; auto_grid_2gpu: DP, TP, TP+SP, PP on 2 GPUs, 1.5B then 8B full
#   host_profile      benchmarks/host_profile.py: py-spy over ours with $BOTH (6 rollout
#                     batches), a table of where the host's time goes per phase in
#                     $OUT/host_profile/; host_profile_lora: the same for LoRA without dropout.
#                     py-spy: on PATH, or its static binary carried as .pyspy/py-spy
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SWIFT_MEGATRON_NO_BAR=1
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site/megatron ]; then   # once per machine
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ -f /tmp/vllm_env.sh ]; then . /tmp/vllm_env.sh; fi
[ -e swift_megatron/cli ] || ln -sfn ../cli swift_megatron/cli   # a checkout not pip-installed
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WORK=/tmp/gpu_bench
GRPO="python3 benchmarks/grpo_step.py --work_dir $WORK --steps 4"
VLLM="--use_vllm true --vllm_mode colocate --sleep_level 1"
LEAST="--offload_ref_model true --recompute_granularity full --recompute_method uniform \
--recompute_num_layers 1"   # the least memory at a token budget (memory_least, trl_memory)
BOTH="--offload_ref_model true --recompute_granularity full --recompute_method block \
--recompute_num_layers 21"   # 2x TRL's speed at no more than its memory (head_block, trl_both)
PYSPY=$(command -v py-spy || echo "$PWD/.pyspy/py-spy")   # host_profile*
NO_TP="--tensor_model_parallel_size 1 --sequence_parallel false"   # scale_8b's variants
# the trainer of an 8B model alone on one GPU: its optimizer on the CPU (--auto_parallel's choice)
SERVER_8B="--optimizer_cpu_offload true --use_precision_aware_optimizer true \
--max_tokens_per_micro_batch 12288"
MICRO16='{"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4}'   # 64 per step
MICRO32='{"per_device_train_batch_size": 32, "gradient_accumulation_steps": 2}'
STEADY="--rollout_batches 6 --warmup_batches 2"   # the first run on a fresh machine stays slow
# for a few batches, whichever tool it is: average batches 3-6 (trl_both*)
# TRL's settings in the workload phases (trl_both, trl_reasoning, trl_lora8b, trl_vl,
# trl_qwen3_5*): TRL_SETTINGS (both by default; "fastest" alone saves a run where the defaults
# are not needed) and TRL_FASTEST, the GRPOConfig fields of TRL's fastest setting (JSON); unset,
# those trl_fastest_sweep picked earlier in this run ($OUT/trl_fastest.json), else '{}'
TRL_SETTINGS=${TRL_SETTINGS:-defaults fastest}
trl_fastest() {
    if [ -n "${TRL_FASTEST:-}" ]; then echo "$TRL_FASTEST"
    elif [ -s "$OUT/trl_fastest.json" ]; then cat "$OUT/trl_fastest.json"
    else echo '{}'; fi
}

trl_workload() {   # trl_compare.py "$@" with TRL's settings above; where TRL's fastest setting
    # fails with those fields (the sweep's micro-batches of 1.5B x 256 tokens can run out of
    # memory on a larger workload), TRL's fastest once more with gradient checkpointing off alone
    local fastest record status
    fastest=$(trl_fastest) record=$(mktemp)
    python3 benchmarks/trl_compare.py --trl_settings $TRL_SETTINGS --trl_fastest "$fastest" "$@" \
        | tee "$record"
    status=${PIPESTATUS[0]}
    if [ "$fastest" != '{}' ] && grep -q '"name": "failed", "tool": "trl_fastest"' "$record"; then
        echo "trl_workload: TRL's fastest setting failed with $fastest; again with {}"
        python3 benchmarks/trl_compare.py --tool trl --trl_settings fastest --trl_fastest '{}' "$@"
        status=$?
    fi
    rm -f "$record"
    return $status
}

grpo_server() {   # one run per argument: the trainer's extra flags (server mode on GPU 1);
    # SERVER_PRESET (qwen2.5-1.5b), SERVER_MAX_LEN (the server's --vllm_max_model_len, 1024) and
    # SERVER_ARGS (trl_compare.py's own options) change the workload
    local work=/tmp/grpo_server port=8011 model pid status=0 extra
    local preset=${SERVER_PRESET:-qwen2.5-1.5b}
    model=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from grpo_step import \
build_model; print(build_model('$preset', '$work/server_model_$preset', 'bfloat16'))") || return 1
    CUDA_VISIBLE_DEVICES=1 python3 -m swift_megatron.cli.main rollout --model "$model" \
        --port $port --vllm_max_model_len ${SERVER_MAX_LEN:-1024} \
        > "$OUT/grpo_server.server.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        kill -0 $pid 2>/dev/null || { echo "the rollout server exited"; return 1; }
        sleep 3
    done
    for extra in "$@"; do
        echo "== trainer flags: $extra"
        CUDA_VISIBLE_DEVICES=0 python3 benchmarks/trl_compare.py --preset "$preset" --tool ours \
            --rollout_batches 4 --work_dir $work ${SERVER_ARGS:-} -- --vllm_mode server \
            --vllm_server_host 127.0.0.1 --vllm_server_port $port $extra || status=1
    done
    kill $pid; wait $pid 2>/dev/null
    return $status
}

phase() {
    case "$1" in
        matrix|matrix_2gpu|matrix_4gpu|matrix_all)
            local part=$1; [ "$1" = matrix_all ] && part=all
            python3 tests/gpu/matrix.py --part "$part" --out "$OUT/$1" --cases ${MATRIX_CASES:-} \
                ${MATRIX_ARGS:-}
            local status=$?
            tar czf "$OUT/$1_logs.tgz" -C "$OUT" "$1"
            return $status ;;
        grpo_colocate) $GRPO --preset qwen2.5-0.5b --run_name colocate -- $VLLM \
                           --vllm_gpu_memory_utilization 0.35 --check_weight_sync true ;;
        grpo_full_1p5b) $GRPO --preset qwen2.5-1.5b --run_name full -- $VLLM \
                            --vllm_gpu_memory_utilization 0.3 ;;
        grpo_lora_1p5b) $GRPO --preset qwen2.5-1.5b --run_name lora -- $VLLM \
                            --vllm_gpu_memory_utilization 0.3 --train_type lora ;;
        vllm_tests) python3 -m pytest tests/gpu/test_vllm_gpu.py -q -s -x ;;
        bridge_tests) python3 -m pytest tests/gpu/test_bridge_gpu.py -q -s ;;
        trl_compare) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                         --work_dir /tmp/trl_compare ;;
        trl_varlen) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                        --work_dir /tmp/trl_varlen --variable_length ;;
        trl_varlen_both) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b $STEADY \
                             --work_dir /tmp/trl_varlen --variable_length \
                             -- --max_tokens_per_micro_batch 8192 $BOTH ;;
        trl_tokens) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                        --work_dir /tmp/trl_tokens \
                        --variant 16k="--max_tokens_per_micro_batch 16384" \
                        -- --max_tokens_per_micro_batch 8192 ;;
        trl_varlen_tokens) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b \
                               --rollout_batches 4 --work_dir /tmp/trl_varlen_tokens \
                               --variable_length -- --max_tokens_per_micro_batch 16384 ;;
        profile) SWIFT_MEGATRON_PROFILE=$OUT/profile python3 benchmarks/trl_compare.py \
                     --preset qwen2.5-1.5b --rollout_batches 3 --tool ours --work_dir /tmp/profile \
                     -- --max_tokens_per_micro_batch 8192 ;;
        profile_workload) SWIFT_MEGATRON_PROFILE=$OUT/profile_${PROFILE_PRESET:-qwen2.5-1.5b} \
                              python3 benchmarks/trl_compare.py \
                              --preset ${PROFILE_PRESET:-qwen2.5-1.5b} --rollout_batches 3 \
                              --tool ours --work_dir /tmp/profile_workload ${PROFILE_ARGS:-} \
                              -- --max_tokens_per_micro_batch 8192 ${PROFILE_FLAGS:-} ;;
        profile_varlen) SWIFT_MEGATRON_PROFILE=$OUT/profile python3 benchmarks/trl_compare.py \
                            --preset qwen2.5-1.5b --rollout_batches 3 --tool ours \
                            --work_dir /tmp/profile --variable_length \
                            -- --max_tokens_per_micro_batch 8192 $BOTH ;;
        sleep2) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                    --tool ours --work_dir /tmp/sleep2 --variant level1="--sleep_level 1" \
                    -- --max_tokens_per_micro_batch 8192 \
                    --sleep_level 2 --check_weight_sync true ;;
        trl_level2) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                        --work_dir /tmp/trl_level2 --sleep_level 2 -- --max_tokens_per_micro_batch 8192 ;;
        trl_lora) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                      --work_dir /tmp/trl_lora --variant lora="--train_type lora" \
                      --variant lora_nodrop="--train_type lora --lora_dropout 0" \
                      -- --max_tokens_per_micro_batch 8192 ;;
        lora_train) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                        --tool ours --work_dir /tmp/lora_train --variant lora="--train_type lora" \
                        --variant lora_nodrop="--train_type lora --lora_dropout 0" \
                        -- --max_tokens_per_micro_batch 8192 ;;
        lora_last) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                       --tool ours --work_dir /tmp/lora_last --variant lora_nodrop="--lora_dropout 0" \
                       --variant full="--train_type full" \
                       -- --max_tokens_per_micro_batch 8192 --train_type lora ;;
        lora_budget) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                         --tool ours --work_dir /tmp/lora_budget \
                         --variant lora_16k="--train_type lora --lora_dropout 0 --max_tokens_per_micro_batch 16384" \
                         --variant lora_8k="--train_type lora --lora_dropout 0" \
                         -- --max_tokens_per_micro_batch 8192 ;;   # full 8k, then LoRA at twice the budget (it fits in less memory)
        trl_memory) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                        --work_dir /tmp/trl_memory --variant least="$LEAST" \
                        -- --max_tokens_per_micro_batch 8192 ;;
        trl_alone) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                       --tool trl --work_dir /tmp/trl_alone ;;
        head_least) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                        --tool ours --work_dir /tmp/head_least \
                        --variant ref_resident="--offload_ref_model false" \
                        -- --max_tokens_per_micro_batch 8192 $LEAST ;;
        head_block) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                        --tool ours --work_dir /tmp/head_block --variant block="$BOTH" \
                        -- --max_tokens_per_micro_batch 8192 ;;
        trl_both) trl_workload --preset qwen2.5-1.5b $STEADY --work_dir /tmp/trl_both \
                      -- --max_tokens_per_micro_batch 8192 $BOTH ;;
        trl_both_long) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 8 \
                           --warmup_batches 2 --work_dir /tmp/trl_both -- \
                           --max_tokens_per_micro_batch 8192 $BOTH ;;
        trl_seeds) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b $STEADY \
                       --work_dir /tmp/trl_both --variant request_seeds="--vllm_request_seeds true" \
                       -- --max_tokens_per_micro_batch 8192 $BOTH ;;
        seeds) python3 benchmarks/rollout.py --mode colocate --preset qwen2.5-1.5b \
                   --work_dir /tmp/rollout_seeds --prompts 128 --prompt_len 64 --max_tokens 256 \
                   --gpu_memory_utilization 0.3 --repeats 5 --generate_only ;;
        trl_reasoning) trl_workload --preset qwen2.5-1.5b $STEADY --work_dir /tmp/trl_reasoning \
                           --completion_length 4096 --variable_length --eos_probability 0.002 \
                           -- --max_tokens_per_micro_batch 8192 $BOTH ;;
        trl_lora8b) trl_workload --preset qwen3-8b --lora 16 $STEADY --work_dir /tmp/trl_lora8b \
                        -- --max_tokens_per_micro_batch 8192 ;;
        trl_vl) trl_workload --preset qwen2.5-vl-3b $STEADY --work_dir /tmp/trl_vl \
                    -- --max_tokens_per_micro_batch 8192 ;;
        trl_fastest_sweep) for cfg in '{}' "$MICRO16" "$MICRO32" '{"vllm_enable_sleep_mode": false}' \
                               '{"torch_compile": true}'; do timeout -k 30 480 python3 benchmarks/trl_compare.py \
                               --preset qwen2.5-1.5b --tool trl --trl_settings fastest \
                               --trl_fastest "$cfg" $STEADY --work_dir /tmp/trl_sweep \
                               || echo "trl_fastest_sweep: $cfg failed"; done
                           python3 benchmarks/trl_sweep_pick.py "$OUT/trl_fastest_sweep.log" \
                               > "$OUT/trl_fastest.json" ;;
        vl_vs_text) for preset in qwen2.5-vl-3b qwen2.5-3b-text; do python3 \
                        benchmarks/trl_compare.py --preset $preset --tool ours $STEADY \
                        --work_dir /tmp/vl_vs_text -- --max_tokens_per_micro_batch 8192 \
                        || return 1; done ;;
        trl_qwen3_5) trl_workload --preset qwen3.5-9b-4l $STEADY --work_dir /tmp/trl_qwen3_5 \
                         -- --max_tokens_per_micro_batch 8192 ;;
        trl_qwen3_5_lora) trl_workload --preset qwen3.5-9b --lora 16 $STEADY \
                              --work_dir /tmp/trl_qwen3_5_lora -- --max_tokens_per_micro_batch 8192 ;;
        qwen3_5_moe_ours) python3 benchmarks/trl_compare.py --preset qwen3.5-moe-8l --tool ours \
                              $STEADY --work_dir /tmp/qwen3_5_moe -- --max_tokens_per_micro_batch 8192 ;;
        trl_fast) TRL_SETTINGS=fastest trl_workload --preset qwen2.5-1.5b $STEADY \
                      --work_dir /tmp/trl_both --variant 16k="--max_tokens_per_micro_batch 16384" \
                      -- --max_tokens_per_micro_batch 8192 ;;
        trl_both_first) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b $STEADY \
                            --trl_first --work_dir /tmp/trl_both -- --max_tokens_per_micro_batch 8192 $BOTH ;;
        compiled_layers) SWIFT_MEGATRON_COMPILE_LAYERS=0 python3 benchmarks/trl_compare.py \
                             --preset qwen2.5-1.5b $STEADY --tool ours --work_dir /tmp/eager_layers \
                             -- --max_tokens_per_micro_batch 8192 $BOTH
                         python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b $STEADY --tool ours \
                             --work_dir /tmp/compiled_layers -- --max_tokens_per_micro_batch 8192 $BOTH ;;
        memory_least) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                          --tool ours --work_dir /tmp/memory_least \
                          -- --max_tokens_per_micro_batch 8192 $LEAST ;;
        lora_vs_trl) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                         --work_dir /tmp/lora_vs_trl --variant lora="--train_type lora" \
                         -- --max_tokens_per_micro_batch 8192 ;;
        lora_dropout) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                          --tool ours --work_dir /tmp/lora_dropout --variant nodrop="--lora_dropout 0" \
                          -- --max_tokens_per_micro_batch 8192 --train_type lora ;;
        fused_logprobs) python3 benchmarks/logprobs_kernel.py || return 1
                        SWIFT_MEGATRON_COMPILE_LOGPROBS=0 python3 benchmarks/trl_compare.py \
                            --preset qwen2.5-1.5b --rollout_batches 4 --tool ours \
                            --work_dir /tmp/eager_logprobs -- --max_tokens_per_micro_batch 8192
                        python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                            --work_dir /tmp/fused_logprobs -- --max_tokens_per_micro_batch 8192 ;;
        profile_lora) SWIFT_MEGATRON_PROFILE=$OUT/profile_lora python3 benchmarks/trl_compare.py \
                          --preset qwen2.5-1.5b --rollout_batches 3 --tool ours \
                          --work_dir /tmp/profile_lora -- --train_type lora \
                          --max_tokens_per_micro_batch 8192 ;;
        lora_vs_full) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                          --tool ours --work_dir /tmp/lora_vs_full \
                          --variant lora="--train_type lora" \
                          --variant lora_nodrop="--train_type lora --lora_dropout 0" \
                          --variant full_recompute="--recompute_granularity full" \
                          -- --max_tokens_per_micro_batch 8192 ;;
        long_context) python3 benchmarks/long_context.py --seq 16384   # 32k at CP=1: OOM on an H200
                      [ "$(python3 -c "import torch; print(torch.cuda.device_count())")" -ge 2 ] || return 0
                      for seq in 16384 32768; do python3 -m torch.distributed.run --nproc_per_node 2 \
                          benchmarks/long_context.py --seq $seq --cp 2; done ;;
        long_recompute) python3 benchmarks/long_context.py --seq 32768 --recompute full
                        [ "$(python3 -c "import torch; print(torch.cuda.device_count())")" -ge 2 ] || return 0
                        python3 -m torch.distributed.run --nproc_per_node 2 \
                            benchmarks/long_context.py --seq 32768 --cp 2 --recompute full ;;
        multi_turn) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 3 \
                        --tool ours --variable_length --eos_context grid_world \
                        --work_dir /tmp/multi_turn -- \
                        --multi_turn_scheduler gym_scheduler --gym_env grid_world --max_turns 3 \
                        --use_gym_env true ;;
        qwen3_5) python3 -m pytest tests/gpu/test_bridge_gpu.py -q -s -k qwen3_5 &&
                 $GRPO --preset qwen3.5-9b-4l --run_name qwen3_5 -- --use_vllm false ;;
        # the dry run's estimates (H100, 79.2 GiB): trainer 52 / 58 GiB resident while vLLM's
        # 27.7 GiB generate: over the card without --offload_optimizer (it frees 31 / 35 GiB);
        # training 62 / 64 GiB (micro batch 2 for the VL model, 70 GiB at 4), 15% low measured
        qwen3_5_vllm) $GRPO --preset qwen3.5-9b-4l --run_name qwen3_5_vllm -- $VLLM \
                          --vllm_gpu_memory_utilization 0.35 --check_weight_sync true \
                          --torch_dtype bfloat16 --offload_optimizer true ;;
        qwen3_5_moe_vllm) $GRPO --preset qwen3.5-moe-8l --run_name qwen3_5_moe_vllm -- $VLLM \
                              --vllm_gpu_memory_utilization 0.35 --check_weight_sync true \
                              --check_weight_sync_atol 0.5 --torch_dtype bfloat16 \
                              --offload_optimizer true ;;
        moe_numerics) python3 benchmarks/moe_numerics.py --device cuda --hidden_size 2048 ;;
        sync_split) python3 benchmarks/sync_split.py --presets qwen2.5-1.5b qwen3.5-9b-4l ;;
        vl_grpo) $GRPO --preset qwen2.5-vl-3b --run_name vl_grpo -- $VLLM \
                     --vllm_gpu_memory_utilization 0.35 --check_weight_sync true \
                     --offload_optimizer true --micro_batch_size 2 ;;
        rollout_probe) for level in 1 2; do python3 benchmarks/rollout.py --mode colocate \
                           --preset qwen2.5-0.5b --work_dir /tmp/rollout_probe --prompts 64 \
                           --max_tokens 128 --sleep_level $level || return 1; done ;;
        sleep_level2) python3 benchmarks/sleep_level2.py ;;
        trl_compare_2gpu) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --nproc 2 \
                              --rollout_batches 4 --work_dir /tmp/trl_compare2 ;;
        lora_scaling) for n in 1 2; do python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b \
                          --tool ours --nproc $n --rollout_batches 4 --work_dir /tmp/lora$n \
                          -- --train_type lora || return 1; done ;;
        trl_2gpu_tokens) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --nproc 2 \
                             --rollout_batches 4 --work_dir /tmp/trl_2gpu_tokens \
                             -- --max_tokens_per_micro_batch 8192 ;;
        grpo_server) grpo_server "" ;;
        server_check) grpo_server "--max_tokens_per_micro_batch 8192 --check_weight_sync true" ;;
        tp2_lora_vs_full) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --nproc 2 \
                              --tool ours --rollout_batches 4 --work_dir /tmp/tp2_lora_vs_full \
                              --variant lora="--train_type lora" \
                              -- --tensor_model_parallel_size 2 --max_tokens_per_micro_batch 8192 ;;
        moe_ep2) NPROC_PER_NODE=2 $GRPO --preset qwen3.5-moe-8l --run_name moe_ep2 -- $VLLM \
                     --vllm_gpu_memory_utilization 0.35 --check_weight_sync true \
                     --check_weight_sync_atol 0.5 --torch_dtype bfloat16 --offload_optimizer true \
                     --expert_model_parallel_size 2 ;;
        async_server) grpo_server "--async_generate false" "--async_generate true" ;;
        scale_8b) python3 benchmarks/trl_compare.py --preset qwen3-8b --tool ours --nproc 2 \
                      --rollout_batches 4 --work_dir /tmp/scale_8b \
                      --variant pp2="$NO_TP --pipeline_model_parallel_size 2 \
--max_tokens_per_micro_batch 3072" \
                      --variant dp2="$NO_TP --offload_optimizer true --max_tokens_per_micro_batch 3072" \
                      -- --tensor_model_parallel_size 2 --sequence_parallel true \
                      --max_tokens_per_micro_batch 12288 ;;
        scale_8b_server) SERVER_PRESET=qwen3-8b grpo_server "$SERVER_8B" ;;
        async_8b) SERVER_PRESET=qwen3-8b SERVER_MAX_LEN=4608 SERVER_ARGS="--completion_length 4096 \
--variable_length --eos_probability 0.002" \
                  grpo_server "$SERVER_8B --async_generate false" "$SERVER_8B --async_generate true" ;;
        async_reasoning) SERVER_MAX_LEN=4608 SERVER_ARGS="--completion_length 4096 \
--variable_length --eos_probability 0.002" grpo_server \
                         "--max_tokens_per_micro_batch 8192 --async_generate false" \
                         "--max_tokens_per_micro_batch 8192 --async_generate true" ;;
        scale_8b_lora) for n in 1 2; do python3 benchmarks/trl_compare.py --preset qwen3-8b \
                           --lora 16 --tool ours --nproc $n --rollout_batches 4 \
                           --work_dir /tmp/scale_8b_lora$n -- --max_tokens_per_micro_batch 8192 \
                           || return 1; done ;;
        tp2_colocate) NPROC_PER_NODE=2 $GRPO --preset qwen2.5-1.5b --run_name tp2 -- $VLLM \
                          --vllm_gpu_memory_utilization 0.3 --tensor_model_parallel_size 2 ;;
        export_speed) python3 benchmarks/export_speed.py --preset qwen2.5-1.5b &&
                      python3 -m torch.distributed.run --nproc_per_node 2 \
                          benchmarks/export_speed.py --preset qwen2.5-1.5b ;;
        offload_ref) python3 benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 4 \
                         --tool ours --work_dir /tmp/offload_ref \
                         --variant offload_ref="--offload_ref_model true" \
                         -- --max_tokens_per_micro_batch 8192 ;;
        lora_step) python3 benchmarks/lora_step.py --preset qwen2.5-1.5b --profile $OUT/lora_step ;;
        lora_step_eager) SWIFT_MEGATRON_COMPILE_LAYERS=0 python3 benchmarks/lora_step.py \
                             --preset qwen2.5-1.5b ;;
        lora_step_8k) for c in 0 1; do echo "== SWIFT_MEGATRON_COMPILE_LAYERS=$c"
                          SWIFT_MEGATRON_COMPILE_LAYERS=$c python3 benchmarks/lora_step.py \
                              --preset qwen2.5-1.5b --micro_batches 2 --micro_batch 32 || return 1
                      done ;;
        lora_8k_defaults) python3 benchmarks/lora_step.py --preset qwen2.5-1.5b --micro_batches 2 \
                              --micro_batch 32 ;;
        compiled_gpu) python3 -m pytest tests/gpu/test_compiled_gpu.py -q -s ;;
        gdn_gpu) python3 -m pytest tests/gpu/test_gdn_gpu.py -q -s ;;
        layer_time) for seq in 1024 4096; do python3 benchmarks/layer_time.py \
                        --preset qwen3.5-9b-4l --seq $seq || return 1; done ;;
        auto_grid) python3 benchmarks/auto_grid.py --preset qwen2.5-1.5b --work_dir /tmp/auto_grid ;;
        auto_grid_qwen3_5) python3 benchmarks/auto_grid.py --preset qwen3.5-9b-4l \
                               --work_dir /tmp/auto_grid_qwen3_5 ;;
        auto_grid_8b) python3 benchmarks/auto_grid.py --preset qwen3-8b --lora 16 \
                          --work_dir /tmp/auto_grid_8b ;;
        auto_grid_2gpu) for preset in qwen2.5-1.5b qwen3-8b; do python3 benchmarks/auto_grid.py \
                            --preset $preset --nproc 2 --work_dir /tmp/auto_grid_2gpu_$preset \
                            || return 1; done ;;
        host_profile) python3 benchmarks/host_profile.py --out $OUT/host_profile --py_spy "$PYSPY" \
                          -- --preset qwen2.5-1.5b $STEADY --work_dir /tmp/host_profile \
                          -- --max_tokens_per_micro_batch 8192 $BOTH ;;
        host_profile_lora) python3 benchmarks/host_profile.py --out $OUT/host_profile_lora \
                               --py_spy "$PYSPY" -- --preset qwen2.5-1.5b $STEADY \
                               --work_dir /tmp/host_profile_lora -- --max_tokens_per_micro_batch 8192 \
                               --train_type lora --lora_dropout 0 ;;
        *) echo "unknown phase $1"; return 2 ;;
    esac
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
declare -A status
for name in "$@"; do
    start=$(date +%s)
    phase "$name" > "$OUT/$name.log" 2>&1
    status[$name]=$?
    echo "== $name: exit ${status[$name]} after $(( $(date +%s) - start )) s"
done
for name in "$@"; do
    echo "== $name (exit ${status[$name]})"
    grep -h '^{\|^|' "$OUT/$name.log"   # JSON lines and tables
    [ "${status[$name]}" = 0 ] || tail -n 25 "$OUT/$name.log"
done
