"""Command-line programs: ``python -m course_lib.cli.<name>``.

train        fine-tune the course model on 1 or N processes (torchrun, accelerate launch)
experiments  pretrained vs random init on the same budget (writes the README block)
bench        the training benchmark: four implementations side by side
recipe       time to a fixed accuracy, one efficiency change per rung (writes the README block)
"""


def comma_list(value: str) -> tuple[str, ...]:
    """An argparse ``type``: ``"a, b,,c"`` -> ``("a", "b", "c")``."""
    return tuple(v.strip() for v in value.split(",") if v.strip())
