#!/usr/bin/env bash
# The GPU gate and the measurements of docs/gpu.md, by phase name, on a bare GPU machine (torch
# only) that got megatron-core and fla as wheels in .whl/ and, for the vLLM phases, vLLM from
# the parts of tests/gpu/vllm_parts.sh, installed by tests/gpu/vllm_install.sh (its
# /tmp/vllm_env.sh is sourced when present; docs/gpu.md, "The GPU gate", gives the calls):
#
#   bash tests/gpu/device_run.sh PHASE...   # in the order given; a failing phase does not stop the rest
#
# One log per phase goes to $OUT (default /tmp/gpu_out); the JSON lines and tables of every phase
# are printed at the end. Each phase is one line of the case table below, grouped by the
# docs/gpu.md section it feeds; the section gives its latest result. What each benchmark measures
# is its docstring's first paragraph (benchmarks/README.md lists them). tests/gpu holds:
#   matrix.py      the gate: GRPO with vLLM colocate on every family, full and LoRA, and the 2-
#                  and 4-GPU layouts, with the defaults (docs/gpu.md, "The GPU gate")
#   background.sh  runs phases longer than one 10-minute device call (start / wait / collect)
#   vllm_parts.sh, vllm_install.sh, vllm_wheels.txt   vLLM for the bare machine, in 9 parts
#   test_*.py      the GPU tests (phase gpu_tests; GPU_TESTS picks files or a -k expression)
# Knobs: MATRIX_CASES / MATRIX_ARGS (matrix*: its cases, --resume, --start_within), GPU_TESTS,
# TRL_SETTINGS / TRL_FASTEST (the trl_* workloads: TRL's settings, its fastest's GRPOConfig fields;
# unset, those trl_fastest_sweep picked earlier in the same $OUT), PROFILE_PRESET / PROFILE_ARGS /
# PROFILE_FLAGS (profile_workload: trl_compare's preset, its options, ours' extra flags).
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

# benchmarks/trl_compare.py on its default workload (the Qwen2.5-1.5B shape, 16 prompts x 8
# completions of up to 256 tokens per rollout batch, vLLM colocate): both tools, or ours alone
TRL="python3 benchmarks/trl_compare.py"
OURS="python3 benchmarks/trl_compare.py --tool ours"
STEADY="--rollout_batches 6 --warmup_batches 2"   # batches 3-6 of 6 (a fresh machine stays slow)
FOUR="--rollout_batches 4"                        # batches 2-4 of 4
B8K="--max_tokens_per_micro_batch 8192"           # ours' micro-batches by an 8k-token budget
BOTH="--offload_ref_model true --recompute_granularity full --recompute_method block \
--recompute_num_layers 21"   # ours at no more memory than TRL's defaults
LEAST="--offload_ref_model true --recompute_granularity full --recompute_method uniform \
--recompute_num_layers 1"    # the least memory at a token budget
REASONING="--completion_length 4096 --variable_length --eos_probability 0.002"  # long tail
TAIL="--tail_logprobs true"   # the reference and old-policy passes in the generation's tail
ASYNC="--async_generate true --sleep_level 0 --rollout_importance_sampling_mode token_truncate"
NO_TP="--tensor_model_parallel_size 1 --sequence_parallel false"
# the trainer of an 8B model alone on one GPU: its optimizer on the CPU (--auto_parallel's choice)
SERVER_8B="--optimizer_cpu_offload true --use_precision_aware_optimizer true \
--max_tokens_per_micro_batch 12288"
# benchmarks/grpo_step.py: `megatron rlhf` steps on a random model of a preset shape
GRPO="python3 benchmarks/grpo_step.py --work_dir /tmp/gpu_bench --steps 4"
# vLLM colocate; CHECKED also checks every weight sync and offloads the optimizer while the
# engine generates (to fit an H100)
VLLM="--use_vllm true --vllm_mode colocate --sleep_level 1"
CHECKED="$VLLM --vllm_gpu_memory_utilization 0.35 --check_weight_sync true --offload_optimizer true"
TORCHRUN2="python3 -m torch.distributed.run --nproc_per_node 2"
TRL_SETTINGS=${TRL_SETTINGS:-defaults fastest}

