import pytest

from tide_megatron.sim.loader import load_config

SMALL = ["n_gpus=8", "steps=4", "workload.batch_groups=8", "workload.min_batch_groups=4",
         "workload.env_concurrency=128", "workload.eval_every=2", "workload.eval_tasks=8"]


@pytest.fixture
def small_config():
    """A 8-GPU, 4-step text run: seconds, not minutes."""
    def make(*overrides):
        return load_config("text_32gpu", SMALL + list(overrides))
    return make
