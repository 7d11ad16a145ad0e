"""Course maintenance: what instructors and maintainers run, never the lessons (``course_lib`` is theirs).

This package imports ``course_lib``; ``course_lib`` never imports it (``tests/test_audiences.py``).

release       generate the student release ``exercises/`` from ``solutions/``; check it for drift
grading       nbgrader preprocessors the course's grading uses (``nbgrader_config.py``)
nbtools       execute lessons in place, strip metadata, detect stale outputs, record run times
checked_outputs  which checked cells of the lessons differ on this machine (scripts/gpu_check.sh on a GPU)
freshness     what a lesson's outputs depend on (its course_lib modules, pinned libraries); explained stderr
sections      generated sections of the docs: rendered from a committed record, drift checks
experiments   measure what pretraining buys (README's "pretrained" block and its record)
mutation      mutation testing of the training core with mutmut: the score per module, kept in a record
build_assets  rebuild the embedded pretrained checkpoint (about 17 minutes on 2 CPU cores)
build_media_assets  build lesson 01b's tiny ViT and wav2vec2 checkpoints (random weights, seconds)
site          the course as a static site (``make site``): stage lessons, exercises, docs for MkDocs; build
site_pages    the site's pages as Markdown: a notebook with its committed outputs, the boxes, the home page
site_markdown  Jupyter's Markdown as Python-Markdown (nested lists, blank lines); links across the site
site_math     a Markdown extension: TeX formulas as MathML at build time (no script from a CDN)
"""
