"""The docs match the code: the generated flag reference (docs/arguments.md), the migration
guide's flag tables, the batch-size worked examples of docs/rlhf.md."""
import os
import runpy

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arguments_doc_is_current():
    module = runpy.run_path(os.path.join(REPO, "scripts", "gen_arguments_doc.py"))
    with open(os.path.join(REPO, "docs", "arguments.md")) as f:
        assert f.read() == module["render"](), "docs/arguments.md is stale: run " \
                                               "python scripts/gen_arguments_doc.py"


def test_migration_guide_names_every_flag_we_treat_differently():
    """docs/migrating-from-ms-swift.md lists every alias, every flag accepted without effect and
    every ms-swift flag we refuse (the tables the parser answers from)."""
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.ms_swift import NOT_SUPPORTED
    from swift_megatron.arguments.parser import command_groups, group_specs

    with open(os.path.join(REPO, "docs", "migrating-from-ms-swift.md")) as f:
        text = f.read()
    specs = [spec for _, group in command_groups(RlhfArguments) for spec in group_specs(group)]
    names = ([alias for spec in specs for alias in spec.meta.get("aliases", ())]
             + [spec.name for spec in specs if spec.meta.get("no_effect")] + list(NOT_SUPPORTED))
    missing = [name for name in names if f"`--{name}`" not in text]
    assert not missing, f"not in docs/migrating-from-ms-swift.md: {missing}"


def _rlhf_worked_examples() -> str:
    """The text block under 'Worked examples:' in docs/rlhf.md, its lines joined by spaces."""
    with open(os.path.join(REPO, "docs", "rlhf.md")) as f:
        text = f.read()
    block = text.split("\nWorked examples:\n", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return " ".join(block.split())


def _dry_run(capsys, monkeypatch, gpus: int, *flags: str) -> dict:
    """`megatron rlhf --dry_run true` on `gpus` processes: its plan table as {name: int}."""
    from swift_megatron.cli.main import run

    for name in ("NNODES", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", str(gpus))
    capsys.readouterr()
    assert run(["rlhf", "--dry_run", "true", "--model", "org/m", "--dataset", "d",
                "--reward_funcs", "accuracy", "--num_generations", "8",
                "--steps_per_generation", "4", *flags]) == 0
    rows = (line.split() for line in capsys.readouterr().out.splitlines())
    return {row[0]: int(row[1]) for row in rows if len(row) >= 2 and row[1].isdigit()}


def test_rlhf_worked_examples_match_the_plan(capsys, monkeypatch):
    """The numbers of docs/rlhf.md's worked examples are the ones `--dry_run true` prints."""
    text = _rlhf_worked_examples()
    p = _dry_run(capsys, monkeypatch, 8, "--tensor_model_parallel_size", "2",
                 "--micro_batch_size", "4", "--global_batch_size", "128")
    for claim in (f"dp = 8 / 2 = {p['dp_size']}",
                  f"128 / (4 x {p['dp_size']}) = {p['grad_accum_steps']} accumulation steps",
                  f"generation {p['generation_batch_size']} = {p['rollout_prompts']} prompts x 8",
                  f"{p['rollout_prompts_per_dp']} prompts per DP group",
                  f"{p['generation_batch_size']} / 8 = {p['completions_per_rank']} completions"):
        assert claim in text, claim
    p = _dry_run(capsys, monkeypatch, 1, "--micro_batch_size", "4", "--global_batch_size", "32")
    claim = (f"generation {p['generation_batch_size']} = {p['rollout_prompts']} prompts; "
             f"{p['rollout_prompts_per_dp']} prompts per DP group")
    assert claim in text, claim


def test_rlhf_worked_examples_quote_the_printed_errors(monkeypatch):
    """Each message quoted in docs/rlhf.md's worked examples is the one the rule raises, in the
    order of the examples (1 GPU, micro 4, 8 generations, 4 steps per generation)."""
    import re

    from swift_megatron.cli.main import run
    from swift_megatron.errors import UserError

    for name in ("NNODES", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "1")
    quoted = re.findall(r'global (\d+) instead[^"]*"([^"]*)"', _rlhf_worked_examples())
    assert [g for g, _ in quoted] == ["10", "12"], quoted
    for global_batch_size, message in quoted:
        with pytest.raises(UserError) as raised:
            run(["rlhf", "--dry_run", "true", "--model", "org/m", "--dataset", "d",
                 "--reward_funcs", "accuracy", "--num_generations", "8",
                 "--steps_per_generation", "4", "--micro_batch_size", "4",
                 "--global_batch_size", global_batch_size])
        assert " ".join(str(raised.value).split()) == message
