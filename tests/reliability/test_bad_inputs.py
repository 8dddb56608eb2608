"""A corpus of bad inputs to the command line (flags, model directories, datasets, plugins,
checkpoints, output directories that cannot be written or belong to another run): each must end
with exit code 2, a message naming the culprit, no traceback, and nothing written. The commands
run in this process (`cli.main.main`) with `--dry_run true`, which
runs every check that needs no weights, so the corpus costs seconds. Damaged checkpoints are
also refused by real runs (the same plan_start call, tests/unit/test_checkpoint_integrity.py);
the server's bad requests are in tests/vllm/test_server.py; full disks, file size limits and
kills during a run are test_faults.py's.

Placeholders in a case: MODEL (a tiny qwen3), VL_MODEL (a tiny qwen2.5-vl), DATA (a 64-row math
jsonl), and the names of the bad artefacts the `bad` fixture builds (BAD_..., UNWRITABLE,
LOCKED_RUN: a run directory this process holds the lock of)."""
import contextlib
import json
import os
import re
import shutil
import warnings

import pytest
import torch

from swift_megatron.cli.main import main

GOOD = ["--model", "MODEL", "--dataset", "DATA", "--reward_funcs", "accuracy",
        "--num_generations", "4", "--global_batch_size", "16", "--micro_batch_size", "4",
        "--output_dir", "OUT", "--dry_run", "true"]


def case(flags, culprit, command="rlhf", base=True):
    return pytest.param(command, flags, culprit, base, id=f"{command}:{' '.join(flags)[:60]}")


