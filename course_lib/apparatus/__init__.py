"""A lesson's apparatus: what it measures around the technique its own cells show (workers' shells,
counters, recorders, timers, table rows), kept importable for spawned processes. A function here that
applies a technique (a wrapper, an efficient optimizer, a collective) is one a lesson shows verbatim.

pretraining      lesson 01: what pretraining buys (masked-LM accuracy, fill-mask, pretrained vs random init)
data_parallel    lesson 02: sharding, replication, gradient aggregation, parameter sync on N ranks
mixed_precision  lesson 03: memory, communication (and compute) of mixed precision, measured
accumulation     lesson 04: the weighted accumulation loop, each loop's update beside the big batch's, peak and time
accumulation_checkpointing  lesson 04: checkpointing's recompute counts and phase times, sqrt(n) saved bytes
local_sgd        lesson 05: the loops it shows (DDP with no_sync, the LocalSGD block, the counting hook), its launch
local_sgd_counting  lesson 05: all-reduce calls and bytes (CommLog, counting_hook), bytes per strategy, bf16 build check
local_sgd_record    lesson 05: what each variant's rank sent and saw (Recorder: counts, loss, replica drift), tables, plots
optimizers       lesson 06: optimizer state (AdamW, Adafactor, 8-bit AdamW), ZeRO accounting, Trainer optim=
sharding         lesson 06b: DDP, ZeRO-1 and FSDP on two gloo ranks: bytes per rank, collectives, same result
"""
