"""Demonstrations that belong to one lesson: the code a lesson runs to show its idea, kept importable.

pretraining      lesson 01: what pretraining buys (masked-LM accuracy, fill-mask, pretrained vs random init)
data_parallel    lesson 02: sharding, replication, gradient aggregation, parameter sync on N ranks
mixed_precision  lesson 03: memory, communication (and compute) of mixed precision, measured
"""