FLAGS = [   # values and combinations refused at parse time
    case(["--lr", "-1"], "--lr must be > 0"),
    case(["--lr", "nan"], "--lr"),
    case(["--lr", "inf"], "--lr"),
    case(["--lr", "abc"], "--lr"),
    case(["--min_lr", "1e-3", "--lr", "1e-5"], "--min_lr"),
    case(["--adam_beta1", "1.5"], "--adam_beta1 must be in [0, 1)"),
    case(["--adam_beta2", "-0.1"], "--adam_beta2"),
    case(["--weight_decay", "-5"], "--weight_decay must be >= 0"),
    case(["--clip_grad", "-1"], "--clip_grad must be >= 0"),
    case(["--lr_warmup_iters", "-3"], "--lr_warmup_iters must be >= 0"),
    case(["--max_skipped_steps", "-1"], "--max_skipped_steps must be >= 0"),
    case(["--beta", "nan"], "--beta"),
    case(["--temperature", "nan"], "--temperature"),
    case(["--repetition_penalty", "-1"], "--repetition_penalty"),
    case(["--top_p", "0"], "--top_p"),
    case(["--top_p", "1.5"], "--top_p"),
    case(["--num_generations", "0"], "--num_generations"),
    case(["--micro_batch_size", "0"], "micro_batch_size"),
    case(["--global_batch_size", "15"], "global_batch_size"),
    case(["--max_completion_length", "0"], "--max_completion_length"),
    case(["--lr_decay_style", "zigzag"], "--lr_decay_style"),
    case(["--loss_type", "nope"], "--loss_type"),
    case(["--train_type", "qlora"], "--train_type"),
    case(["--torch_dtype", "float8"], "--torch_dtype"),
    case(["--vllm_mode", "remote"], "--vllm_mode"),
    case(["--sleep_level", "3"], "--sleep_level"),
    case(["--report_to", "mlflow"], "--report_to"),
    case(["--lora_rank", "0"], "--lora_rank must be >= 1"),
    case(["--lora_dropout", "1.5"], "--lora_dropout"),
    case(["--save_total_limit", "1"], "--save_total_limit must be >= 2"),
    case(["--optimizer_offload_fraction", "2"], "--optimizer_offload_fraction"),
    case(["--moe_expert_capacity_factor", "-1"], "--moe_expert_capacity_factor"),
    case(["--vllm_server_port", "70000"], "--vllm_server_port"),
    case(["--tensor_model_parallel_size", "0"], "tensor_model_parallel_size"),
    case(["--steps_per_generation", "0"], "steps_per_generation"),
    case(["--num_iterations", "0"], "--num_iterations"),
    case(["--epsilon", "-0.2"], "--epsilon"),
    case(["--bf16", "true", "--fp16", "true"], "--fp16"),
    case(["--adapters", "a", "b"], "--adapters takes one adapter directory"),
    case(["--no_such_flag", "1"], "--no_such_flag"),
    case(["--lrr", "1e-5"], "--lrr"),
    case(["--save_steps", "0"], "--save_steps"),
    case(["--finetune", "maybe"], "--finetune"),
    case(["--rlhf_type", "dpo"], "--rlhf_type"),
    case(["--reward_error_policy", "ignore"], "--reward_error_policy"),
    case(["--optimizer_cpu_offload", "true"], "--use_precision_aware_optimizer"),
    case(["--load", "BAD_SAVE_GARBAGE_LATEST", "--mcore_model", "MODEL"], "not both"),
    case(["--context_parallel_size", "2"], "context"),
    case(["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_port", "1", "2"],
         "--vllm_server_port"),
    case(["--max_length", "-5"], "--max_length"),
    case(["--seed", "x"], "--seed"),
    case(["--vit_lr", "0", "--freeze_vit", "false"], "--vit_lr must be > 0"),
    case(["--vit_lr", "1e-5"], "--vit_lr sets the learning rate of the vision tower, which "
                               "--freeze_vit true"),
    case(["--aligner_lr", "1e-5", "--train_type", "lora"], "--aligner_lr: --train_type lora "
                                                           "freezes the aligner"),
    case(["--vit_lr", "1e-5", "--freeze_vit", "false"], "--vit_lr applies to vision-language "
                                                        "models; this qwen3 model"),
    case(["--tuner_type", "lora_llm"], "--train_type lora_llm applies to vision-language models; "
                                       "this qwen3 model has no vision tower: use --train_type "
                                       "lora"),
    case(["--tuner_type", "lora_llm", "--adapters", "BAD_EMPTY_DIR"],
         "--train_type lora_llm cannot continue from --adapters/--mcore_adapter"),
    case(["--tuner_type", "lora_llm", "--merge_lora", "false"],
         "--train_type lora_llm needs --merge_lora true"),
    # issue 40's re-run of the corpus: silent before
    case(["--lora_alpha", "-32", "--train_type", "lora"], "--lora_alpha must be > 0"),
    case(["--max_resample_times", "-1", "--dynamic_sample", "true"],
         "--max_resample_times must be >= 0"),
    case(["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_api_key", ""],
         "--vllm_server_api_key is empty: that would turn authentication off"),
    # issue 57: a traceback, or accepted silently, before
    case(["--seed", "18446744073709551616"], "--seed must be in [0, 4294967295]"),
    case(["--seed", "-1"], "--seed must be in [0, 4294967295]"),
    case(["--data_seed", "4294967296"], "--data_seed must be in [0, 4294967295]"),
    case(["--output_dir", ""], "--output_dir got an empty value; give a path"),
    case(["--save", " "], "--save got an empty value"),
    case(["--model", ""], "--model got an empty value"),
    case(["--use_vllm", "true", "--max_length", "1000000"],
         "--max_length 1000000 exceeds the model's context, max_position_embeddings 512"),
    case(["--use_vllm", "true", "--vllm_max_model_len", "4096"],
         "--vllm_max_model_len 4096 exceeds the model's context"),
]

