"""Fixtures of the executor tests."""

import pytest
import torch.distributed as dist

from soapsearch.executor.comm import Group


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo world of one process, in this process: its group, as the executor's ``Group``."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield Group(dist.group.WORLD, (0,))
    dist.destroy_process_group()
