from setuptools import find_packages, setup

setup(
    name="tide-megatron",
    version="0.1.0",
    description="Asynchronous, elastic RL for multi-turn agentic LLM workloads on Megatron-core and SGLang",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["tide_megatron", "tide_megatron.*", "sglang_patches", "sglang_patches.*"]),
    package_data={"tide_megatron": ["assets/*/*"]},
    # The CPU stack is pinned in requirements/cpu.lock and installed --no-deps by
    # scripts/setup_env.sh; these ranges only document what the code needs.
    install_requires=[
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
    ],
    extras_require={
        "cpu": ["torch==2.13.0", "megatron-core==0.16.1", "transformers==5.19.0", "tokenizers==0.23.2"],
        "gpu": ["torch", "megatron-core==0.16.1", "transformer-engine[pytorch]", "sglang==0.5.23"],
        "test": ["pytest", "hypothesis"],
    },
    # SGLang loads general plugins from this group in every process, the scheduler's included.
    entry_points={"sglang.srt.plugins": ["tide_ctb = sglang_patches.plugin:load"]},
)
