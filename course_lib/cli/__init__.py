"""Command-line programs: ``python -m course_lib.cli.<name>``.

train        fine-tune the course model on 1 or N processes (torchrun, accelerate launch)
train_options  the train command's flags: RunConfig and parse_args
bench        the training benchmark: four implementations side by side
recipe       time to a fixed accuracy, one efficiency change per rung
check        a learner's self-check of an exercise notebook (``make check NB=...``, ``course-check``)

Importing this package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it (below).
``bench`` and ``recipe`` print their report and write their record with ``--json PATH``; the
maintainers' ``python -m course_tools.sections render NAME`` puts a committed record into the README.
"""

import argparse
import os

# [threads] before torch starts OpenMP: waiting threads sleep instead of spinning. Beside another busy
# process, spinning threads steal the cycles the working ones need and a 2-thread step can take 10x
# longer in some runs and not in others (measured: CONTRIBUTING, "Threads"), which turns every timing
# of these commands into a coin toss; on a quiet machine sleeping waits cost nothing measurable. An
# OMP_WAIT_POLICY already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def comma_list(value: str) -> tuple[str, ...]:
    """An argparse ``type``: ``"a, b,,c"`` -> ``("a", "b", "c")``."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_output_arguments(parser: argparse.ArgumentParser, plot: str) -> None:
    """The output flags the measuring commands share: --json (the record), --markdown, --plot."""
    parser.add_argument("--json", metavar="PATH", help="write the run's record (settings, machine, rows)")
    parser.add_argument("--markdown", metavar="PATH", help="write the markdown report")
    parser.add_argument("--plot", metavar="PATH", help=f"write {plot} (PNG)")
