"""nbgrader configuration: solutions/ is the source, exercises/ the student release."""

import os

from nbgrader.converters import Autograde, GenerateFeedback

from course_lib.cli.check import CELL_TIMEOUT, IGNORED_STDERR
from course_tools.grading import (
    OUTPUT_CHAR_LIMIT,
    default_preprocessors,
    with_output_size_limit,
    with_quiet_overwrite,
)

c = get_config()  # noqa: F821  (injected by nbgrader)

c.CourseDirectory.course_id = "efficient-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
# The folder of this file, as an absolute path (nbgrader warns about a relative one).
c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))  # noqa: F821  (__file__ is set by traitlets)

# Every reference cell runs in a few seconds on 2 CPU cores. A cell still running after CELL_TIMEOUT
# seconds is a runaway (an infinite loop): nbgrader interrupts it, the cell scores zero and grading
# goes on with the next cell. `course_lib.cli.check` uses the same limit.
c.Execute.timeout = CELL_TIMEOUT

# A grade cell scores zero if it writes anything to stderr. The tests here signal failure only by
# raising, so library warnings and progress bars must not cost a correct answer its points.
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = IGNORED_STDERR

# A test cell the student deleted is put back (from the gradebook, hidden tests included) and graded
# like the others, instead of scoring zero and waiting for manual grading. Edited test cells are
# always replaced by the originals. A deleted answer cell is not restored: its tests fail.
c.OverwriteCells.add_missing_cells = True
# A submitted test cell with hidden tests always differs from the gradebook's copy (the release stripped
# them), and nbgrader's OverwriteCells logs "Attribute 'checksum' for cell ... has changed!" for each one,
# in every submission. course_tools.grading.QuietOverwriteCells restores the hidden tests of a cell
# that is exactly as released before comparing, so the warning names only cells a student really edited;
# every locked cell is still graded with the gradebook's source.
c.Autograde.sanitize_preprocessors = with_quiet_overwrite(
    default_preprocessors(Autograde, "sanitize_preprocessors")
)

# nbgrader's LimitOutput bounds the lines of output a cell keeps, not their length: course_tools.grading's
# LimitOutputSize also bounds the characters (one 5 MB line would otherwise reach the autograded
# notebook and the feedback page whole), in autograding and again when the feedback is generated.
c.Autograde.autograde_preprocessors = with_output_size_limit(
    default_preprocessors(Autograde, "autograde_preprocessors")
)
c.GenerateFeedback.preprocessors = with_output_size_limit(
    default_preprocessors(GenerateFeedback, "preprocessors")
)
c.LimitOutputSize.max_chars = OUTPUT_CHAR_LIMIT