FILES = [   # model directories, datasets, plugins, system prompts
    case(["--model", "BAD_MISSING_DIR"], "BAD_MISSING_DIR"),
    case(["--model", "BAD_NO_CONFIG"], "BAD_NO_CONFIG"),
    case(["--model", "BAD_GPT2"], "model_type 'gpt2' is not supported"),
    case(["--model", "BAD_TRUNCATED_WEIGHTS"], "model.safetensors: truncated"),
    case(["--model", "BAD_GARBAGE_WEIGHTS"], "model.safetensors"),
    case(["--model", "BAD_CONFIG_JSON"], "config.json"),
    case(["--dataset", "BAD_MISSING_DATA.jsonl"], "BAD_MISSING_DATA.jsonl"),
    case(["--dataset", "DATA#abc"], "the 'abc' after '#' must be a whole number of rows"),
    case(["--output_dir", "BAD_TEXT.txt"], "--output_dir BAD_TEXT.txt is a file, not a directory"),
    case(["--save", "BAD_TEXT.txt/ckpt"], "lies under BAD_TEXT.txt, which is a file"),
    # issue 57: a FileNotFoundError traceback once the model was built
    case(["--output_dir", "UNWRITABLE/out"], "--output_dir UNWRITABLE/out cannot be created: "
                                             "UNWRITABLE takes no new files"),
    case(["--save", "UNWRITABLE/ckpt"], "--save UNWRITABLE/ckpt cannot be created"),
    case(["--dataset", "DATA#-3"], "the '-3' after '#' must be a whole number of rows"),
    case(["--dataset", "BAD_NOT_UTF8.jsonl"], "line 2: not UTF-8 text"),
    case(["--dataset", "BAD_NOT_JSON.jsonl"], "line 1: not valid JSON"),
    case(["--dataset", "BAD_LIST_LINE.jsonl"], "each line must be a JSON object"),
    case(["--dataset", "BAD_NO_PROMPT.jsonl"], "BAD_NO_PROMPT.jsonl"),
    case(["--dataset", "BAD_EMPTY.jsonl"], "BAD_EMPTY.jsonl"),
    case(["--dataset", "BAD_TEXT.txt"], "unsupported file type '.txt'"),
    case(["--dataset", "BAD_NOT_JSON.json"], "not valid JSON"),
    case(["--dataset", "BAD_SCALAR.json"], "a .json dataset must be a list of objects"),
    case(["--dataset", "DATA", "--val_dataset", "BAD_NOT_UTF8.jsonl"], "not UTF-8 text"),
    case(["--columns", '{"question": "query"}'], "--columns renames 'question', which no row of "
                                                 "--dataset DATA has; its columns: 'messages', "
                                                 "'solution'"),
    case(["--dataset", "BAD_EMPTY_PROMPT.jsonl"], "BAD_EMPTY_PROMPT.jsonl row 2: its prompt is "
                                                  "empty"),
    case(["--dataset", "BAD_EMPTY_QUERY.jsonl"], "BAD_EMPTY_QUERY.jsonl row 1: its prompt is "
                                                 "empty: the last user message has no text "
                                                 "(from 'query')"),
    case(["--external_plugins", "BAD_SYNTAX.py"], "BAD_SYNTAX.py"),
    case(["--external_plugins", "BAD_MISSING_PLUGIN.py"], "BAD_MISSING_PLUGIN.py"),
    case(["--external_plugins", "BAD_IMPORT.py"], "BAD_IMPORT.py"),
    case(["--reward_funcs", "no_such_reward"], "no_such_reward"),
    case(["--reward_funcs", "accuracyy"], "accuracyy"),
    case(["--system", "BAD_MISSING_SYSTEM.txt"], "BAD_MISSING_SYSTEM.txt"),
    # issue 40: a bad image of a row was met only by the run's prompt building, not the dry run
    case(["--model", "VL_MODEL", "--dataset", "BAD_IMAGE_MISSING.jsonl"],
         "BAD_IMAGE_MISSING.jsonl row 2: image 'BAD_MISSING_IMAGE.png' does not exist"),
    case(["--model", "VL_MODEL", "--dataset", "BAD_IMAGE_NOT_IMAGE.jsonl"],
         "BAD_IMAGE_NOT_IMAGE.jsonl row 2: image BAD_TEXT.txt is unreadable: cannot identify"),
    case(["--model", "VL_MODEL", "--dataset", "BAD_IMAGE_TRUNCATED.jsonl"],
         "BAD_IMAGE_TRUNCATED.jsonl row 2: image BAD_TRUNCATED_IMAGE.png is unreadable"),
    case(["--model", "VL_MODEL", "--dataset", "BAD_IMAGE_TYPE.jsonl"],
         "BAD_IMAGE_TYPE.jsonl row 2: an image must be a path, bytes or a PIL image, got int"),
]

