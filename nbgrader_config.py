"""nbgrader configuration: solutions/ is the source, exercises/ the student release."""

c = get_config()  # noqa: F821  (injected by nbgrader)

c.CourseDirectory.course_id = "efficient-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
c.CourseDirectory.root = "."
