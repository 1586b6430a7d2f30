"""flexjit's benchmarks: every speed claim the project makes comes from here.

- `variants`: the attention variants, each written once as plain torch-like mods.
- `reference`: the chunked float32 reference, the same math in the test dtype, mask density.
- `impls`: flexjit's backends and the baselines, each behind one small adapter.
- `run`: the GPU harness (`python -m benchmarks.run`); `report`: its table and chart.
- `cpu_block_mask`, `host_overhead`: the benchmarks for a machine without a GPU.

README.md in this folder gives the exact commands.
"""
