"""swift-megatron: GRPO post-training of Hugging Face causal LMs on a Megatron-core backend.

`pip install -e .` installs the `megatron` console script and the CPU/GPU framework stack from
requirements/framework.txt. The command-line layer lives in cli/ and is installed as
`swift_megatron.cli` (never as a top-level `cli` module).
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def read_requirements(name):
    lines = (HERE / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="swift-megatron",
    version="0.1.0",
    description="GRPO post-training of LLMs on Megatron-core with vLLM rollouts",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["swift_megatron", "swift_megatron.*"]) + ["swift_megatron.cli"],
    package_dir={"swift_megatron.cli": "cli"},
    package_data={"swift_megatron.fixtures": ["data/*", "data/**/*"]},
    install_requires=read_requirements("framework.txt"),
    extras_require={
        "tests": read_requirements("tests.txt"),
        "vllm": read_requirements("vllm.txt"),
        "te": read_requirements("te.txt"),
        "gdn": read_requirements("gdn.txt"),
        "report": read_requirements("report.txt"),
    },
    entry_points={"console_scripts": ["megatron=swift_megatron.cli.main:main"]},
)
