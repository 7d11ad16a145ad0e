"""The course's JupyterLab settings, for `make lab` and the browser tests (tests/browser).

`make lab` puts this folder on JUPYTER_CONFIG_PATH, so Jupyter reads this file, the JSON files in
jupyter_server_config.d/ and, through `LabApp.app_settings_dir`, lab-settings/ beside it. A learner's
own ~/.jupyter settings still apply on top.

* No "Jupyter news" pop-up and no update check: the course runs offline (lab-settings/overrides.json
  sets fetchNews to "false"; the server neither fetches the news feed nor asks PyPI for updates).
* No nbgrader "Assignment List" panel: self-paced learners find the exercises in exercises/ and have no
  course exchange, so the panel would only say "Error fetching courses!" (the server extension is off
  in jupyter_server_config.d/course.json, the panel in lab-settings/page_config.json). The formgrader
  (instructors) and the Validate button stay. On a hub with an exchange, start `jupyter lab` without
  this folder to get the panel back.

lab-settings/ takes the place of the environment's share/jupyter/lab/settings (empty in .venv).
"""

from pathlib import Path

c = get_config()  # noqa: F821  (injected by traitlets)

c.LabApp.app_settings_dir = str(Path(__file__).resolve().parent / "lab-settings")
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.handlers.announcements.NeverCheckForUpdate"