CHECKPOINTS = [   # --load / --mcore_model / --mcore_adapter / --adapters
    case(["--load", "BAD_SAVE_GARBAGE_LATEST"], "latest_checkpointed_iteration.txt: expected an "
                                                "iteration number"),
    case(["--load", "BAD_SAVE_MISSING_ITER"], "BAD_SAVE_MISSING_ITER"),
    case(["--load", "BAD_CKPT_STATE"], "trainer_state.json: not valid JSON"),
    case(["--load", "BAD_CKPT_META"], "swift_megatron.json: not valid JSON"),
    case(["--load", "BAD_CKPT_MODEL_SHARD"], "model/__0_0.distcp: truncated"),
    case(["--load", "BAD_CKPT_OPTIM_SHARD"], "optimizer/__0_0.distcp: truncated"),
    case(["--load", "BAD_CKPT_OPTIM_METADATA"], "optimizer/.metadata: unreadable"),
    case(["--load", "BAD_CKPT_RNG"], "rng/rank0.pt: not a readable torch.save file"),
    case(["--load", "BAD_CKPT_COMMON"], "model/common.pt: not a readable torch.save file"),
    case(["--load", "BAD_CKPT_MISSING_SHARD"], "model/__0_0.distcp: missing"),
    case(["--load", "BAD_CKPT_OTHER_LAYOUT"], "was saved with --tensor_model_parallel_size 2 "
                                              "(this run: 1)"),
    case(["--load", "CKPT_AT_STEP_2", "--train_iters", "1"], "CKPT_AT_STEP_2/iter_0000002 is at "
                                                           "step 2, beyond this run's 1 optimizer "
                                                           "steps"),
    case(["--load", "BAD_MISSING_DIR"], "--load BAD_MISSING_DIR: no such directory"),
    case(["--load", "BAD_EMPTY_DIR"], "--load BAD_EMPTY_DIR: neither a save directory"),
    case(["--mcore_model", "BAD_MISSING_DIR"], "--mcore_model BAD_MISSING_DIR: no such directory"),
    case(["--mcore_model", "BAD_EMPTY_DIR"], "--mcore_model BAD_EMPTY_DIR is not a swift-megatron "
                                             "model directory"),
    case(["--mcore_model", "BAD_CKPT_MODEL_SHARD"], "model/__0_0.distcp: truncated"),
    case(["--mcore_adapter", "BAD_EMPTY_DIR"], "--mcore_adapter BAD_EMPTY_DIR: not a PEFT adapter"),
    case(["--adapters", "BAD_MISSING_DIR"], "--adapters BAD_MISSING_DIR: no such directory"),
    case(["--adapters", "BAD_EMPTY_DIR"], "--adapters BAD_EMPTY_DIR: not a PEFT adapter"),
    case(["--adapters", "BAD_EMPTY_DIR", "--mcore_adapter", "BAD_EMPTY_DIR"], "not both"),
    case(["--mcore_ref_model", "BAD_MISSING_DIR", "--beta", "0.1"],
         "--mcore_ref_model BAD_MISSING_DIR: no such directory"),
    case(["--ref_model", "./no/such/dir", "--beta", "0.1"],
         "--ref_model ./no/such/dir: no such directory"),
    case(["--ref_adapters", "BAD_EMPTY_DIR", "--beta", "0.1"],
         "--ref_adapters BAD_EMPTY_DIR: not a PEFT adapter"),
]

RUN_DIRS = [   # issue 57: a directory holding another run, or one a live run holds
    case(["--output_dir", "BAD_FINISHED_RUN", "--add_version", "false"],
         "--output_dir BAD_FINISHED_RUN holds another run (logging.jsonl, iter_0000004, "
         "best_checkpoint.json, latest_checkpointed_iteration.txt): pass a new --output_dir, or "
         "--add_version true (each run in a new v<N>-<time> subdirectory), or --load "
         "BAD_FINISHED_RUN to resume that run"),
    case(["--output_dir", "BAD_LOGS_ONLY", "--add_version", "false"],
         "--output_dir BAD_LOGS_ONLY holds another run (logging.jsonl): pass a new --output_dir, "
         "or --add_version true (each run in a new v<N>-<time> subdirectory), or remove them "
         "(that run saved no checkpoint to resume)"),
    case(["--save", "CKPT_AT_STEP_2"], "--save CKPT_AT_STEP_2 holds another run (iter_0000002, "
                                       "latest_checkpointed_iteration.txt): pass a new --save, or "
                                       "--load CKPT_AT_STEP_2 to resume that run"),
    # --finetune true (the default) loads the weights only: a new run, not a resume
    case(["--mcore_model", "CKPT_AT_STEP_2", "--save", "CKPT_AT_STEP_2"],
         "--save CKPT_AT_STEP_2 holds another run"),
    case(["--output_dir", "LOCKED_RUN", "--add_version", "false"],
         "--output_dir LOCKED_RUN is in use by a run that is still going (pid "),
    case(["--save", "LOCKED_RUN"], "--save LOCKED_RUN is in use by a run that is still going"),
]

