"""Instruments: one definition of each quantity the course measures, used by lessons, benchmark and tests.

timing      step time: synchronised wall-clock laps (``Stopwatch``), a repeated call's median
            (``time_fn``), and laps taken from outside by a forward hook (``StepClock``)
throughput  matmul GFLOP/s (the machine's peak), model FLOPs per token, tokens/s and MFU, per process
probe       ``StepProbe``: step time and peak memory of any loop (PyTorch, Accelerator, Trainer)
memory      peak tensor memory of a step (CUDA allocator, CPU profiler); bytes saved for backward; optimizer state; model states; tensor bytes
comm        collectives one rank sends (all-reduce, all-gather, reduce-scatter, broadcast): calls, bytes, dtypes, ring traffic
replicas    how far data-parallel replicas are apart (distance, move, cosine), a loss averaged over the ranks
"""
