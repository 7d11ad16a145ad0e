"""nbgrader configuration: solutions/ is the source, exercises/ the student release."""

import os

from course_lib.check import CELL_TIMEOUT, IGNORED_STDERR

c = get_config()  # noqa: F821  (injected by nbgrader)

c.CourseDirectory.course_id = "efficient-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
# The folder of this file, as an absolute path (nbgrader warns about a relative one).
c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))  # noqa: F821  (__file__ is set by traitlets)

# Every reference cell runs in a few seconds on 2 CPU cores. A cell still running after CELL_TIMEOUT
# seconds is a runaway (an infinite loop): nbgrader interrupts it, the cell scores zero and grading
# goes on with the next cell. `course_lib.check` uses the same limit.
c.Execute.timeout = CELL_TIMEOUT

# A grade cell scores zero if it writes anything to stderr. The tests here signal failure only by
# raising, so library warnings and progress bars must not cost a correct answer its points.
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = IGNORED_STDERR