EXPORT = [   # megatron export
    case(["--model", "MODEL", "--to_mcore", "true", "--output_dir", "BAD_TEXT.txt"],
         "--output_dir BAD_TEXT.txt is a file, not a directory", "export", base=False),
    case(["--model", "MODEL", "--to_mcore", "true", "--output_dir", "UNWRITABLE/mcore"],
         "--output_dir UNWRITABLE/mcore cannot be created", "export", base=False),
    case(["--model", "BAD_GPT2", "--to_mcore", "true", "--output_dir", "OUT"],
         "model_type 'gpt2' is not supported", "export", base=False),
    case(["--model", "BAD_MISSING_DIR", "--to_mcore", "true", "--output_dir", "OUT"],
         "BAD_MISSING_DIR", "export", base=False),
    case(["--mcore_model", "BAD_EMPTY_DIR", "--to_hf", "true", "--output_dir", "OUT"],
         "BAD_EMPTY_DIR", "export", base=False),
    # issue 40: a bare EOFError from deep in the loader (the file check covered --load only)
    case(["--mcore_model", "BAD_CKPT_MODEL_SHARD", "--to_hf", "true", "--output_dir", "OUT"],
         "model/__0_0.distcp: truncated", "export", base=False),
    case(["--mcore_model", "BAD_CKPT_OPTIM_METADATA", "--to_hf", "true", "--output_dir", "OUT"],
         "optimizer/.metadata: unreadable", "export", base=False),
    case(["--model", "MODEL", "--output_dir", "OUT"], "--to_hf", "export", base=False),
    case(["--model", "MODEL", "--to_mcore", "true", "--output_dir", ""],   # issue 57
         "--output_dir got an empty value", "export", base=False),
    case(["--model", "MODEL", "--to_hf", "true", "--to_mcore", "true", "--output_dir", "OUT"],
         "--to_mcore", "export", base=False),
    case(["--model", "MODEL", "--to_mcore", "true", "--output_dir", "OUT", "--test_convert_dtype",
          "int3"], "--test_convert_dtype", "export", base=False),
    case(["--model", "MODEL", "--to_mcore", "true", "--output_dir", "OUT", "--bogus", "1"],
         "--bogus", "export", base=False),
    case(["--adapters", "BAD_EMPTY_DIR", "--model", "MODEL", "--to_hf", "true", "--output_dir",
          "OUT"], "BAD_EMPTY_DIR", "export", base=False),
]

ROLLOUT = [   # megatron rollout (refused before any engine starts)
    case(["--model", "BAD_MISSING_DIR"], "BAD_MISSING_DIR", "rollout", base=False),
    case(["--model", "MODEL", "--port", "0"], "--port must be in 1..65535", "rollout", base=False),
    case(["--model", "MODEL", "--api_key", " "], "--api_key is empty", "rollout", base=False),
    case(["--model", "MODEL", "--multi_turn_scheduler", "nope"],   # issue 40: after vLLM started
         "--multi_turn_scheduler: unknown multi-turn scheduler 'nope'", "rollout", base=False),
    case(["--model", "MODEL", "--multi_turn_scheduler", "gym_scheduler", "--gym_env", "nope"],
         "--gym_env: unknown gym env 'nope'", "rollout", base=False),
    case(["--model", "MODEL", "--vllm_data_parallel_size", "0"], "--vllm_data_parallel_size",
         "rollout", base=False),
    case(["--model", "MODEL", "--vllm_gpu_memory_utilization", "1.5"],
         "--vllm_gpu_memory_utilization", "rollout", base=False),
    case(["--model", "MODEL", "--vllm_max_model_len", "1"], "--vllm_max_model_len", "rollout",
         base=False),
    case(["--model", "MODEL", "--vllm_engine_kwargs", "{oops"], "--vllm_engine_kwargs",
         "rollout", base=False),
    case(["--model", "MODEL", "--unknown_rollout_flag", "x"], "--unknown_rollout_flag", "rollout",
         base=False),
    # issue 57: without --multi_turn_scheduler the server never imported the file
    case(["--model", "MODEL", "--external_plugins", "BAD_IMPORT.py"], "BAD_IMPORT.py", "rollout",
         base=False),
    case(["--model", "MODEL", "--external_plugins", "BAD_MISSING_PLUGIN.py"],
         "BAD_MISSING_PLUGIN.py", "rollout", base=False),
]

