"""The training benchmark: four implementations of one fine-tuning step, measured side by side.

config           implementations, model sizes, ``BenchConfig`` and the ``--quick`` preset
workloads        the model of each size and the fixed-shape batches every implementation trains on
implementations  the slides' loop, Accelerator, Trainer and the course loop, same step and settings
harness          interleaved rounds, the step clock, peak memory, load average, the rows of a run
report           markdown table, target checks, the JSON record, chart and README section

The command is ``python -m course_lib.cli.bench`` (how to read its table: docs/benchmark.md). The
time-to-accuracy ladder is its own package, ``course_lib.recipe_ladder``.
"""