trl_fastest() {   # TRL's fastest setting's GRPOConfig fields (JSON)
    if [ -n "${TRL_FASTEST:-}" ]; then echo "$TRL_FASTEST"
    elif [ -s "$OUT/trl_fastest.json" ]; then cat "$OUT/trl_fastest.json"
    else echo '{}'; fi
}

trl_workload() {   # $TRL "$@" with TRL's settings; where TRL's fastest setting fails with the
    # sweep's fields (its micro-batches can run out of memory on a larger workload), TRL's
    # fastest once more with gradient checkpointing off alone
    local fastest record status
    fastest=$(trl_fastest) record=$(mktemp)
    $TRL --trl_settings $TRL_SETTINGS --trl_fastest "$fastest" "$@" | tee "$record"
    status=${PIPESTATUS[0]}
    if [ "$fastest" != '{}' ] && grep -q '"name": "failed", "tool": "trl_fastest"' "$record"; then
        echo "trl_workload: TRL's fastest setting failed with $fastest; again with {}"
        $TRL --tool trl --trl_settings fastest --trl_fastest '{}' "$@"
        status=$?
    fi
    rm -f "$record"
    return $status
}

trl_sweep() {   # TRL alone, one run per candidate speed setting (each at most 8 minutes), then
    # the fastest one's fields into $OUT/trl_fastest.json for the later phases
    local cfg
    for cfg in '{}' '{"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4}' \
            '{"per_device_train_batch_size": 32, "gradient_accumulation_steps": 2}' \
            '{"vllm_enable_sleep_mode": false}' '{"torch_compile": true}'; do
        timeout -k 30 480 $TRL --tool trl --trl_settings fastest --trl_fastest "$cfg" $STEADY \
            || echo "trl_fastest_sweep: $cfg failed"
    done
    python3 benchmarks/trl_sweep_pick.py "$OUT/trl_fastest_sweep.log" > "$OUT/trl_fastest.json"
}

grpo_server() {   # one run of ours per argument (its extra flags) in server mode: `megatron
    # rollout` on GPU 1, the trainer on GPU 0; SERVER_PRESET (qwen2.5-1.5b), SERVER_MAX_LEN (the
    # server's --vllm_max_model_len, 1024) and SERVER_ARGS (trl_compare.py's options)
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
        CUDA_VISIBLE_DEVICES=0 $OURS --preset "$preset" $FOUR --work_dir $work ${SERVER_ARGS:-} \
            -- --vllm_mode server --vllm_server_host 127.0.0.1 --vllm_server_port $port $extra \
            || status=1
    done
    kill $pid; wait $pid 2>/dev/null
    return $status
}

matrix_part() {   # tests/gpu/matrix.py's part $1 (matrix_all: every part), its logs packed
    local part=$1; [ "$1" = matrix_all ] && part=all
    python3 tests/gpu/matrix.py --part "$part" --out "$OUT/$1" --cases ${MATRIX_CASES:-} \
        ${MATRIX_ARGS:-}
    local status=$?
    tar czf "$OUT/$1_logs.tgz" -C "$OUT" "$1"
    return $status
}

layers_eager_then_compiled() {   # "$@" with SWIFT_MEGATRON_COMPILE_LAYERS=0, then =1
    local c
    for c in 0 1; do echo "== SWIFT_MEGATRON_COMPILE_LAYERS=$c"
        SWIFT_MEGATRON_COMPILE_LAYERS=$c "$@" || return 1; done
}

