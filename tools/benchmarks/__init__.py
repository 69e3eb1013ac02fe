"""keras_pipe's benchmarks: one module per part over a shared harness.

```
python -m tools.benchmarks [--quick] [--out DIR] [--only peer,a,b,c,d,e,f]
```

- `harness`: child processes, pinned workers, one-core baseline, step
  clocks, tables
- `peer`, `peer_jobs`, `peer_torch`, `peer_report`: keras_pipe against
  torch.distributed.pipelining on three jobs, in the same run
- `throughput`, `throughput_report`: (a) MLP throughput per schedule and M
  on 2 pinned workers
- `overhead`: (b) a one-stage PipelineModel against plain Keras
- `memory`: (c) peak memory per remat mode, schedule and M
- `build`: (d) time to build the training step
- `fidelity`: (e) schedule fidelity with sleeping stages
- `replicas`: (f) 2 replicas x 2 stages against 1 replica
- `report`, `cli`: tables, goals and figures; the command line
"""
