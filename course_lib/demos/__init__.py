"""Demonstrations that belong to one lesson: the code a lesson runs to show its idea, kept importable.

pretraining      lesson 01: what pretraining buys (masked-LM accuracy, fill-mask, pretrained vs random init)
data_parallel    lesson 02: sharding, replication, gradient aggregation, parameter sync on N ranks
mixed_precision  lesson 03: memory, communication (and compute) of mixed precision, measured
accumulation_checkpointing  lesson 04: accumulation vs the big batch, loss weighting, recompute counts, sqrt(n) memory
local_sgd        lesson 05: all-reduce calls and bytes per strategy (DDP, no_sync, LocalSGD, fp16 hook), replica drift
optimizers       lesson 06: optimizer state (AdamW, Adafactor, 8-bit AdamW), ZeRO accounting, Trainer optim=
sharding         lesson 06b: DDP, ZeRO-1 and FSDP on two gloo ranks: bytes per rank, collectives, same result
"""
