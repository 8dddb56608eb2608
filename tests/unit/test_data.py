"""The prompt pipeline: every source format, `:N` limits, hub ids (monkeypatched, no network),
rows -> ChatML prompts with the fixtures tokenizer, bad-row errors, left truncation, validation
split, and the sampler's epochs, DP shares and resume."""
import copy
import json
import logging
import shutil
import sys
from types import SimpleNamespace

import pandas as pd
import numpy as np
import pytest

from swift_megatron.data import (Prompt, PromptSampler, PromptSettings, build_prompts,
                                 load_prompts, load_rows, max_prompt_length, prepare_prompts,
                                 split_validation)
from swift_megatron.data import parse_spec as parse_data_spec
from swift_megatron.data import prompts as prompts_module
from swift_megatron.errors import UserError
from swift_megatron.fixtures import build_math_dataset, load_tokenizer

ROWS = [{"query": "What is 1 + 2?", "solution": "3"},
        {"query": "What is 4 - 1?", "solution": "3"},
        {"query": "What is 2 + 2?", "solution": "4"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def chatml(*turns):
    """The fixtures' ChatML for (role, content) turns plus the generation prompt."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + \
        "<|im_start|>assistant\n"


def one(row, tok, **kwargs):
    kwargs.setdefault("max_prompt_length", 1000)
    return build_prompts([row], tok, PromptSettings(**kwargs))[0]


def settings(max_prompt_length, **kwargs):
    return PromptSettings(max_prompt_length, **kwargs)


# ---------------------------------------------------------------------------------------------
# Sources: files and directories


def test_jsonl(tmp_path):
    assert load_rows(write_jsonl(tmp_path / "d.jsonl", ROWS)) == ROWS


def test_jsonl_skips_blank_lines_and_names_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert load_rows(str(path)) == ROWS[:2]
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(UserError, match=r"d\.jsonl line 2: not valid JSON"):
        load_rows(str(path))
    path.write_text("[1, 2]\n")
    with pytest.raises(UserError, match="line 1: each line must be a JSON object, got list"):
        load_rows(str(path))


def test_non_utf8_bytes_name_the_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b'\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"d\.jsonl line 2: not UTF-8 text \(byte 0xe9 at column "
                                        r"16\)"):
        load_rows(str(path))
    (tmp_path / "d.json").write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(UserError, match=r"d\.json: not UTF-8 text \(byte 0xe9 at offset 16\)"):
        load_rows(str(tmp_path / "d.json"))


def test_json_list_and_data_object(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    (tmp_path / "obj.json").write_text(json.dumps({"data": ROWS}))
    assert load_rows(str(tmp_path / "list.json")) == ROWS
    assert load_rows(str(tmp_path / "obj.json")) == ROWS
    (tmp_path / "bad.json").write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(UserError, match=r"bad\.json: a \.json dataset must be a list of objects"):
        load_rows(str(tmp_path / "bad.json"))


def test_csv_values_are_strings(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('query,solution,note\n"What is 1 + 2?",3,\n"a, b",10,x\n')
    assert load_rows(str(path)) == [{"query": "What is 1 + 2?", "solution": "3", "note": ""},
                                    {"query": "a, b", "solution": "10", "note": "x"}]


def test_parquet(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}], "solution": "1"},
            {"messages": [{"role": "user", "content": "yo"}], "solution": "2"}]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    assert load_rows(str(tmp_path / "d.parquet")) == rows


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(str(tmp_path / "ds")) == ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(tmp_path / "dd"))
    assert load_rows(str(tmp_path / "dd")) == ROWS[:2]
    datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS),
                          "b": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(UserError, match="splits a, b and no 'train' split"):
        load_rows(str(tmp_path / "ab"))


def test_directory_of_files(tmp_path):
    folder = tmp_path / "dir"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "b.jsonl", ROWS[1:])
    (folder / "a.json").write_text(json.dumps(ROWS[:1]))
    write_jsonl(folder / ".hidden.jsonl", ROWS)
    (folder / "README.md").write_text("# readme")
    assert load_rows(str(folder)) == ROWS  # a.json then b.jsonl (sorted), hidden file skipped
    # A train split present: only its files are read.
    write_jsonl(folder / "sub" / "train-00000.jsonl", ROWS[2:])
    assert load_rows(str(folder)) == ROWS[2:]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty: the directory holds no"):
        load_rows(str(tmp_path / "empty"))


def test_unknown_extension_and_missing_path(tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(UserError, match=r"d\.txt: unsupported file type '\.txt'"):
        load_rows(str(tmp_path / "d.txt"))
    with pytest.raises(UserError, match=r"missing\.jsonl: no such file or directory"):
        load_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match=r"missing\.jsonl:5: no such file"):
        load_rows(str(tmp_path / "missing.jsonl") + ":5")


def test_row_sample_as_ms_swift(tmp_path, swift_logs):
    """`#N` samples as ms-swift's sample_dataset: a permutation of one RandomState(data_seed)
    for the remainder, whole repeats first; the first rows without shuffling."""
    rows = [{"query": str(i)} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    expected = np.random.RandomState(42).permutation(10)[:3].tolist()
    assert [int(r["query"]) for r in load_rows(path + "#3")] == expected
    state = np.random.RandomState(7)
    assert [int(r["query"]) for r in load_rows(path + ":4", random_state=state)] == \
        np.random.RandomState(7).permutation(10)[:4].tolist()
    assert load_rows(path + "#3", shuffle=False) == rows[:3]
    repeated = load_rows(path + "#23")
    assert [int(r["query"]) for r in repeated[:20]] == list(range(10)) * 2
    assert [int(r["query"]) for r in repeated[20:]] == expected
    assert "23 rows asked for, it has 10: rows are repeated" in swift_logs.text
    with pytest.raises(UserError, match="at least 1"):
        load_rows(path + "#0")


def test_samples_of_several_specs_share_one_random_state(tmp_path, tok):
    rows = [{"query": str(i)} for i in range(6)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    prompts = load_prompts([path + "#2", path + "#2"], tok, settings(100), seed=5)
    state = np.random.RandomState(5)
    expected = state.permutation(6)[:2].tolist() + state.permutation(6)[:2].tolist()
    assert [int(p.messages[-1]["content"]) for p in prompts] == expected


def test_existing_path_ending_in_colon_digits_loads_whole(tmp_path):
    (tmp_path / "dir:2").mkdir()
    write_jsonl(tmp_path / "dir:2" / "d.jsonl", ROWS)
    assert load_rows(str(tmp_path / "dir:2")) == ROWS
    assert load_rows(str(tmp_path / "dir:2") + ":1", shuffle=False) == ROWS[:1]


def test_parse_spec(tmp_path):
    def parse_spec(text):
        parsed = parse_data_spec(text)
        return (parsed.spec, parsed.source, parsed.kind, parsed.limit)

    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert parse_spec(path + ":7")[1:] == (path, "file", 7)
    assert parse_spec(str(tmp_path))[1:] == (str(tmp_path), "dir", None)
    assert parse_spec("AI-MO/NuminaMath-TIR")[1:] == ("AI-MO/NuminaMath-TIR", "hub", None)
    assert parse_spec("AI-MO/NuminaMath-TIR:100")[1:] == ("AI-MO/NuminaMath-TIR", "hub", 100)
    assert parse_spec("gsm8k#50")[1:] == ("gsm8k", "hub", 50)
    with pytest.raises(UserError, match="empty value"):
        parse_data_spec(" ")


def test_several_datasets_concatenate_in_order(tmp_path, tok):
    first = write_jsonl(tmp_path / "a.jsonl", ROWS)
    second = str(tmp_path / "b.json")
    (tmp_path / "b.json").write_text(json.dumps([{"prompt": "Hi", "solution": "x"}]))
    prompts = load_prompts([first + "#2", second, first], tok, settings(100), shuffle=False)
    assert [p.prompt_id for p in prompts] == [0, 1, 2, 3, 4, 5]
    assert [p.messages[-1]["content"] for p in prompts] == [
        "What is 1 + 2?", "What is 4 - 1?", "Hi", "What is 1 + 2?", "What is 4 - 1?", "What is 2 + 2?"]
    assert [p.columns["solution"] for p in prompts] == ["3", "3", "x", "3", "3", "4"]


def test_columns_are_aligned_across_rows_and_datasets(tmp_path, tok):
    first = write_jsonl(tmp_path / "a.jsonl", [{"query": "a", "solution": "1"}, {"query": "b", "level": 2}])
    second = write_jsonl(tmp_path / "b.jsonl", [{"query": "c", "source": "web"}])
    prompts = load_prompts([first, second], tok, settings(100))
    assert [p.columns for p in prompts] == [{"solution": "1", "level": None, "source": None},
                                            {"solution": None, "level": 2, "source": None},
                                            {"solution": None, "level": None, "source": "web"}]
    assert [list(p.columns) for p in prompts] == [["solution", "level", "source"]] * 3


# ---------------------------------------------------------------------------------------------
# Sources: hub ids (monkeypatched; no network)


@pytest.fixture
def modelscope_hub():
    import importlib

    return importlib.import_module("modelscope.hub.snapshot_download")


def test_modelscope_hub_id(tmp_path, monkeypatch, modelscope_hub):
    snapshot = tmp_path / "snapshot"
    (snapshot / "data").mkdir(parents=True)
    write_jsonl(snapshot / "data" / "train.jsonl", ROWS)
    write_jsonl(snapshot / "data" / "test.jsonl", ROWS[:1])
    calls = []

    def fake(dataset_id, **kwargs):
        calls.append(dataset_id)
        return str(snapshot)

    monkeypatch.setattr(modelscope_hub, "dataset_snapshot_download", fake)
    assert load_rows("owner/math-set#2", shuffle=False) == ROWS[:2]
    assert calls == ["owner/math-set"]


def test_hf_hub_id(monkeypatch):
    import datasets

    calls = []

    def fake(path, **kwargs):
        calls.append(path)
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                     "test": datasets.Dataset.from_list(ROWS[:1])})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert load_rows("owner/math-set", use_hf=True) == ROWS
    assert calls == ["owner/math-set"]


@pytest.mark.parametrize("use_hf, hub", [(False, "ModelScope"), (True, "Hugging Face")])
def test_hub_offline_is_a_user_error(monkeypatch, modelscope_hub, use_hf, hub):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Failed to resolve host")

    monkeypatch.setattr(modelscope_hub, "dataset_snapshot_download", offline)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError) as info:
        load_rows("owner/math-set", use_hf=use_hf)
    message = str(info.value)
    assert f"dataset owner/math-set: could not download it from {hub}" in message
    assert "Failed to resolve host" in message and "pass a local path" in message


# ---------------------------------------------------------------------------------------------
# Prompts: templates and columns


def test_messages_row(tok):
    prompt = one({"messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 2 + 2?"}], "solution": "4"}, tok)
    assert prompt.text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                           "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.input_ids == tok(prompt.text, add_special_tokens=False)["input_ids"]
    assert prompt.input_ids[:3] == [498, 82, 347]  # <|im_start|> once: no special tokens added
    assert prompt.columns == {"solution": "4"}
    assert prompt.truncated is False and prompt.prompt_id == 0


def test_query_row_and_prompt_with_system(tok):
    assert one({"query": "Hi"}, tok).text == chatml(("user", "Hi"))
    prompt = one({"prompt": "Hi", "system": "Sys", "id": 7}, tok)
    assert prompt.text == chatml(("system", "Sys"), ("user", "Hi"))
    assert prompt.messages == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi"}]
    assert prompt.columns == {"id": 7}
    assert one({"query": "Hi", "system": None}, tok).text == chatml(("user", "Hi"))


def test_trailing_assistant_dropped_and_system_column(tok):
    prompt = one({"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                               {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}],
                  "system": "Sys"}, tok)
    assert prompt.text == chatml(("system", "Sys"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"))
    assert prompt.columns == {}


def test_tool_message_ends_prompt(tok):
    prompt = one({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "call"},
                               {"role": "tool", "content": "42"}]}, tok)
    assert prompt.text == chatml(("user", "Q"), ("assistant", "call"), ("tool", "42"))


def test_columns_renaming_and_extra_columns(tok):
    rows = [{"question": "Q?", "answer": "5", "meta": {"level": 2, "tags": ["a"]}},
            {"problem": "P?", "answer": "6", "meta": None}]
    columns = {"question": "query", "problem": "query", "answer": "solution"}
    prompts = build_prompts(rows, tok, settings(100, columns=columns))
    assert [p.text for p in prompts] == [chatml(("user", "Q?")), chatml(("user", "P?"))]
    assert prompts[0].columns == {"solution": "5", "meta": {"level": 2, "tags": ["a"]}}
    assert prompts[1].columns == {"solution": "6", "meta": None}


def test_question_is_not_guessed(tok):
    with pytest.raises(UserError, match=r"row 1: no prompt: .*'question'.*--columns"):
        one({"question": "Q?"}, tok)


def test_rename_collision(tok):
    with pytest.raises(UserError, match="row 1: --columns .* leaves two columns named 'query'"):
        one({"query": "a", "question": "b"}, tok, columns={"question": "query"})
    # a None hole (merged datasets) is not a collision
    assert one({"query": None, "question": "b"}, tok, columns={"question": "query"}).text == \
        chatml(("user", "b"))


BAD_ROWS = [
    ({"solution": "1"}, "no prompt: expected a 'messages' list or a 'query'/'prompt' string"),
    ({"messages": "hi"}, "'messages' must be a non-empty list of {role, content}"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": ["hi"]}, "'messages' must be a list of {role, content}; message 1 is 'hi'"),
    ({"messages": [{"role": "user"}]}, "'messages' must be a list of {role, content}; message 1"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "message 1 has role 'bot'; roles must be one "
                                                      "of system, user, assistant, tool"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": ["x"]}]},
     "message 2 (user) content must be a string, got list"),
    ({"messages": [{"role": "system", "content": "s"}]}, "must end with a user (or tool) message"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "must end with a user (or tool) message"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "system": "t"},
     "both a 'system' column and a system message"),
    ({"query": 5}, "'query' must be a string, got int"),
    ({"prompt": ["x"]}, "'prompt' must be a string, got list"),
    ({"query": "q", "system": 1}, "'system' must be a string, got int"),
    ({"query": "q", "completions": "x"}, "'completions' clash with the names the trainer passes"),
    ("just text", "a row must be an object, got str"),
]


@pytest.mark.parametrize("bad, expected", BAD_ROWS)
def test_bad_row_names_dataset_and_row(tok, bad, expected):
    rows = [{"query": "fine"}, {"query": "fine"}, bad, {"query": "fine"}]
    with pytest.raises(UserError) as info:
        build_prompts(rows, tok, settings(100), spec="data.jsonl")
    assert str(info.value).startswith("dataset data.jsonl row 3: ")
    assert expected in str(info.value)


def test_empty_dataset(tok, tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(UserError, match=r"e\.jsonl has no rows"):
        load_prompts([str(tmp_path / "e.jsonl")], tok, settings(10))


def test_tokenizer_without_chat_template(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(UserError, match="has no chat template.*chat/instruct model.*chat_template"):
        one({"query": "Hi"}, plain)


def test_template_error_names_row(tok):
    strict = copy.deepcopy(tok)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
                            "{{ raise_exception('no tools') }}{% endif %}{{ m['content'] }}{% endfor %}")
    rows = [{"query": "a"}, {"messages": [{"role": "user", "content": "u"}, {"role": "tool", "content": "t"}]}]
    with pytest.raises(UserError, match=r"dataset d row 2: the chat template rejected .*no tools"):
        build_prompts(rows, strict, settings(100), spec="d")


# ---------------------------------------------------------------------------------------------
# Prompts: truncation and budget


def test_left_truncation_keeps_last_tokens_and_warns_once(tok, swift_logs):
    rows = [{"query": "What is 1 + 2? " * 4}, {"query": "Hi"}, {"query": "What is 3 + 4? " * 4}]
    full = build_prompts(rows, tok, settings(1000))
    assert [len(p.input_ids) for p in full] == [45, 11, 45]
    swift_logs.clear()
    prompts = build_prompts(rows, tok, settings(20), spec="d.jsonl")
    assert prompts[0].input_ids == full[0].input_ids[-20:]
    assert prompts[2].input_ids == full[2].input_ids[-20:]
    assert prompts[0].text == tok.decode(full[0].input_ids[-20:])
    assert prompts[0].text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert prompts[1].input_ids == full[1].input_ids
    assert [p.truncated for p in prompts] == [True, False, True]
    records = [r for r in swift_logs.records if r.levelno == logging.WARNING]
    assert len(records) == 1
    assert "dataset d.jsonl: 2 of 3 prompts were longer than max_length - max_completion_length " \
           "= 20 tokens and were truncated from the left" in records[0].getMessage()


def test_truncation_strategy_delete_drops_long_prompts(tok, swift_logs):
    rows = [{"query": "What is 1 + 2? " * 4}, {"query": "Hi"}, {"query": "Yo"}]
    prompts = build_prompts(rows, tok, settings(20, truncation_strategy="delete"), spec="d")
    assert [p.prompt_id for p in prompts] == [1, 2] and not any(p.truncated for p in prompts)
    assert "1 of 3 prompts were longer" in swift_logs.text and "were dropped" in swift_logs.text
    with pytest.raises(UserError, match="--truncation_strategy delete drops them all"):
        build_prompts(rows[:1], tok, settings(20, truncation_strategy="delete"), spec="d")


def test_system_prompt_for_rows_without_one(tok, tmp_path):
    assert one({"query": "Q"}, tok, system="Be brief.").text == \
        chatml(("system", "Be brief."), ("user", "Q"))
    # the row's own system message wins, as in ms-swift
    assert one({"query": "Q", "system": "Mine."}, tok, system="Be brief.").text == \
        chatml(("system", "Mine."), ("user", "Q"))
    from swift_megatron.data.system import system_prompt

    path = tmp_path / "prompt.txt"
    path.write_text("From a file.")
    assert system_prompt(str(path)) == "From a file."
    assert system_prompt("plain text") == "plain text"
    with pytest.raises(UserError, match="--system .*missing.txt: no such file"):
        system_prompt(str(tmp_path / "missing.txt"))


def test_enable_thinking_reaches_the_template(tok):
    thinking = copy.deepcopy(tok)
    thinking.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                              "{% if enable_thinking is defined and not enable_thinking %}"
                              "<think></think>{% endif %}")
    assert one({"query": "Q"}, thinking).text == "Q"
    assert one({"query": "Q"}, thinking, enable_thinking=False).text == "Q<think></think>"
    assert one({"query": "Q"}, thinking, enable_thinking=True).text == "Q"


def test_max_prompt_length():
    assert max_prompt_length(1024, 512) == 512
    assert max_prompt_length(None, 100, max_position_embeddings=512) == 412
    with pytest.raises(UserError, match=r"--max_length \(512\) - --max_completion_length \(512\) = 0"):
        max_prompt_length(512, 512)
    with pytest.raises(UserError, match=r"--max_length \(default: the model's max_position_embeddings, "
                                        r"256\) - --max_completion_length \(512\)"):
        max_prompt_length(None, 512, max_position_embeddings=256)


def test_parallel_tokenization_matches(tok, monkeypatch):
    rows = [{"query": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(10)]
    monkeypatch.setattr(prompts_module, "_CHUNK", 3)  # 4 chunks over 2 spawned processes
    serial = build_prompts(rows, tok, settings(12))
    parallel = build_prompts(rows, tok, settings(12, num_proc=2))
    assert parallel == serial
    assert all(isinstance(p, Prompt) for p in parallel) and serial[9].columns == {"solution": "18"}


def test_fixture_math_dataset(tmp_path, tok):
    path = build_math_dataset(str(tmp_path / "math.jsonl"), num_rows=8)
    prompts = load_prompts([path], tok, settings(64))
    first = json.loads(open(path).readline())
    assert prompts[0].text == chatml(("user", first["messages"][0]["content"]))
    assert prompts[0].columns == {"solution": first["solution"]}
    assert len(prompts) == 8 and not any(p.truncated for p in prompts)


# ---------------------------------------------------------------------------------------------
# Validation split and the whole flow


def test_split_validation(tok):
    prompts = build_prompts([{"query": str(i)} for i in range(8)], tok, settings(50))
    train, val = split_validation(prompts, 0.25, seed=0)
    assert [p.prompt_id for p in val] == [2, 6]  # RandomState(0).permutation(8)[:2], sorted
    assert len(val) == 2 and len(train) == 6
    assert sorted(p.prompt_id for p in train + val) == list(range(8))
    assert [p.prompt_id for p in train] == sorted(p.prompt_id for p in train)
    assert split_validation(prompts, 0.25, seed=0) == (train, val)
    assert split_validation(prompts, 0.0, seed=0) == (prompts, [])
    with pytest.raises(UserError, match="would hold out all 8 prompts"):
        split_validation(prompts, 0.99, seed=0)


def data_args(**overrides):
    """The namespace the trainer passes (rlhf/grpo/components.py): the data flags plus three."""
    from swift_megatron.arguments.data import DataArguments

    args = dict(vars(DataArguments()), max_completion_length=16, use_hf=False, seed=0)
    args.update(overrides)
    return SimpleNamespace(**args)


def test_prepare_prompts(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": str(i)} for i in range(10)])
    train, val = prepare_prompts(data_args(dataset=[path], val_dataset=[path + ":3"]), tok,
                                 max_position_embeddings=64)
    assert (len(train), len(val)) == (10, 3)
    train, val = prepare_prompts(data_args(dataset=[path], split_dataset_ratio=0.2), tok,
                                 max_position_embeddings=64)
    assert (len(train), len(val)) == (8, 2)
    with pytest.raises(UserError, match="--dataset is required"):
        prepare_prompts(data_args(), tok, max_position_embeddings=64)
    with pytest.raises(UserError, match="--max_completion_length"):
        prepare_prompts(data_args(dataset=[path], max_length=16), tok)


# ---------------------------------------------------------------------------------------------
# Sampler


def take(sampler, n):
    return [next(sampler) for _ in range(n)]


def test_sampler_unshuffled_order_crosses_epochs():
    sampler = PromptSampler(10, 4, shuffle=False)
    assert sampler.steps_per_epoch == 2.5
    assert take(sampler, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]]
    assert (sampler.epoch, sampler.position) == (1, 6)


def test_sampler_seeded_permutation_per_epoch():
    sampler = PromptSampler(10, 5, seed=0)
    epoch0 = [2, 8, 4, 9, 1, 6, 7, 3, 0, 5]  # numpy RandomState(0).permutation(10), frozen stream
    epoch1 = [2, 9, 6, 4, 0, 3, 1, 7, 8, 5]  # RandomState(1)
    assert take(sampler, 4) == [epoch0[:5], epoch0[5:], epoch1[:5], epoch1[5:]]


def test_sampler_incomplete_last_batch_continues_next_epoch():
    sampler = PromptSampler(10, 4, seed=0)
    epoch0, epoch1 = [2, 8, 4, 9, 1, 6, 7, 3, 0, 5], [2, 9, 6, 4, 0, 3, 1, 7, 8, 5]
    batches = take(sampler, 5)
    assert batches[2] == epoch0[8:] + epoch1[:2]
    assert sum(batches, []) == epoch0 + epoch1


def test_sampler_every_prompt_once_per_epoch():
    sampler = PromptSampler(12, 4, seed=3)
    for _ in range(3):
        assert sorted(sum(take(sampler, 3), [])) == list(range(12))


def test_sampler_more_prompts_per_batch_than_dataset():
    sampler = PromptSampler(3, 8, shuffle=False)
    assert next(sampler) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert sampler.batch_sample_ids() == list(range(8, 16))


def test_sampler_dp_shares_are_disjoint_and_make_the_global_batch():
    whole = take(PromptSampler(24, 8, seed=5), 6)
    ranks = [PromptSampler(24, 8, dp_size=4, dp_rank=r, seed=5) for r in range(4)]
    assert ranks[2].batch_sample_ids() == [4, 5]
    for batch in whole:
        shares = [next(s) for s in ranks]
        assert all(len(share) == 2 for share in shares)
        assert sum(shares, []) == batch
        assert len(set(sum(shares, []))) == 8  # no prompt on two ranks (batches within an epoch)


def test_sampler_determinism_and_seeds():
    assert take(PromptSampler(50, 10, seed=1), 10) == take(PromptSampler(50, 10, seed=1), 10)
    assert take(PromptSampler(50, 10, seed=1), 5) != take(PromptSampler(50, 10, seed=2), 5)
    epochs = take(PromptSampler(50, 50, seed=1), 2)
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])


def test_sampler_resume_mid_epoch():
    reference = PromptSampler(10, 4, dp_size=2, dp_rank=1, seed=7)
    take(reference, 1)
    state = reference.state_dict()
    assert state == {"epoch": 0, "position": 4, "num_prompts": 10, "seed": 7, "shuffle": True}
    expected = take(reference, 6)
    resumed = PromptSampler(10, 4, dp_size=2, dp_rank=1, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert take(resumed, 6) == expected
    # The state is global: a resumed run with another dp_size continues the same stream.
    single = PromptSampler(10, 4, seed=7)
    single.load_state_dict(state)
    assert [b[2:] for b in take(single, 6)] == expected


def test_sampler_resume_refuses_another_dataset():
    state = PromptSampler(10, 4, seed=7).state_dict()
    with pytest.raises(UserError, match="num_prompts=10, this run has 11"):
        PromptSampler(11, 4, seed=7).load_state_dict(state)


def test_sampler_argument_checks():
    with pytest.raises(ValueError, match="multiple of dp_size"):
        PromptSampler(10, 6, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank 2"):
        PromptSampler(10, 4, dp_size=2, dp_rank=2)
    with pytest.raises(UserError, match="no prompts"):
        PromptSampler(0, 4)


def test_import_is_light():
    import subprocess

    code = ("import sys, swift_megatron.data; "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sampler_step_interleaved_shares_make_steps_layout_independent():
    """With step_prompts, optimizer step k trains the same prompts whatever the DP size."""
    single = PromptSampler(40, 8, seed=3, step_prompts=4)
    ranks = [PromptSampler(40, 8, dp_size=2, dp_rank=r, seed=3, step_prompts=4) for r in range(2)]
    whole = next(single)
    shares = [next(r) for r in ranks]
    for step in range(2):  # two optimizer steps of 4 prompts; each DP rank holds 2 per step
        assert sorted(whole[step * 4:(step + 1) * 4]) == sorted(
            shares[0][step * 2:(step + 1) * 2] + shares[1][step * 2:(step + 1) * 2])
    assert ranks[1].batch_sample_ids() == [8 + 2, 8 + 3, 8 + 6, 8 + 7]


def test_sampler_falls_back_to_contiguous_shares():
    """A step whose prompts do not split evenly over DP ranks keeps ms-swift's contiguous shares."""
    rank = PromptSampler(40, 8, dp_size=2, dp_rank=1, seed=3, step_prompts=3)
    assert rank.batch_sample_ids() == [4, 5, 6, 7]


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from swift_megatron.rlhf.grpo import components

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen3"), model)
    config = json.loads((model / "config.json").read_text())
    assert len(components.tokenizer(str(model), config)) <= config["vocab_size"]
    with pytest.raises(UserError, match=r"the tokenizer has \d+ tokens but the model's "
                                        r"vocab_size is 100"):
        components.tokenizer(str(model), dict(config, vocab_size=100))