COMMANDS = [
    case([], "megatron: unknown command 'rlhff'", "rlhff", base=False),
    case(["--config", "BAD_MISSING_CONFIG.yaml"], "BAD_MISSING_CONFIG.yaml"),
    case(["--config", "BAD_CONFIG.yaml"], "BAD_CONFIG.yaml"),
    case(["--config", "BAD_CONFIG_UNKNOWN_FLAG.yaml"], "not_a_flag"),
    # issue 57: the last value, or the second file, won silently
    case(["--config", "BAD_CONFIG_DUPLICATE.yaml"], "config file BAD_CONFIG_DUPLICATE.yaml: key "
                                                    "'lr' is given twice (again on line 3)"),
    case(["--config", "BAD_CONFIG_DUPLICATE.json"], "key 'seed' is given twice"),
    case(["--config", "BAD_CONFIG_ALIAS.yaml"], "keys save_steps and save_interval both set "
                                                "--save_steps"),
    case(["BAD_CONFIG_GOOD.yaml", *GOOD, "--config", "BAD_CONFIG_GOOD.yaml"],
         "two config files, BAD_CONFIG_GOOD.yaml (the first argument) and --config "
         "BAD_CONFIG_GOOD.yaml: give one", base=False),
]

ALL = FLAGS + FILES + CHECKPOINTS + RUN_DIRS + EXPORT + ROLLOUT + COMMANDS


