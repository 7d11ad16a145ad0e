"""The recipe ladder: time to a fixed validation accuracy, one efficiency change per rung
(``python -m course_lib.cli.recipe``, lesson 07, the README's "Time to accuracy").

rungs        the stack a run trains with, the rungs (one change each), that change as code, the command's flags
runs         the two measurements of a stack: accuracy runs over the evaluation schedule, throughput runs
decision     keep / within noise / drop: the rule, its interval and the median over seeds
ladder_runs  the walk up the ladder: interleaved rounds, seeds, decisions, load, the record
recipe       the ladder's settings (``RecipeConfig``, the quick preset) and reading a record
report       the README section, its table and chart, the verdict, and the rows lesson 07 prints
"""
