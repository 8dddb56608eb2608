"""The generated flag reference (docs/arguments.md) matches the argument dataclasses."""
import os
import runpy

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