def _dcp_checkpoint(root) -> str:
    """A save directory laid out as ours: iter_0000002/ with JSON files, torch distributed
    checkpoints (model/, optimizer/) and RNG files."""
    import torch.distributed.checkpoint as dcp

    iteration = root / "iter_0000002"
    for name in ("model", "optimizer"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.arange(2048.0)}, storage_writer=dcp.FileSystemWriter(
                str(iteration / name)))
        torch.save({"version": 1}, iteration / name / "common.pt")
    os.makedirs(iteration / "rng")
    torch.save({"cpu": torch.get_rng_state()}, iteration / "rng" / "rank0.pt")
    (iteration / "swift_megatron.json").write_text(json.dumps({"model_type": "qwen3"}))
    (iteration / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    return str(root)


@pytest.fixture(scope="module")
def bad(tiny_model_dir, tmp_path_factory):
    """{placeholder: path} of every bad artefact."""
    root = tmp_path_factory.mktemp("bad")
    model = tiny_model_dir("qwen3")
    paths = {"MODEL": model, "BAD_MISSING_DIR": str(root / "missing")}

    def model_copy(name, edit):
        target = root / name
        shutil.copytree(model, target)
        edit(target)
        paths[name] = str(target)

    model_copy("BAD_NO_CONFIG", lambda d: os.remove(d / "config.json"))
    model_copy("BAD_GPT2", lambda d: (d / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 504})))
    model_copy("BAD_TRUNCATED_WEIGHTS", lambda d: os.truncate(
        d / "model.safetensors", os.path.getsize(d / "model.safetensors") // 2))
    model_copy("BAD_GARBAGE_WEIGHTS", lambda d: (d / "model.safetensors").write_bytes(b"x" * 64))
    model_copy("BAD_CONFIG_JSON", lambda d: (d / "config.json").write_text('{"model_type": '))
    rows = [json.loads(line) for line in open(paths.setdefault("DATA", _data(root)))]
    files = {
        "BAD_NOT_UTF8.jsonl": json.dumps(rows[0]).encode() + b'\n{"messages": "caf\xe9"}\n',
        "BAD_NOT_JSON.jsonl": b"{oops\n",
        "BAD_EMPTY_PROMPT.jsonl": json.dumps(rows[0]).encode() + b'\n{"messages": [{"role": '
                                  b'"user", "content": " "}], "solution": "1"}\n',
        "BAD_EMPTY_QUERY.jsonl": b'{"query": "", "solution": "1"}\n',
        "BAD_LIST_LINE.jsonl": b"[1, 2]\n",
        "BAD_NO_PROMPT.jsonl": b'{"solution": "1"}\n{"solution": "2"}\n',
        "BAD_EMPTY.jsonl": b"",
        "BAD_TEXT.txt": b"hello\n",
        "BAD_NOT_JSON.json": b"[{",
        "BAD_SCALAR.json": b"42",
        "BAD_SYNTAX.py": b"def broken(:\n",
        "BAD_IMPORT.py": b"import no_such_module_here\n",
        "BAD_CONFIG.yaml": b"model: [unclosed\n",
        "BAD_CONFIG_UNKNOWN_FLAG.yaml": b"not_a_flag: 1\n",
        "BAD_CONFIG_DUPLICATE.yaml": b"lr: 1.0e-5\nseed: 3\nlr: 2.0e-5\n",
        "BAD_CONFIG_DUPLICATE.json": b'{"seed": 1, "seed": 2}',
        "BAD_CONFIG_ALIAS.yaml": b"save_steps: 3\nsave_interval: 4\n",
        "BAD_CONFIG_GOOD.yaml": b"seed: 3\n",
    }
    for name, content in files.items():
        (root / name).write_bytes(content)
        paths[name] = str(root / name)
    for name in ("BAD_MISSING_DATA.jsonl", "BAD_MISSING_PLUGIN.py", "BAD_MISSING_SYSTEM.txt",
                 "BAD_MISSING_CONFIG.yaml"):
        paths[name] = str(root / name)
    paths["VL_MODEL"] = tiny_model_dir("qwen2_5_vl")
    _image_datasets(root, paths)
    os.makedirs(root / "BAD_EMPTY_DIR")
    paths["BAD_EMPTY_DIR"] = str(root / "BAD_EMPTY_DIR")
    intact = paths["CKPT_AT_STEP_2"] = _dcp_checkpoint(root / "intact")

    def checkpoint_copy(name, edit):
        target = root / name
        shutil.copytree(intact, target)
        edit(target / "iter_0000002")
        paths[name] = str(target)

    checkpoint_copy("BAD_SAVE_GARBAGE_LATEST", lambda it: (
        it.parent / "latest_checkpointed_iteration.txt").write_text("abc"))
    checkpoint_copy("BAD_SAVE_MISSING_ITER", lambda it: (
        it.parent / "latest_checkpointed_iteration.txt").write_text("7"))
    checkpoint_copy("BAD_CKPT_STATE", lambda it: os.truncate(it / "trainer_state.json", 4))
    checkpoint_copy("BAD_CKPT_META", lambda it: (it / "swift_megatron.json").write_text("{"))
    checkpoint_copy("BAD_CKPT_MODEL_SHARD", lambda it: os.truncate(it / "model" / "__0_0.distcp", 9))
    checkpoint_copy("BAD_CKPT_OPTIM_SHARD", lambda it: os.truncate(
        it / "optimizer" / "__0_0.distcp", 0))
    checkpoint_copy("BAD_CKPT_OPTIM_METADATA", lambda it: os.truncate(
        it / "optimizer" / ".metadata", 20))
    checkpoint_copy("BAD_CKPT_RNG", lambda it: (it / "rng" / "rank0.pt").write_bytes(b"junk"))
    checkpoint_copy("BAD_CKPT_COMMON", lambda it: os.truncate(it / "model" / "common.pt", 30))
    checkpoint_copy("BAD_CKPT_MISSING_SHARD", lambda it: os.remove(it / "model" / "__0_0.distcp"))
    checkpoint_copy("BAD_CKPT_OTHER_LAYOUT", lambda it: (it / "swift_megatron.json").write_text(
        json.dumps({"model_type": "qwen3", "saved_with": {"tp": 2, "pp": 1, "ep": 1, "etp": 2}})))
    paths["UNWRITABLE"] = _unwritable(root)
    paths["BAD_FINISHED_RUN"] = _finished_run(root / "BAD_FINISHED_RUN")
    paths["BAD_LOGS_ONLY"] = _finished_run(root / "BAD_LOGS_ONLY", checkpoint=False)
    with _locked_run(root / "LOCKED_RUN") as paths["LOCKED_RUN"]:
        yield paths, root


def _unwritable(root) -> str:
    """A directory no file can be created in: mode 555 for an ordinary user; for root (whom
    modes do not stop) /sys, where the kernel refuses new files."""
    if os.geteuid() == 0:
        return "/sys"
    path = root / "BAD_READ_ONLY"
    path.mkdir(mode=0o555)
    return str(path)


def _finished_run(path, checkpoint=True) -> str:
    """The output directory of a run: its args and logs, with a checkpoint or without."""
    path.mkdir()
    for name in ("logging.jsonl", "args.json"):
        (path / name).write_text('{"step": 4}\n')
    if checkpoint:
        (path / "iter_0000004").mkdir()
        (path / "latest_checkpointed_iteration.txt").write_text("4")
        (path / "best_checkpoint.json").write_text('{"step": 4, "reward": 0.5}')
    return str(path)


@contextlib.contextmanager
def _locked_run(path):
    """A run directory whose lock a live process (this one) holds."""
    from swift_megatron.checkpoint.run_dir import RunLock

    path.mkdir()
    lock = RunLock()
    lock.take(str(path), "--output_dir")
    try:
        yield str(path)
    finally:
        lock.release()


def _image_datasets(root, paths) -> None:
    """BAD_IMAGE_*.jsonl: a good image row, then one whose image is missing, not an image
    (BAD_TEXT.txt), a truncated PNG or a number."""
    from PIL import Image

    good, truncated = root / "red.png", root / "BAD_TRUNCATED_IMAGE.png"
    Image.new("RGB", (32, 32), (255, 0, 0)).save(good)
    truncated.write_bytes(good.read_bytes()[:40])
    paths.update({"BAD_MISSING_IMAGE.png": str(root / "BAD_MISSING_IMAGE.png"),
                  "BAD_TRUNCATED_IMAGE.png": str(truncated)})
    bad = {"MISSING": paths["BAD_MISSING_IMAGE.png"], "NOT_IMAGE": paths["BAD_TEXT.txt"],
           "TRUNCATED": str(truncated), "TYPE": 42}
    for name, image in bad.items():
        rows = [{"images": [value], "messages": [{"role": "user", "content": "Colour?"}],
                 "solution": "red"} for value in (str(good), image)]
        path = paths[f"BAD_IMAGE_{name}.jsonl"] = str(root / f"BAD_IMAGE_{name}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def _data(root) -> str:
    from swift_megatron.fixtures import build_math_dataset

    return build_math_dataset(str(root / "math.jsonl"), num_rows=64)


def _fill(argv, paths, out):
    return [out if a == "OUT" else _fill_text(a, paths) for a in argv]


def _fill_text(text, paths):
    return re.sub(r"[A-Z][A-Z0-9_]*(\.[a-z]+)?", lambda m: paths.get(m.group(0), m.group(0)), text)


@pytest.mark.parametrize("command, flags, culprit, base", ALL)
def test_bad_input_exits_2_naming_the_culprit(bad, tmp_path, capsys, monkeypatch, command,
                                               flags, culprit, base):
    paths, _ = bad
    out = str(tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    argv = [command] + _fill((GOOD if base else []) + flags, paths, out)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    printed = capsys.readouterr()
    assert exit_info.value.code == 2, (argv, printed.out[-2000:], printed.err[-2000:])
    assert "Traceback" not in printed.err + printed.out
    assert _fill_text(culprit, paths) in printed.err, (argv, printed.err[-2000:])
    assert not os.path.exists(out), "a refused command wrote its output directory"
    assert sorted(os.listdir(tmp_path)) == [], "a refused command left files behind"


@pytest.mark.parametrize("command, flags", [
    ("rollout", ["--model", "MODEL"]),
    ("rlhf", GOOD + ["--use_vllm", "true", "--vllm_mode", "server"]),
])
def test_an_empty_api_key_variable_is_refused(bad, tmp_path, capsys, monkeypatch, command, flags):
    """issue 57: SWIFT_MEGATRON_ROLLOUT_API_KEY= (set, empty) started a server without
    authentication, silently (the flag form was refused already); a colocate trainer, which
    reads no key, is not refused for it."""
    paths, _ = bad
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SWIFT_MEGATRON_ROLLOUT_API_KEY", " ")
    with pytest.raises(SystemExit) as exit_info:
        main([command] + _fill(flags, paths, str(tmp_path / "out")))
    printed = capsys.readouterr()
    assert exit_info.value.code == 2 and "Traceback" not in printed.err
    assert "$SWIFT_MEGATRON_ROLLOUT_API_KEY is set but empty: that would turn authentication " \
           "off" in printed.err
    with pytest.raises(SystemExit) as exit_info:
        main(["rlhf"] + _fill(GOOD, paths, str(tmp_path / "out")))
    assert exit_info.value.code == 0, capsys.readouterr().err[-2000:]


def test_the_corpus_is_large_enough():
    assert len(ALL) >= 100   # with the server's bad requests (tests/vllm/test_server.py): more
