"""Pipeline helpers: cooperative groups and the TMA-fed mbarrier rings every kernel builds (one
producing thread; the consumers arrive once per warp, or once per thread on sm100's MMA warp)."""

import cutlass.pipeline as pipeline


def thread_group(threads: int):
    """A pipeline's producer or consumer: ``threads`` threads, each arriving."""
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, threads)


def tma_pipelines(consumers: int, *rings, create=pipeline.PipelineTmaAsync.create) -> tuple:
    """One pipeline per ring (barrier storage, stages, transaction bytes), in order: produced by
    one thread's TMA loads, consumed by ``consumers`` arriving threads. Their barriers are
    initialised without a sync (the kernel fences and syncs once after all of them)."""
    producer, consumer = thread_group(1), thread_group(consumers)
    return tuple(create(barrier_storage=bars.data_ptr(), num_stages=stages,
                        producer_group=producer, consumer_group=consumer, tx_count=tx,
                        defer_sync=True)
                 for bars, stages, tx in rings)


def group_pipeline(create, bars, stages: int, producer, consumer):
    """A pipeline of ``stages`` stages between two thread groups (no TMA; ``create`` says which
    agents: ``pipeline.PipelineUmmaAsync.create`` and the like), its barriers in ``bars``,
    initialised without a sync like ``tma_pipelines``'."""
    return create(barrier_storage=bars.data_ptr(), num_stages=stages, producer_group=producer,
                  consumer_group=consumer, defer_sync=True)