two_gpus() { [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; }
cp2() { two_gpus || return 0; $TORCHRUN2 benchmarks/long_context.py --cp 2 "$@"; }

phase() {
    case "$1" in
        # --- "The GPU gate" (tests/gpu/matrix.py) and the GPU tests (tests/gpu/test_*.py)
        matrix|matrix_2gpu|matrix_4gpu|matrix_all|what_trains|matrix_replay|matrix_replay_2gpu) matrix_part "$1" ;;
        gpu_tests)         python3 -m pytest ${GPU_TESTS:-tests/gpu} -q -s ;;
        # --- "GRPO against TRL" (benchmarks/trl_compare.py; trl_sweep_pick.py)
        trl_fastest_sweep) trl_sweep ;;
        trl_both)          trl_workload $STEADY -- $B8K $BOTH ;;
        trl_fast)          TRL_SETTINGS=fastest trl_workload $STEADY --variant 16k="--max_tokens_per_micro_batch 16384" -- $B8K ;;
        trl_reasoning)     trl_workload $STEADY $REASONING --variant tail="$TAIL" --variant async="$ASYNC" -- $B8K $BOTH ;;
        trl_reasoning16k)  TRL_SETTINGS=fastest trl_workload $STEADY ${REASONING/4096/16384} --variant tail="$TAIL" -- $B8K $BOTH ;;
        trl_lora8b)        trl_workload --preset qwen3-8b --lora 16 $STEADY --variant tail="$TAIL" -- $B8K ;;
        trl_vl)            trl_workload --preset qwen2.5-vl-3b $STEADY -- $B8K ;;
        trl_qwen3_5)       trl_workload --preset qwen3.5-9b-4l $STEADY --variant tail="$TAIL" -- $B8K ;;
        trl_qwen3_5_lora)  trl_workload --preset qwen3.5-9b --lora 16 $STEADY --variant tail="$TAIL" -- $B8K ;;
        profile_workload)  SWIFT_MEGATRON_PROFILE=$OUT/profile_${PROFILE_PRESET:-qwen2.5-1.5b} $OURS --preset ${PROFILE_PRESET:-qwen2.5-1.5b} --rollout_batches 3 ${PROFILE_ARGS:-} -- $B8K ${PROFILE_FLAGS:-} ;;
        # --- "Memory and the dry run's estimate" (ours alone)
        head_block)        $OURS $FOUR --variant block="$BOTH" -- $B8K ;;
        head_least)        $OURS $FOUR --variant ref_resident="--offload_ref_model false" -- $B8K $LEAST ;;
        # --- "LoRA against full" (trl_compare.py, lora_step.py)
        lora_train)        $OURS $FOUR --variant lora="--train_type lora" --variant lora_nodrop="--train_type lora --lora_dropout 0" -- $B8K ;;
        tp2_lora_vs_full)  $OURS --nproc 2 $FOUR --variant lora="--train_type lora" -- --tensor_model_parallel_size 2 $B8K ;;
        lora_step)         layers_eager_then_compiled python3 benchmarks/lora_step.py --preset qwen2.5-1.5b ;;
        lora_step_8k)      layers_eager_then_compiled python3 benchmarks/lora_step.py --preset qwen2.5-1.5b --micro_batches 2 --micro_batch 32 ;;
        # --- "Weight sync and the vLLM engine" (sync_split.py, export_speed.py, trl_compare.py, rollout.py, grpo_step.py)
        sync_split)        python3 benchmarks/sync_split.py --presets qwen2.5-1.5b qwen3.5-9b-4l ;;
        export_speed)      python3 benchmarks/export_speed.py && $TORCHRUN2 benchmarks/export_speed.py ;;
        sleep2)            $OURS $FOUR --variant level1="--sleep_level 1" -- $B8K --sleep_level 2 --check_weight_sync true ;;
        rollout)           python3 benchmarks/rollout.py --mode colocate --preset qwen2.5-0.5b --prompts 128 --max_tokens 256 ;;
        tp2_colocate)      NPROC_PER_NODE=2 $GRPO --preset qwen2.5-1.5b --run_name tp2 -- $VLLM --vllm_gpu_memory_utilization 0.3 --tensor_model_parallel_size 2 ;;
        # --- "Server mode and asynchronous generation" (grpo_server: trl_compare.py against `megatron rollout`)
        server_check)      grpo_server "$B8K --check_weight_sync true" ;;
        async_server)      grpo_server "--async_generate false" "--async_generate true" ;;
        async_reasoning)   SERVER_MAX_LEN=4608 SERVER_ARGS="$REASONING" grpo_server "$B8K --async_generate false" "$B8K --async_generate true" ;;
        scale_8b)          $OURS --preset qwen3-8b --nproc 2 $FOUR --variant pp2="$NO_TP --pipeline_model_parallel_size 2 --max_tokens_per_micro_batch 3072" --variant dp2="$NO_TP --offload_optimizer true --max_tokens_per_micro_batch 3072" -- --tensor_model_parallel_size 2 --sequence_parallel true --max_tokens_per_micro_batch 12288 ;;
        scale_8b_server)   SERVER_PRESET=qwen3-8b grpo_server "$SERVER_8B" ;;
        async_8b)          SERVER_PRESET=qwen3-8b SERVER_MAX_LEN=4608 SERVER_ARGS="$REASONING" grpo_server "$SERVER_8B --async_generate false" "$SERVER_8B --async_generate true" ;;
        scale_8b_lora)     for n in 1 2; do $OURS --preset qwen3-8b --lora 16 --nproc $n $FOUR -- $B8K || return 1; done ;;
        auto_grid)         python3 benchmarks/auto_grid.py --preset qwen2.5-1.5b ;;
        auto_grid_qwen3_5) python3 benchmarks/auto_grid.py --preset qwen3.5-9b-4l ;;
        auto_grid_8b)      python3 benchmarks/auto_grid.py --preset qwen3-8b --lora 16 ;;
        auto_grid_2gpu)    for preset in qwen2.5-1.5b qwen3-8b; do python3 benchmarks/auto_grid.py --preset $preset --nproc 2 || return 1; done ;;
        # --- "Multi-turn"
        multi_turn)        $OURS --rollout_batches 3 --variable_length --eos_context grid_world -- --multi_turn_scheduler gym_scheduler --gym_env grid_world --max_turns 3 --use_gym_env true ;;
        # --- "Qwen3.5, MoE and vision-language models with vLLM" (grpo_step.py, moe_numerics.py)
        qwen3_5_vllm)      $GRPO --preset qwen3.5-9b-4l --run_name qwen3_5_vllm -- $CHECKED --torch_dtype bfloat16 ;;
        qwen3_5_moe_vllm)  $GRPO --preset qwen3.5-moe-8l --run_name qwen3_5_moe_vllm -- $CHECKED --torch_dtype bfloat16 --check_weight_sync_atol 0.5 ;;
        moe_ep2)           NPROC_PER_NODE=2 $GRPO --preset qwen3.5-moe-8l --run_name moe_ep2 -- $CHECKED --torch_dtype bfloat16 --check_weight_sync_atol 0.5 --expert_model_parallel_size 2 ;;
        vl_grpo)           $GRPO --preset qwen2.5-vl-3b --run_name vl_grpo -- $CHECKED --micro_batch_size 2 ;;
        moe_numerics)      python3 benchmarks/moe_numerics.py --device cuda --hidden_size 2048 ;;
        moe_layer)         python3 benchmarks/moe_layer.py --preset qwen3-30b-a3b-8l qwen3.5-35b-a3b-8l qwen2.5-1.5b --variants megatron grouped --profile ;;
        # --- "Long sequences and context parallelism" (long_context.py; CP=2 on 2 GPUs)
        long_context)      python3 benchmarks/long_context.py --seq 16384 && cp2 --seq 16384 && cp2 --seq 32768 ;;
        long_recompute)    python3 benchmarks/long_context.py --seq 32768 --recompute full && cp2 --seq 32768 --recompute full ;;
        # --- "Kernels and single-step benchmarks"
        compiled_layers)   layers_eager_then_compiled $OURS $STEADY -- $B8K $BOTH ;;
        logprobs_kernel)   python3 benchmarks/logprobs_kernel.py ;;
        layer_time)        for seq in 1024 4096; do python3 benchmarks/layer_time.py --preset qwen3.5-9b-4l --seq $seq || return 1; done ;;
        convert)           python3 benchmarks/convert.py --preset 1.5b --device cuda --dtype bfloat16 ;;
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
