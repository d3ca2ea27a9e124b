import pytest
import xoscar as xo

from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor


@pytest.fixture
async def tracker():
    """The block tracker as a real actor in a real xoscar pool, with replicas 0, 1
    and 2 registered at nixl://a, nixl://b and nixl://c."""
    pool = await xo.create_actor_pool("127.0.0.1", n_process=0)
    async with pool:
        ref = await xo.create_actor(
            BlockTrackerActor, address=pool.external_address, uid="tracker"
        )
        for rank, address in enumerate(("nixl://a", "nixl://b", "nixl://c")):
            await ref.register_replica(rank, address)
        yield ref
