from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.harness import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.kill_all()


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)
