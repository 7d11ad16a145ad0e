"""The training benchmark: four implementations of one fine-tuning step, measured side by side.

config           implementations, model sizes, ``BenchConfig`` and the ``--quick`` preset
workloads        the model of each size and the fixed-shape batches every implementation trains on
implementations  the slides' loop, Accelerator, Trainer and the course loop, same step and settings
harness          interleaved rounds, the step clock, peak memory, the rows of a run
report           markdown table, target checks, the JSON record, chart and README section
rungs            the recipe ladder's rungs (one change each), its accuracy runs and throughput runs
ladder_runs      the ladder's interleaved rounds, seeds and keep / within-noise / drop decisions
recipe           time to accuracy: the ladder's settings, record, report, chart and README section

The commands are ``python -m course_lib.cli.bench`` (how to read its table: docs/benchmark.md) and
``python -m course_lib.cli.recipe`` (the README's "Time to accuracy" section).
"""
